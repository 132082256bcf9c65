"""Fixed-seed PPO runs on tiny models, for benchmarks/compare_runs.py: the update layouts the demo does not
take (several mini-batches and pieces, epochs > 1) with each termination rule, weighting and estimator family.

    git worktree add /tmp/before HEAD~1
    PYTHONPATH=/tmp/before python /tmp/before/benchmarks/fixed_seed_ppo.py --out /tmp/ppo_before
    python benchmarks/fixed_seed_ppo.py --out /tmp/ppo_after
    python benchmarks/compare_runs.py /tmp/ppo_before /tmp/ppo_after

Seconds on a CPU; the models and prompts are the test suite's (tests/conftest.py, tests/trainers/test_ppo.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package of this checkout

from marlhf.trainers.ppo import train_ppo  # noqa: E402
from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer  # noqa: E402
from tests.trainers.test_ppo import RECORDS, _config, count_e  # noqa: E402

CASES = {
    "mb4_ga2_ep2": dict(per_device_batch_size=8, mini_batch_size=4, gradient_accumulation_steps=2, ppo_epochs=2),
    "word_uniform": dict(per_device_batch_size=8, mini_batch_size=4, termination="word", segment_weighting="uniform",
                         ppo_epochs=2),
    "randomized_position_token": dict(per_device_batch_size=8, mini_batch_size=2, termination="randomized",
                                      value_weighting="position", value_loss_granularity="token"),
    "rloo_seq_mean": dict(per_device_batch_size=4, num_samples_per_prompt=2, mini_batch_size=4, advantage="rloo",
                          loss_agg_mode="seq-mean-token-mean"),
    "perplexity_first_geometric": dict(per_device_batch_size=8, mini_batch_size=8, termination="perplexity",
                                       value_weighting="first", segment_weighting="geometric", ppo_epochs=2),
    "one_update_reuses_forward": dict(per_device_batch_size=8, mini_batch_size=8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    for name, options in CASES.items():
        config = _config(arguments.out / name, max_steps=arguments.steps, **options)
        train_ppo(config, RECORDS, policy=build_tiny_causal_lm(tokenizer), tokenizer=tokenizer, reward_fn=count_e)
        print(f"{name}: {config.output_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
