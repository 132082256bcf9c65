"""Summary, plot and Markdown report of PPO against MA-PPO runs on the demo task.

A method's runs (one per seed) are `marlhf.evaluation.plots.RunMetrics` whose rows join the trainer's
metrics.jsonl with the demo's per-step gold rewards, so the curves use the same grouping and smoothing as
`marlhf plot`.
"""

from __future__ import annotations

import json
import time
import typing
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from marlhf.demo.config import SAMPLES_PER_PROMPT, BaselineMethod, DemoConfig
from marlhf.demo.task import SyntheticTask
from marlhf.evaluation.plots import RunMetrics, group_curves, pyplot
from marlhf.evaluation.stats import paired_t
from marlhf.logging_utils import METRICS_FILE

BASELINE = "ppo"
GOLD_FILE = "gold.jsonl"  # per PPO step: gold (and reward-model) reward of the step's rollouts
FINAL_KEYS = ("gold_reward", "rm_reward", "kl")
STUDY_II = ("What a larger test found: Study II (docs/studies/lambda.md; 3 tasks, 8 seeds on 2 builds, tuned "
            "token-level baselines, equal KL) detected no difference between MA-PPO (n = 5, `first`) and token-level "
            "PPO at lambda 1 in any task and set-up; its simultaneous 95 % intervals exclude differences beyond "
            "±0.020 to ±0.062 gold by group, smaller ones it cannot rule out. Two seeds on one build, as here, cannot "
            "tell differences of that size apart.")
SMOKE_TEST_NOTE = ("smoke test (--quick): a few steps on one seed to check that the pipeline runs; its figures are "
                   "not results (run without --quick for those)")


def describe_method(method: str, value_weighting: str) -> str:
    """What a demo method is, spelled out (`ma_ppo_fixed3` -> 'MA-PPO, n = 3, value weighting first')."""
    if method == BASELINE:
        return "token-level PPO (n = 1)"
    if method.startswith("ma_ppo"):
        rule = method.removeprefix("ma_ppo").removeprefix("_") or "fixed5"
        segments = {"fixed_inf": "the whole response as one macro action", "word": "one macro action per word",
                    "turn": "one macro action per turn",
                    "randomized": "randomized n-grams", "perplexity": "perplexity-based segments"}.get(
            rule, f"n = {rule.removeprefix('fixed')}" if rule.startswith("fixed") else f"termination {rule}")
        return f"MA-PPO ({segments}, value weighting {value_weighting})"
    return {"rloo": "RLOO (no critic)", "grpo": "GRPO (no critic)", "reinforce": "REINFORCE (no critic)",
            "dpo": "DPO (no rollouts)", "gigpo": "GiGPO (no critic)"}.get(method, method)


