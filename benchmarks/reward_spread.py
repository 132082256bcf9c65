"""How much the gold reward varies between the samples of one prompt at the SFT model, per task of the
credit-assignment study: the advantage signal PPO has to work with before any update.

    python benchmarks/reward_spread.py --work bench_credit_assignment    # the study's models (built by its grid)

Samples 8 responses for each of 32 prompts (temperature 0.8, the study's) and prints the gold reward's mean,
its spread over all samples, within a prompt's samples and between prompts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from credit_assignment import TASKS  # noqa: E402

from marlhf.demo import DemoConfig  # noqa: E402
from marlhf.demo.pipeline import MAX_PROMPT_TOKENS, load_models, max_response_tokens  # noqa: E402
from marlhf.evaluation.evaluate import generate_texts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench_credit_assignment", help="the credit-assignment grid's --work")
    parser.add_argument("--tasks", nargs="+", default=["task1", "task2"], choices=tuple(TASKS))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    for task in arguments.tasks:
        config = DemoConfig(**TASKS[task])
        models = load_models(config, Path(arguments.work) / "models" / task)
        prompts = [r["prompt"] for r in models.task.prompts(arguments.prompts, seed=5)]
        torch.manual_seed(0)
        samples = generate_texts(models.sft, models.tokenizer, prompts, samples_per_prompt=arguments.samples,
                                 batch_size=64, max_prompt_length=MAX_PROMPT_TOKENS,
                                 max_new_tokens=max_response_tokens(config.num_words), temperature=0.8)
        golds = [models.task.gold_rewards([p] * len(s), s) for p, s in zip(prompts, samples)]
        flat = [g for row in golds for g in row]
        print(f"{task}: gold mean {statistics.mean(flat):.3f}; std over all samples {statistics.pstdev(flat):.3f}, "
              f"within a prompt's {arguments.samples} samples {statistics.mean(map(statistics.pstdev, golds)):.3f}, "
              f"between prompts' means {statistics.pstdev([statistics.mean(row) for row in golds]):.3f}")


if __name__ == "__main__":
    main()
