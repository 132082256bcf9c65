"""Cost of the macro-action math next to token-level PPO math, and next to a per-row loop.

For a ragged batch of B x T response tokens (default 256 x 512), times one PPO step's worth of
core math, forward and backward of the policy loss included:

  macro : fixed_ngram(n) segmentation + macro_gae + policy_loss and value_loss with segment_ids
  token : token_gae + policy_loss and value_loss without segments
  loop  : the same macro math written per row with torch.split, the style the paper describes

The three run interleaved in one process (this machine is noisy), and the ratios are printed.

    python benchmarks/core_overhead.py [--batch 256] [--width 512] [--ngram 5] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from marlhf.advantages import kl_penalized_rewards, macro_gae, token_gae
from marlhf.losses import policy_loss, value_loss
from marlhf.segments import fixed_ngram, perplexity, randomized_ngram


def make_batch(batch: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (batch,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    old_logprobs = -torch.rand(batch, width, generator=g) * 3
    logprobs = old_logprobs + 0.05 * torch.randn(batch, width, generator=g)
    ref_logprobs = old_logprobs + 0.05 * torch.randn(batch, width, generator=g)
    values = torch.randn(batch, width, generator=g)
    scores = torch.randn(batch, generator=g)
    rewards = kl_penalized_rewards(scores, old_logprobs, ref_logprobs, mask, 0.05)
    return mask, lengths, logprobs, old_logprobs, ref_logprobs, values, rewards


def macro_step(mask, logprobs, old_logprobs, values, rewards, ngram):
    logprobs = logprobs.detach().requires_grad_(True)
    segment_ids = fixed_ngram(mask, ngram)
    advantages, returns = macro_gae(rewards, values, mask, segment_ids)
    pg, _ = policy_loss(logprobs, old_logprobs, advantages, mask, segment_ids)
    vf, _ = value_loss(values, values, returns, mask, segment_ids, clip=0.2)
    (pg + vf).backward()


def token_step(mask, logprobs, old_logprobs, values, rewards):
    logprobs = logprobs.detach().requires_grad_(True)
    advantages, returns = token_gae(rewards, values, mask)
    pg, _ = policy_loss(logprobs, old_logprobs, advantages, mask)
    vf, _ = value_loss(values, values, returns, mask, clip=0.2)
    (pg + vf).backward()


def loop_step(lengths, logprobs, old_logprobs, values, rewards, ngram, gamma=1.0, lam=0.95, clip=0.2):
    """Per row: split the response into n-token pieces with torch.split, aggregate, run GAE over
    the pieces, and build the clipped loss piece by piece."""
    logprobs = logprobs.detach().requires_grad_(True)
    total_loss, total_tokens = logprobs.new_zeros(()), 0
    for b, length in enumerate(lengths.tolist()):
        sizes = [ngram] * (length // ngram) + ([length % ngram] if length % ngram else [])
        seg_rewards = torch.stack([r.sum() for r in torch.split(rewards[b, :length], sizes)])
        seg_values = torch.stack([v.mean() for v in torch.split(values[b, :length], sizes)])
        log_ratios = torch.stack(
            [(new - old).sum() for new, old in zip(
                torch.split(logprobs[b, :length], sizes), torch.split(old_logprobs[b, :length], sizes)
            )]
        )
        advantages = torch.zeros_like(seg_values)
        last = 0.0
        for k in reversed(range(len(sizes))):
            next_value = seg_values[k + 1] if k + 1 < len(sizes) else 0.0
            delta = seg_rewards[k] + gamma * next_value - seg_values[k]
            last = delta + gamma * lam * last
            advantages[k] = last
        returns = advantages + seg_values
        ratio = torch.exp(log_ratios.clamp(-20, 20))
        surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
        weights = torch.tensor(sizes, dtype=surrogate.dtype)
        total_loss = total_loss + (surrogate * weights).sum() + 0.5 * (((seg_values - returns) ** 2) * weights).sum()
        total_tokens += length
    (total_loss / total_tokens).backward()


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mask, lengths, logprobs, old_logprobs, ref_logprobs, values, rewards = make_batch(args.batch, args.width)

    for _ in range(3):  # warm-up
        macro_step(mask, logprobs, old_logprobs, values, rewards, args.ngram)
        token_step(mask, logprobs, old_logprobs, values, rewards)
    times = {"macro": [], "token": [], "loop": []}
    for i in range(args.repeats):
        times["macro"].append(timed(macro_step, mask, logprobs, old_logprobs, values, rewards, args.ngram))
        times["token"].append(timed(token_step, mask, logprobs, old_logprobs, values, rewards))
        if i < args.loop_repeats:
            times["loop"].append(timed(loop_step, lengths, logprobs, old_logprobs, values, rewards, args.ngram))
    median = {k: statistics.median(v) for k, v in times.items()}

    seg_times = {
        "fixed_ngram": statistics.median(timed(fixed_ngram, mask, args.ngram) for _ in range(args.repeats)),
        "randomized_ngram": statistics.median(timed(randomized_ngram, mask) for _ in range(args.repeats)),
        "perplexity": statistics.median(timed(perplexity, mask, ref_logprobs) for _ in range(3)),
    }

    print(f"batch {args.batch} x {args.width} tokens ({int(mask.sum())} real), n = {args.ngram}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"  macro path (segment + macro GAE + losses, fwd+bwd): {median['macro'] * 1e3:8.2f} ms")
    print(f"  token path (token GAE + losses, fwd+bwd):           {median['token'] * 1e3:8.2f} ms")
    print(f"  per-row loop with torch.split:                       {median['loop'] * 1e3:8.2f} ms")
    print(f"  macro / token = {median['macro'] / median['token']:.2f}x  (target <= 1.2x)")
    print(f"  loop / macro  = {median['loop'] / median['macro']:.0f}x  (target >= 50x)")
    print("segmentation alone: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in seg_times.items()))


if __name__ == "__main__":
    main()