def start_run(config: DemoConfig) -> tuple[Path, dict[str, float], Callable[[str, float], float]]:
    """A demo run's start: its output directory `config.out` made, the config saved there (demo_config.yaml), and
    `(out, stage_seconds, stage_done)`: `stage_done(name, since) -> now` records a stage's seconds in
    `stage_seconds` (the summary's) and prints a line of progress."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_yaml(out / "demo_config.yaml")
    stage_seconds: dict[str, float] = {}

    def stage_done(name: str, since: float) -> float:
        stage_seconds[name] = round(time.perf_counter() - since, 1)
        tqdm.write(f"[demo] {name} done in {stage_seconds[name]:.0f} s")
        return time.perf_counter()

    return out, stage_seconds, stage_done


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object a line (the demo's records and per-run files)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def load_method_runs(method_dir: str | Path, seeds: list[int] | tuple[int, ...], gold_file: str) -> list[RunMetrics]:
    """One RunMetrics per seed (METHOD_DIR/seed<k>): trainer metrics and gold rows merged by step."""
    method_dir = Path(method_dir)
    runs = []
    for seed in seeds:
        run_dir = method_dir / f"seed{seed}"
        by_step = {row["step"]: dict(row) for row in _read_jsonl(run_dir / METRICS_FILE)}
        for row in _read_jsonl(run_dir / gold_file):
            by_step.setdefault(row["step"], {}).update(row)
        runs.append(RunMetrics(method_dir.name, run_dir, [by_step[s] for s in sorted(by_step)]))
    return runs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    mean = _mean(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5  # population std, as group_curves


def first_step_reaching(steps, values, target: float) -> int | None:
    """First step whose value is >= target (None if never)."""
    return next((int(s) for s, v in zip(steps, values) if v >= target), None)


def summarize(runs: dict[str, list[RunMetrics]], finals: dict[str, list[dict]], seeds: list[int], smoothing: int,
              wall_seconds: float) -> dict:
    """The demo's summary.json.

    `finals[method]` holds one {"gold_reward", "rm_reward", "kl"} per seed: the evaluation on held-out prompts
    after the last step. `steps_to_parity` is the first step at which the method's seed-mean gold reward of
    its training rollouts (moving average over `smoothing` steps) reaches PPO's final value of the same curve;
    `speedup_vs_ppo` is PPO's steps_to_parity divided by the method's (> 1: fewer steps than PPO). A method
    in `finals` without `runs` (DPO: no training rollouts) has neither, nor `train_gold_reward_final` (None).
    """
    if BASELINE not in runs:
        raise ValueError(f"runs must include the baseline method {BASELINE!r}, got {sorted(runs)}")
    curves = {method: group_curves(method_runs, "gold_reward", smoothing)[method]
              for method, method_runs in runs.items()}
    target = float(curves[BASELINE].mean[-1])
    methods = {}
    for method, method_finals in finals.items():
        keys = [key for key in FINAL_KEYS if key in method_finals[0]]  # a task without a reward model has no rm_reward
        entry: dict = {f"{key}_final": _mean([f[key] for f in method_finals]) for key in keys}
        entry.update({f"{key}_final_std": _std([f[key] for f in method_finals]) for key in keys})
        curve = curves.get(method)
        entry["train_gold_reward_final"] = None if curve is None else float(curve.mean[-1])
        entry["steps_to_parity"] = None if curve is None else first_step_reaching(curve.steps, curve.mean, target)
        entry["per_seed"] = {str(seed): final for seed, final in zip(seeds, method_finals)}
        methods[method] = entry
    baseline_parity = methods[BASELINE]["steps_to_parity"]
    for entry in methods.values():
        parity = entry["steps_to_parity"]
        entry["speedup_vs_ppo"] = baseline_parity / parity if parity else None
    return {"methods": methods, "seeds": list(seeds), "parity_target_gold_reward": target,
            "wall_seconds": wall_seconds}


def plot_curves(runs: dict[str, list[RunMetrics]], path: str | Path, smoothing: int,
                held_out_gold: dict[str, float] | None = None, parity_gold: float | None = None,
                keys: tuple[str, ...] = ("gold_reward", "rm_reward")) -> None:
    """Gold and reward-model reward of the training rollouts against PPO step: seed mean, +-1 std band over seeds;
    `held_out_gold` ({name: gold reward on held-out prompts}, e.g. SFT, DPO) as dashed horizontal lines;
    `parity_gold` (PPO's final training gold, what steps to parity are counted to) as a dotted line; `keys`: the
    panels (a task without a reward model has the gold panel only)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), layout="constrained", squeeze=False)
    titles = {"gold_reward": ("gold reward", "gold reward (the task's true objective)"),
              "rm_reward": ("reward-model score", "reward-model score (what PPO optimises)")}
    for ax, key in zip(axes[0], keys):
        title, ylabel = titles[key]
        for method, method_runs in runs.items():
            curve = group_curves(method_runs, key, smoothing)[method]
            seeds = f"{curve.num_runs} seed{'s' if curve.num_runs > 1 else ''}"
            (line,) = ax.plot(curve.steps, curve.mean, label=f"{method} ({seeds})")
            ax.fill_between(curve.steps, curve.mean - curve.std, curve.mean + curve.std, color=line.get_color(),
                            alpha=0.2)
        if key == "gold_reward":
            for (name, gold), color in zip((held_out_gold or {}).items(), ("gray", "black", "brown", "olive")):
                ax.axhline(gold, color=color, linestyle="--", linewidth=1, label=f"{name} (held-out)")
            if parity_gold is not None:
                ax.axhline(parity_gold, color="tab:blue", linestyle=":", linewidth=1,
                           label="PPO's final (parity target)")
        ax.set_title(f"{title} of the training rollouts\nseed mean ({smoothing}-step moving average); band: "
                     "+-1 std over seeds", fontsize=9)
        ax.set_xlabel("PPO step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_words(task: SyntheticTask, response: str) -> str:
    """Markdown of a response with each word's gold class: **bright**, plain, ~~dark~~, `invalid`."""
    marked = []
    for word in response.split():
        word_class = task.word_class.get(word)
        marked.append({"bright": f"**{word}**", "plain": word, "dark": f"~~{word}~~", None: f"`{word}`"}[word_class])
    return " ".join(marked)


def results_table(summary: dict) -> list[str]:
    """The markdown table of report.md (one row per method, SFT first); the demo also prints it. The RM column only
    where the task has a reward model."""
    sft = summary["sft"]
    rm = "rm_reward" in sft
    sft_rm = f" {sft['rm_reward']:.3f} |" if rm else ""
    lines = [
        f"| method | gold reward |{' RM score |' if rm else ''} KL to SFT | train gold (final) "
        "| steps to PPO's final gold | speed-up |",
        "|---|---|---|---|---|---|" + ("---|" if rm else ""),
        f"| SFT (start) | {sft['gold_reward']:.3f} |{sft_rm} 0 | - | - | - |",
    ]
    for method, entry in summary["methods"].items():
        parity, speedup = entry["steps_to_parity"], entry["speedup_vs_ppo"]
        train_gold = entry["train_gold_reward_final"]
        rm_cell = f" {entry['rm_reward_final']:.3f} ± {entry['rm_reward_final_std']:.3f} |" if rm else ""
        lines.append(
            f"| {method} | {entry['gold_reward_final']:.3f} ± {entry['gold_reward_final_std']:.3f} |{rm_cell}"
            f" {entry['kl_final']:.2f} | {'-' if train_gold is None else f'{train_gold:.3f}'} "
            f"| {'-' if train_gold is None else 'never' if parity is None else parity} "
            f"| {'-' if speedup is None else f'{speedup:.2f}x'} |")
    return lines


def seed_sentences(summary: dict) -> list[str]:
    """One sentence per method: its held-out gold on each seed, and their mean with its 95 % t-interval."""
    seeds, lines = summary["seeds"], []
    for method, entry in summary["methods"].items():
        values = [entry["per_seed"][str(s)]["gold_reward"] for s in seeds]
        stats = paired_t(values)
        interval = ("one seed, no interval" if len(seeds) < 2 else
                    f"95 % t-interval [{stats['ci'][0]:.3f}, {stats['ci'][1]:.3f}]")
        lines.append(f"- {method}: held-out gold {', '.join(f'{v:.3f}' for v in values)} (seeds "
                     f"{', '.join(str(s) for s in seeds)}); mean {stats['mean']:.3f}, {interval}.")
    return lines


def comparison_sentences(summary: dict) -> list[str]:
    """One plain sentence per method against token-level PPO: steps to PPO's final training gold, and final
    held-out gold (paired difference over seeds with its 95 % t-interval) and KL."""
    methods, seeds = summary["methods"], summary["seeds"]
    ppo = methods[BASELINE]
    weighting = summary.get("value_weighting", "first")
    lines = []
    for method, entry in methods.items():
        if method == BASELINE:
            continue
        name = f"{method}, {describe_method(method, weighting)}"
        if entry["steps_to_parity"] is None:
            speed = "no training rollouts" if entry["train_gold_reward_final"] is None else (
                f"did not reach PPO's final training gold ({summary['parity_target_gold_reward']:.3f}) in "
                "the run")
        else:
            speed = (f"reached PPO's final training gold ({summary['parity_target_gold_reward']:.3f}) at step "
                     f"{entry['steps_to_parity']} against PPO's {ppo['steps_to_parity']} "
                     f"({entry['speedup_vs_ppo']:.2f}x)")
        diffs = [entry["per_seed"][str(s)]["gold_reward"] - ppo["per_seed"][str(s)]["gold_reward"] for s in seeds]
        stats = paired_t(diffs)
        interval = ("one seed, no interval" if len(seeds) < 2 else
                    f"95 % t-interval [{stats['ci'][0]:+.3f}, {stats['ci'][1]:+.3f}] over {len(seeds)} seeds")
        lines.append(f"- {name}: {speed}; held-out gold {entry['gold_reward_final']:.3f} against PPO's "
                     f"{ppo['gold_reward_final']:.3f} (difference {stats['mean']:+.3f}, {interval}), at KL "
                     f"{entry['kl_final']:.1f} against {ppo['kl_final']:.1f}.")
    return lines


def write_report(summary: dict, path: str | Path, plot_name: str, examples: dict[str, dict],
                 task: SyntheticTask) -> None:
    """report.md: what was run and what happened (one sentence per comparison), the plot, one table row per
    method, one marked-up sample per model."""
    lines = [
        "# marlhf demo: token-level PPO against MA-PPO on a synthetic task with a gold reward",
        "",
        *([f"**{SMOKE_TEST_NOTE[0].upper()}{SMOKE_TEST_NOTE[1:]}.**", ""] if summary.get("smoke_test") else []),
        "## What happened",
        "",
        *comparison_sentences(summary),
        "",
        "Methods: " + "; ".join(f"`{m}` is {describe_method(m, summary.get('value_weighting', 'first'))}"
                                for m in summary["methods"]) + ".",
        "",
        f"Seeds {', '.join(str(s) for s in summary['seeds'])}; wall time {summary['wall_seconds']:.0f} s "
        f"(stages: {', '.join(f'{k} {v:.0f} s' for k, v in summary['stage_seconds'].items())}).",
        "PPO optimises the reward model's score; the gold reward (in [-1, 1]) is the task's true objective.",
        f"MA-PPO's segment values: `value_weighting: {summary['value_weighting']}` (the paper's is `equal`; "
        "`first`, the default, is the value of the state where a macro action starts); GAE lambda of the methods "
        f"with a critic: `lam: {summary['lam']:g}` (the paper's is 0.95; 1, the default, is Study II's "
        "tuned choice for token-level PPO and MA-PPO alike).",
        STUDY_II,
        "",
        f"![gold and reward-model reward against step]({plot_name})",
        "",
        "## Table",
        "",
        "Final evaluation on held-out prompts (one sample per prompt, temperature 0.8), mean ± std over seeds:",
        "",
        *results_table(summary),
    ]
    if set(summary["methods"]) & set(typing.get_args(BaselineMethod)):
        lines += ["", f"rloo, grpo and reinforce are the PPO loop without a critic, with token-level ratios (rloo and "
                      f"grpo sample {SAMPLES_PER_PROMPT} responses to each of 1/{SAMPLES_PER_PROMPT} of the prompts, "
                      "so a step has as many responses); dpo trains on the reward model's preference pairs and has no "
                      "training rollouts (-)."]
    lines += [
        "",
        f"Steps to parity: first step at which a method's seed-mean gold reward of its training rollouts "
        f"(moving average) reaches PPO's final value of that curve, {summary['parity_target_gold_reward']:.3f}. "
        "Speed-up: PPO's steps to parity over the method's (the paper reports 1.7-2x for MA-PPO).",
        "",
        "## Samples (held-out prompt, first seed)",
        "",
        "**bright** words score +1, plain 0, ~~dark~~ -1, `invalid` words -1.",
        "",
    ]
    for name, sample in examples.items():
        lines += [f"- {name} (gold {sample['gold_reward']:.2f}): {mark_words(task, sample['response'])}"]
    lines.append("")
    Path(path).write_text("\n".join(lines))
