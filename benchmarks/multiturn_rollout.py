"""Throughput of multi-turn rollouts against single-turn rollouts of the same action tokens, side by side, on the hf
engine: action tokens per second of `--batch` episodes of `--turns` turns of `--turn-tokens` tokens each, with an
environment reply of `--observation-tokens` tokens between turns (marlhf.multiturn.rollout_episodes), against one
`generate` call of `--batch` rows x turns * turn-tokens tokens from the same prompts (what a single-turn rollout
does); and the share of the multi-turn rollout's time spent in the environments' `step`. The multi-turn rollout
runs twice: as marlhf runs it on the hf engine (each turn continues the last turn's KV cache) and re-reading every
episode's whole context at each turn (a generate function without a cache, as any engine without one is driven).

The policy and tokenizer of ppo_step.py (a ~5M-parameter Llama, 4,096-word vocabulary, random weights: turns
rarely stop before `--turn-tokens`), prompts of `--prompt-lengths` tokens (the environment's first observation).
The environment is a script: it replies with random words and ends the episode after its last turn; `--step-ms`
adds a sleep to each step (an environment that waits on something). Tokens counted are the sampled ones (action
tokens; the multi-turn rows also hold the observations, which are not counted). The two rollouts alternate in
`--rounds` rounds after an untimed warm-up; the median round is printed, with the ratios of the medians (the issue's
target on the hf engine: at least 0.7x).

    python benchmarks/multiturn_rollout.py [--batch 16] [--turns 4] [--turn-tokens 16] [--observation-tokens 8]
                                           [--prompt-lengths 32 64] [--step-ms 0] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from ppo_step import VOCAB_SIZE, llama, word_tokenizer

from marlhf.engines import model_positions
from marlhf.engines.hf import HFEngine
from marlhf.envs import Env
from marlhf.multiturn import MultiTurnOptions, EngineSampler, rollout_episodes


class ScriptedEnv(Env):
    """First observation: `prompt_lengths` random words; each reply: `observation_tokens` random words; the
    episode terminates after `turns` turns. `step_ms`: a sleep in every step."""

    def __init__(self, turns: int, observation_tokens: int, prompt_lengths: tuple[int, int], step_ms: float) -> None:
        self.turns, self.observation_tokens, self.prompt_lengths = turns, observation_tokens, prompt_lengths
        self.step_ms = step_ms

    def words(self, count: int) -> str:
        return " ".join(f"w{self.rng.randrange(1, VOCAB_SIZE - 3)}" for _ in range(count))

    def reset(self, seed, task=None):
        self.rng, self.turn = random.Random(seed), 0
        return self.words(self.rng.randint(*self.prompt_lengths)), {}

    def step(self, action_text):
        self.turn += 1
        if self.step_ms:
            time.sleep(self.step_ms / 1000)
        return self.words(self.observation_tokens), 0.0, self.turn >= self.turns, False, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--observation-tokens", type=int, default=8)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    tokenizer = word_tokenizer()
    policy = llama(tokenizer, seed=0).eval()
    engine = HFEngine()
    engine.sync_weights(policy)
    generate = EngineSampler(engine, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    options = MultiTurnOptions(max_turns=arguments.turns, max_turn_tokens=arguments.turn_tokens,
                               max_response_tokens=arguments.turns * (arguments.turn_tokens
                                                                      + arguments.observation_tokens + 2))

    def multi_turn(seeds: list[int], sampler):
        envs = [ScriptedEnv(arguments.turns, arguments.observation_tokens, tuple(arguments.prompt_lengths),
                            arguments.step_ms) for _ in seeds]
        return rollout_episodes(envs, sampler, tokenizer, seeds=seeds, options=options,
                                max_length=model_positions(policy))

    def rereading(ids, mask, seeds, max_new_tokens):
        return generate(ids, mask, seeds, max_new_tokens)  # no new_cache: every call reads the whole contexts

    rates: dict[str, list[float]] = {"multi-turn": [], "re-reading": [], "single-turn": []}
    step_shares, counts = [], {}
    with torch.no_grad():
        for round_number in range(arguments.rounds + 1):  # round 0 warms up
            seeds = [round_number * 100_000 + row for row in range(arguments.batch)]
            start = time.perf_counter()
            rollout = multi_turn(seeds, generate)
            middle = time.perf_counter()
            reread = multi_turn(seeds, rereading)
            later = time.perf_counter()
            single = generate(rollout.prompt_ids, rollout.prompt_mask, seeds, arguments.turns * arguments.turn_tokens)
            end = time.perf_counter()
            counts = {"multi-turn": int(rollout.action_mask.sum()), "re-reading": int(reread.action_mask.sum()),
                      "single-turn": int(single.response_mask.sum())}
            if round_number:
                rates["multi-turn"].append(counts["multi-turn"] / (middle - start))
                rates["re-reading"].append(counts["re-reading"] / (later - middle))
                rates["single-turn"].append(counts["single-turn"] / (end - later))
                step_shares.append(rollout.metrics["env/step_seconds"] / (middle - start))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {arguments.batch} episodes, prompts of "
          f"{arguments.prompt_lengths[0]}-{arguments.prompt_lengths[1]} tokens; multi-turn: {arguments.turns} turns of "
          f"{arguments.turn_tokens} tokens, replies of {arguments.observation_tokens} tokens, step sleep "
          f"{arguments.step_ms:g} ms; single-turn: {arguments.turns * arguments.turn_tokens} new tokens in one call")
    for name in rates:
        print(f"{name:>11}: {counts[name]:6d} action tokens a round, median {statistics.median(rates[name]):8.1f} "
              f"tokens/s (rounds: {', '.join(f'{rate:.1f}' for rate in rates[name])})")
    print(f"multi-turn: {rollout.metrics['env/generate_calls']:.0f} generate calls a round, median share of time in "
          f"step {statistics.median(step_shares):.2%}")
    for name in ("multi-turn", "re-reading"):
        ratio = statistics.median(rates[name]) / statistics.median(rates["single-turn"])
        print(f"{name} / single-turn action tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
