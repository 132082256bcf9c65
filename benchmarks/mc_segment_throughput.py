"""Throughput of mc_segment's Monte-Carlo continuations against the main rollout's, side by side: tokens per second
of the rollout (one `generate` call: `--batch` prompts x `--new-tokens` tokens) and of the continuations of its
responses (one call for all rows and boundaries: `--max-boundaries` kept boundaries of fixed `--ngram` segments
per response, `--mc-samples` continuations each, each up to the response length), through the hf engine and
marlhf.trainers.continuations.PrefixContinuations, as PPO runs them.

The policy and tokenizer of ppo_step.py (a ~5M-parameter Llama, 4,096-word vocabulary, random weights: responses
rarely stop before `--new-tokens`), prompts of `--prompt-lengths` tokens; a trivial reward (a token count), so the
continuation call's time is its generation, prefix building and joining. Tokens counted are the kept ones (up to
each row's EOS and the response length); the continuation call also decodes, for every row, as many steps as the
longest continuation needs (the first boundary's: the whole response), and the share of decoded tokens kept is
printed. Rollout and continuations alternate in
`--rounds` rounds after an untimed warm-up; the median round is printed.

    python benchmarks/mc_segment_throughput.py [--batch 16] [--new-tokens 64] [--mc-samples 2] [--max-boundaries 4]
                                               [--ngram 5] [--prompt-lengths 32 64] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from ppo_step import llama, word_tokenizer

from marlhf.trainers.continuations import PrefixContinuations
from marlhf.engines import model_positions
from marlhf.engines.hf import HFEngine
from marlhf.estimators.mc_segment import mc_boundary_values
from marlhf.data.encoding import pad_sequences
from marlhf.segments import fixed_ngram, keep_boundaries, num_segments
from marlhf.trainers.ppo_setup import mixed_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--mc-samples", type=int, default=2)
    parser.add_argument("--max-boundaries", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    tokenizer = word_tokenizer()
    policy = llama(tokenizer, seed=0).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randint(*arguments.prompt_lengths))]
               for _ in range(arguments.batch)]
    prompt_ids, prompt_mask = pad_sequences(prompts, tokenizer.pad_token_id, "left")
    prompt_mask = prompt_mask.bool()
    engine = HFEngine()
    engine.sync_weights(policy)
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)

    def rollout(round_seed: int):
        seeds = [round_seed * 100_000 + row for row in range(arguments.batch)]
        return engine.generate(prompt_ids, prompt_mask, row_seeds=seeds, max_new_tokens=arguments.new_tokens,
                               **sampling)

    decoded_tokens = []

    def decoded(generation):
        decoded_tokens.append(int(generation.response_mask.sum()))  # up to EOS, before the cut at the length
        return generation

    def continuations(generation, round_seed: int) -> tuple[PrefixContinuations, int]:
        """The continuations of one rollout's responses, and how many boundaries they continued."""
        continuer = PrefixContinuations(
            prompt_ids, prompt_mask, generation.response_ids,
            lambda ids, mask, seeds, new: decoded(engine.generate(ids, mask, row_seeds=seeds, max_new_tokens=new,
                                                                  **sampling)),
            lambda rows, q, qm, ids, mask: mask.sum(1).float(),
            lambda row, length, sample: mixed_seed(round_seed, row, length + 1, sample),
            arguments.new_tokens, tokenizer.pad_token_id, model_positions(policy))
        segment_ids = keep_boundaries(fixed_ngram(generation.response_mask, arguments.ngram), arguments.max_boundaries)
        mc_boundary_values(continuer, segment_ids, arguments.mc_samples)
        return continuer, int(num_segments(segment_ids).sum())

    rates = {"rollout": [], "continuations": []}
    counts = {}
    with torch.no_grad():
        for round_number in range(arguments.rounds + 1):  # round 0 warms up
            start = time.perf_counter()
            generation = rollout(round_number)
            middle = time.perf_counter()
            continuer, boundaries = continuations(generation, round_number)
            end = time.perf_counter()
            assert continuer.calls == 1
            counts = {"rollout": int(generation.response_mask.sum()), "continuations": continuer.tokens}
            if round_number:
                rates["rollout"].append(counts["rollout"] / (middle - start))
                rates["continuations"].append(counts["continuations"] / (end - middle))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {arguments.batch} prompts of "
          f"{arguments.prompt_lengths[0]}-{arguments.prompt_lengths[1]} tokens, {arguments.new_tokens} new tokens; "
          f"continuations: {boundaries} boundaries x {arguments.mc_samples} samples in one call")
    for name in rates:
        print(f"{name:>14}: {counts[name]:6d} tokens a round, median {statistics.median(rates[name]):8.1f} tokens/s "
              f"(rounds: {', '.join(f'{rate:.1f}' for rate in rates[name])})")
    print(f"continuations: {counts['continuations'] / decoded_tokens[-1]:.0%} of the tokens decoded are kept (the "
          "rest run past the response length)")
    ratio = statistics.median(rates["continuations"]) / statistics.median(rates["rollout"])
    print(f"continuations / rollout tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
