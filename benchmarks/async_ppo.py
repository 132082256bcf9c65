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
the sync arm's, over all steps and from step 3 on (the first k + 1 steps wait for the workers' start: a fixed
cost per run, not the pipeline's rate); results.json holds every run, each step's seconds by stage included;
async_ppo.png draws the gold curves against wall time and a step's seconds by stage. `--summarize` prints the
table and draws the figure again from an OUT's results.json (benchmarks/results/async_ppo/ holds the committed
measurement). The issue's targets: >= 1.5x steps/s at staleness 1, final gold
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
from marlhf.evaluation.plots import pyplot  # noqa: E402
from marlhf.logging_utils import read_metrics  # noqa: E402

METHODS = {"ppo": {"termination": "fixed", "ngram": 1}, "ma_ppo": {"termination": "fixed", "ngram": 5}}
ARMS = {"sync": (2, {}),  # (the trainer's torch threads, PPOConfig options)
        "async1": (1, dict(rollout_workers=1, rollout_worker_threads=1, max_staleness=1)),
        "async2": (1, dict(rollout_workers=1, rollout_worker_threads=1, max_staleness=2))}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t quantiles


def interval(values: list[float], sign: bool = False) -> str:
    """The mean and its 95% t-interval (`sign`: with + on positive numbers, for differences)."""
    form = "+.3f" if sign else ".3f"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:{form}}"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:{form}} [{mean - half:{form}}, {mean + half:{form}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--summarize", action="store_true", help="print the table and draw the figure of OUT's "
                                                                   "results.json, without running anything")
    arguments = parser.parse_args()
    out = arguments.out
    if not arguments.summarize:
        (out / "results.json").write_text(json.dumps(measure(arguments), indent=1) + "\n")
    summarize(out, quick=arguments.quick)


def measure(arguments: argparse.Namespace) -> list[dict]:
    """Every (method, arm, seed) run, one after the other, from the same SFT and reward models."""
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
                                 seconds_with_eval=total, timings=step_timings(metrics)))
    torch.set_num_threads(2)
    return runs


def summarize(out: Path, quick: bool = False) -> None:
    """The table (mean over seeds, 95% t-interval; each arm's steps/s over sync's) and OUT/async_ppo.png."""
    runs = json.loads((out / "results.json").read_text())
    arms = [arm for arm in ARMS if any(r["arm"] == arm for r in runs)]
    for run in runs:  # without the first k + 1 steps, which wait for the workers' start (k = 2: the largest)
        seconds = [sum(step.values()) for step in run["timings"][3:]]
        run["steady_steps_per_s"] = len(seconds) / sum(seconds) if seconds else float("nan")
    print(f"\n{'method':8} {'arm':7} {'steps/s (95% CI)':28} {'x sync':>6}  {'from step 3':28} {'x sync':>6}  "
          f"{'held-out gold (95% CI)':28} gold - sync's, paired by seed")
    for method in METHODS:
        base = [r for r in runs if r["method"] == method and r["arm"] == "sync"]
        for arm in arms:
            mine = [r for r in runs if r["method"] == method and r["arm"] == arm]
            columns = []
            for key in ("steps_per_s", "steady_steps_per_s"):
                speed = [r[key] for r in mine]
                ratio = f"{statistics.fmean(speed) / statistics.fmean(r[key] for r in base):.2f}" if base else "-"
                columns.append(f"{interval(speed):28} {ratio:>6}")
            sync_gold = {r["seed"]: r["gold_final"] for r in base}
            paired = [r["gold_final"] - sync_gold[r["seed"]] for r in mine if r["seed"] in sync_gold]
            difference = interval(paired, sign=True) if paired and arm != "sync" else "-"
            print(f"{method:8} {arm:7} {'  '.join(columns)}  {interval([r['gold_final'] for r in mine]):28} "
                  f"{difference}")
    plot(runs, arms, out / "async_ppo.png")
    print(f"figure: {out / 'async_ppo.png'}")
    if quick:
        print("(--quick: a check that the benchmark runs, not a measurement)")


STAGES = {"rollout_wait": "waiting for the rollout", "generation": "generation (in the trainer)",
          "scoring": "scoring", "advantages": "advantages", "update": "update", "other": "the rest (metrics, logging)"}


def step_timings(metrics: list[dict]) -> list[dict[str, float]]:
    """Each step's seconds by stage (STAGES), summing to time/step_seconds. With workers the trainer's generation
    stage is the wait for the batch (its clock covers the wait), so it counts as `rollout_wait` only; `update`
    is time/update without time/advantages."""
    timings = []
    for m in metrics:
        waited = "time/rollout_wait" in m
        stages = {"rollout_wait": m["time/generation"] if waited else 0.0,
                  "generation": 0.0 if waited else m["time/generation"], "scoring": m["time/scoring"],
                  "advantages": m["time/advantages"], "update": m["time/update"] - m["time/advantages"]}
        timings.append({**stages, "other": m["time/step_seconds"] - sum(stages.values())})
    return timings


def plot(runs: list[dict], arms: list[str], path: Path) -> None:
    """Per method: the rollouts' gold against training wall time (mean over seeds at each step), and the mean
    seconds of a step by stage for each arm."""
    plt = pyplot()
    figure, axes = plt.subplots(2, len(METHODS), figsize=(6 * len(METHODS), 8), squeeze=False)
    for column, method in enumerate(METHODS):
        curves, bars = axes[0][column], axes[1][column]
        for arm in arms:
            mine = [r for r in runs if r["method"] == method and r["arm"] == arm]
            steps = min(len(r["gold_curve"]) for r in mine)
            clock = [statistics.fmean(r["gold_curve"][i][0] for r in mine) for i in range(steps)]
            gold = [statistics.fmean(r["gold_curve"][i][1] for r in mine) for i in range(steps)]
            curves.plot(clock, gold, label=f"{arm} ({len(mine)} seeds)")
        curves.set(title=f"{method}: rollout gold against wall time", xlabel="training seconds",
                   ylabel="gold reward of the step's rollouts")
        curves.legend()
        bottom = [0.0] * len(arms)
        for stage, label in STAGES.items():
            heights = [statistics.fmean(step[stage] for r in runs if r["method"] == method and r["arm"] == arm
                                        for step in r["timings"]) for arm in arms]
            bars.bar(arms, heights, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        bars.set(title=f"{method}: seconds of a step, by stage (mean)", ylabel="seconds",
                 ylim=(0, max(bottom) * 1.6))
        bars.legend(fontsize="small", ncols=2, loc="upper center")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
