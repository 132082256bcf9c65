"""Bounded-staleness PPO against the synchronous step, in one run, on the demo's task (docs/async.md).

    python benchmarks/async_ppo.py --out /tmp/async_ppo [--seeds 0 1 2] [--quick]

Arms, each for the demo's PPO (n=1) and MA-PPO (n=5), on every seed, from the same SFT and reward models (built
once, as `marlhf demo` builds them):

    sync     the engine in the trainer, 2 torch threads (today's step)
    async1   1 rollout worker (1 thread) + the trainer (1 thread), max_staleness 1
    async2   the same at max_staleness 2

Measured per run: steps/s (PPO steps over the training's wall time, the held-out evaluation excluded), held-out
gold after training, and the per-step gold of the rollouts against the wall time (gold.jsonl, time/step_seconds).
Printed: one line per method and arm, mean over seeds with a 95% t-interval, and each async arm's steps/s over
the sync arm's; results.json holds every run. The issue's targets: >= 1.5x steps/s at staleness 1, final gold
within the seeds' noise of sync. `--quick` is the demo's quick configuration with 4 PPO steps: a check that the
benchmark runs, not a measurement. Run it on an otherwise idle machine: the arms compete for the same cores.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marlhf.demo.config import DemoConfig  # noqa: E402
from marlhf.demo.pipeline import build_models, run_method  # noqa: E402
from marlhf.logging_utils import read_metrics  # noqa: E402

METHODS = {"ppo": {"termination": "fixed", "ngram": 1}, "ma_ppo": {"termination": "fixed", "ngram": 5}}
ARMS = {"sync": (2, {}),  # (the trainer's torch threads, PPOConfig options)
        "async1": (1, dict(rollout_workers=1, rollout_worker_threads=1, max_staleness=1)),
        "async2": (1, dict(rollout_workers=1, rollout_worker_threads=1, max_staleness=2))}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t quantiles


def interval(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    arguments = parser.parse_args()
    out = arguments.out
    config = (DemoConfig.quick(out=str(out), ppo_steps=4) if arguments.quick else DemoConfig(out=str(out)))
    torch.set_num_threads(2)
    models = build_models(config, out / "models")
    rl_prompts = models.task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)
    eval_prompts = [r["prompt"] for r in models.task.prompts(config.eval_prompts, seed=2)]
    runs = []
    for method, options in METHODS.items():
        for arm in arguments.arms:
            threads, arm_options = ARMS[arm]
            for seed in arguments.seeds:
                run_dir = out / "runs" / method / arm / f"seed{seed}"
                torch.set_num_threads(threads)
                start = time.perf_counter()
                held_out = run_method(config, models, {**options, **arm_options}, seed, run_dir, rl_prompts,
                                      eval_prompts, method)
                total = time.perf_counter() - start
                metrics = read_metrics(run_dir)
                train_seconds = sum(m["time/step_seconds"] for m in metrics)
                gold = [json.loads(line)["gold_reward"] for line in (run_dir / "gold.jsonl").read_text().splitlines()]
                clock = [sum(m["time/step_seconds"] for m in metrics[: i + 1]) for i in range(len(metrics))]
                runs.append(dict(method=method, arm=arm, seed=seed, steps_per_s=len(metrics) / train_seconds,
                                 gold_final=held_out["gold_reward"], gold_curve=list(zip(clock, gold)),
                                 seconds_with_eval=total,
                                 rollout_wait=[m.get("time/rollout_wait") for m in metrics]))
    torch.set_num_threads(2)
    (out / "results.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(f"\n{'method':8} {'arm':7} {'steps/s (95% CI)':32} {'x sync':>7}  held-out gold (95% CI)")
    for method in METHODS:
        base = [r["steps_per_s"] for r in runs if r["method"] == method and r["arm"] == "sync"]
        for arm in arguments.arms:
            mine = [r for r in runs if r["method"] == method and r["arm"] == arm]
            speed = [r["steps_per_s"] for r in mine]
            ratio = f"{statistics.fmean(speed) / statistics.fmean(base):.2f}" if base else "-"
            print(f"{method:8} {arm:7} {interval(speed):32} {ratio:>7}  {interval([r['gold_final'] for r in mine])}")
    if arguments.quick:
        print("(--quick: a check that the benchmark runs, not a measurement)")


if __name__ == "__main__":
    main()
