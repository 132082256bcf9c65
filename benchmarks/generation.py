"""Generation options side by side: seconds to sample a batch with each hf-engine option, and whether the
responses are identical to the default's.

The policy and tokenizer of ppo_step.py (a ~5M-parameter Llama, 4,096-word vocabulary, random weights), a batch
of prompts of `--prompt-lengths` tokens (default 32-64), `--new-tokens` sampled tokens. Options: `sampling_noise` (row_generators: one torch
generator per row; counter_hash: one batched hash for all rows) and `kv_cache` (dynamic; static; static_compiled,
whose compilation happens in the untimed first call). The options
run in alternating rounds (the machine's noise hits all of them alike); the median and min of the rounds are
printed with each option's median over the first's (one generator per row, dynamic cache: generate_responses'
defaults, and PPO's). Exactness: each option's responses against those of the
same noise with the dynamic cache (counter_hash samples other, equally distributed, tokens than row_generators).
`--profile`: where one default generate call spends its time: the model's forward calls against the rest of
`generate` (its Python loop, logits processors, stop checks), and the heaviest torch operators.

    python benchmarks/generation.py [--batch 16] [--new-tokens 64] [--prompt-lengths 32 64] [--rounds 5] [--threads 1]
                                    [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch
from ppo_step import VOCAB_SIZE, llama, word_tokenizer

from marlhf.modeling import pad_sequences
from marlhf.rollout import generate_responses

OPTIONS = [("row_generators", "dynamic"), ("row_generators", "static"), ("row_generators", "static_compiled"),
           ("counter_hash", "dynamic"), ("counter_hash", "static")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                        help="prompt lengths in tokens, drawn uniformly (the paper's PPO shape: 32 256)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="also profile one default generate call")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = word_tokenizer()
    policy = llama(tokenizer, seed=0).to(device).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(*args.prompt_lengths))]
               for _ in range(args.batch)]
    query_ids, query_mask = pad_sequences(prompts, tokenizer.pad_token_id, "left")
    query_ids, query_mask = query_ids.to(device), query_mask.bool().to(device)
    sampling = dict(max_new_tokens=args.new_tokens, temperature=0.7, top_k=0, top_p=1.0,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    row_seeds=list(range(args.batch)))

    def sample(noise: str, cache: str) -> tuple[float, torch.Tensor]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        response_ids, _ = generate_responses(policy, query_ids, query_mask, sampling_noise=noise, kv_cache=cache,
                                             **sampling)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, response_ids

    responses = {option: sample(*option)[1] for option in OPTIONS}  # also the warm-up
    seconds: dict[tuple[str, str], list[float]] = {option: [] for option in OPTIONS}
    for _ in range(args.rounds):
        for option in OPTIONS:
            seconds[option].append(sample(*option)[0])
    where = "cuda" if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"generation, batch {args.batch}, prompts {args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, "
          f"{args.new_tokens} new tokens, {where}, {args.rounds} alternating rounds")
    print(f"{'sampling_noise':<16}{'kv_cache':<17}{'median s':>10}{'min s':>8}{'vs first':>12}  same tokens as")
    default = statistics.median(seconds[OPTIONS[0]])
    for noise, cache in OPTIONS:
        reference = (noise, "dynamic")
        same = torch.equal(responses[noise, cache], responses[reference])
        median = statistics.median(seconds[noise, cache])
        print(f"{noise:<16}{cache:<17}{median:>10.3f}{min(seconds[noise, cache]):>8.3f}{median / default:>11.2f}x"
              f"  {noise}+dynamic: {'yes' if same else 'NO'}")
    if args.profile:
        profile(policy, lambda: sample(*OPTIONS[0]))


def profile(policy: torch.nn.Module, generate) -> None:
    """Share of the model's forward calls in one generate call (timed around `policy.forward`), then the
    functions and torch operators with the most self time under cProfile."""
    forward_seconds = [0.0]
    forward = policy.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    policy.forward = timed_forward
    try:
        total = generate()[0]
    finally:
        del policy.forward  # back to the class's method
    print(f"profile of one {OPTIONS[0][0]}+{OPTIONS[0][1]} call: {total:.3f} s, model forward {forward_seconds[0]:.3f} s "
          f"({forward_seconds[0] / total:.0%}), the rest of generate {total - forward_seconds[0]:.3f} s "
          f"({1 - forward_seconds[0] / total:.0%})")
    profiler = cProfile.Profile()  # torch.profiler's own overhead inflates the cache's many small copies
    profiler.enable()
    generate()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, calls, self time, cumulative, callers)
    rows = sorted(((self_time, calls, name) for (_, _, name), (calls, _, self_time, _, _) in stats.items()),
                  reverse=True)
    everything = sum(row[0] for row in rows)
    print("heaviest functions by self time (share of the call):")
    for self_time, calls, name in rows[:6]:
        print(f"  {name:<48}{self_time:>8.3f} s {self_time / everything:>6.0%}  {calls} calls")


if __name__ == "__main__":
    main()
