"""What cutting padding saves: forward passes over length-sorted chunks with their common padding cut
(marlhf.rollout.forward_in_pieces, used by PPO's scoring and its update pieces) against the same chunks in
random order, each as wide as the whole batch (what a plain split of the padded batch computes).

    python benchmarks/padding.py [--batch 32] [--chunk 4] [--prompt-lengths 32 256] [--response-lengths 8 64]
                                 [--repeats 3] [--threads 1]

Workload: the ~5M-parameter Llama of benchmarks/ppo_step.py (random weights, no download), `batch` rows of a
left-padded prompt and a right-padded response, lengths drawn uniformly from the given ranges (TL;DR prompts
run from tens to hundreds of tokens), chunks of `chunk` rows (the paper's PPO configs: 32 rows per device,
8 accumulation pieces of 4). Timed side by side, alternating, best of `repeats`: a no-gradient log-prob pass
(rollout scoring) and a forward + backward pass (the update). Also prints the share of computed positions
that are padding. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import torch

from marlhf.data.encoding import pad_sequences
from marlhf.rollout import forward_in_pieces, length_sorted_pieces, response_logprobs, row_lengths
from ppo_step import VOCAB_SIZE, llama, word_tokenizer


def ragged_batch(batch: int, prompt_lengths: tuple[int, int], response_lengths: tuple[int, int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> list[list[int]]:
        lengths = torch.randint(low, high + 1, (batch,), generator=generator)
        return [torch.randint(3, VOCAB_SIZE, (int(n),), generator=generator).tolist() for n in lengths]

    prompt_ids, prompt_mask = pad_sequences(draw(*prompt_lengths), 0, "left")
    response_ids, response_mask = pad_sequences(draw(*response_lengths), 0, "right")
    return prompt_ids, prompt_mask.bool(), response_ids, response_mask.bool()


def padded_chunks(forward, prompt_ids, prompt_mask, response_ids, response_mask, piece_size: int) -> torch.Tensor:
    """The baseline: chunks of the padded batch in random order, every chunk as wide as the batch."""
    order = torch.randperm(prompt_ids.shape[0], generator=torch.Generator().manual_seed(1))
    outputs = [forward(prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows])
               for rows in order.split(piece_size)]
    return torch.cat(outputs)[order.argsort()]


def computed_padding(prompt_mask, response_mask, chunks: list[torch.Tensor], trimmed: bool) -> float:
    computed = 0
    for rows in chunks:
        if trimmed:
            computed += len(rows) * (int(prompt_mask[rows].any(0).sum()) + int(response_mask[rows].any(0).sum()))
        else:
            computed += len(rows) * (prompt_mask.shape[1] + response_mask.shape[1])
    return 1 - (int(prompt_mask.sum()) + int(response_mask.sum())) / computed


def best_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--response-lengths", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    policy = llama(word_tokenizer(), seed=0)
    batch = ragged_batch(args.batch, args.prompt_lengths, args.response_lengths)
    prompt_mask, response_mask = batch[1], batch[3]

    def logprobs(*rows):
        return response_logprobs(policy, *rows, temperature=0.7)

    def scoring(chunked):
        with torch.no_grad():
            chunked(logprobs, *batch, piece_size=args.chunk)

    def update(chunked):
        policy.zero_grad(set_to_none=True)
        chunked(logprobs, *batch, piece_size=args.chunk).sum().backward()

    with torch.no_grad():  # both ways compute the same numbers
        torch.testing.assert_close(forward_in_pieces(logprobs, *batch, piece_size=args.chunk),
                                   padded_chunks(logprobs, *batch, piece_size=args.chunk), atol=1e-4, rtol=1e-4)
    sorted_chunks = length_sorted_pieces(*row_lengths(prompt_mask, response_mask), args.chunk)
    random_chunks = list(torch.randperm(args.batch).split(args.chunk))
    print(f"Llama ~5M params, {args.batch} rows, prompts {args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, "
          f"responses {args.response_lengths[0]}-{args.response_lengths[1]}, chunks of {args.chunk}, CPU "
          f"{args.threads} thread(s), best of {args.repeats}")
    print(f"  padding computed: padded chunks {computed_padding(prompt_mask, response_mask, random_chunks, False):.0%}, "
          f"sorted + cut {computed_padding(prompt_mask, response_mask, sorted_chunks, True):.0%}")
    policy.eval()
    for name, step in (("scoring (no grad)", scoring), ("update (fwd + bwd)", update)):
        padded = best_seconds(lambda: step(padded_chunks), args.repeats)
        trimmed = best_seconds(lambda: step(forward_in_pieces), args.repeats)
        print(f"  {name:19s} padded chunks {padded:.3f} s   sorted + cut {trimmed:.3f} s   "
              f"speed-up {padded / trimmed:.2f}x")


if __name__ == "__main__":
    main()
