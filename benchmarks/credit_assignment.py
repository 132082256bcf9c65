"""When do macro actions help? The pre-registered credit-assignment study on the demo's tasks.

    python benchmarks/credit_assignment.py                       # the whole grid (resumes where it stopped)
    python benchmarks/credit_assignment.py --tasks task1 --max_runs 20   # part of it, in several sittings
    python benchmarks/credit_assignment.py --summarize           # table and figures from the result files only
    python benchmarks/credit_assignment.py --quick --work W --results R  # a 2-cell smoke grid (the test's)

Tasks (`marlhf/demo/README.md`): task1 = the demo task (20-word responses, mean word score), task1_long = the
same with 60-word responses, task2 = the prompt's words repeated in order (longest common subsequence: not a
sum of per-word scores). Set-ups: gold_sft = PPO optimises 4 x the gold reward, critic from the SFT model;
rm_rm = PPO optimises the reward model, critic from the reward model (the paper's set-up). Every cell of a
task uses the same SFT model, reward model, prompts and hyper-parameters (the demo's: 50 steps of 32 prompts,
two mini-batches, policy lr 3e-4, critic lr 1e-3, KL 0.05, temperature 0.8); only the PPO options of the cell
and the seed differ. The grid is fixed in `grid()`; every cell is reported, whatever it shows.

Each finished run writes RESULTS/<task>/<setup>/<cell>/seed<k>.json (its per-step curves and held-out
metrics) and is never run again; models and run directories live in WORK (not committed). Two runs at a time
(`--workers`), one torch thread each. Then RESULTS/summary.md, summary.json and one figure per task and set-up
are written from the result files alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import json
import math
import multiprocessing
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

TASKS = {
    "task1": {"num_words": 20, "gold": "word_scores"},
    "task1_long": {"num_words": 60, "gold": "word_scores"},
    "task2": {"num_words": 20, "gold": "ordered_copy"},
}
SETUPS = {
    "gold_sft": {"reward": "gold", "critic_init": "sft"},
    "rm_rm": {"reward": "model", "critic_init": "reward"},
}
TERMINATIONS = {
    "n1": {"termination": "fixed", "ngram": 1},
    "n3": {"termination": "fixed", "ngram": 3},
    "n5": {"termination": "fixed", "ngram": 5},
    "n10": {"termination": "fixed", "ngram": 10},
    "whole": {"termination": "fixed", "ngram": None},
    "randomized": {"termination": "randomized"},
    "perplexity": {"termination": "perplexity"},
    "word": {"termination": "word"},
}
VARIANTS = {  # PPOConfig options on top of the termination; "" is the paper's defaults
    "": {},
    "vw_first": {"value_weighting": "first"},
    "vw_unit": {"value_weighting": "unit"},
    "vw_position": {"value_weighting": "position"},
    "ratio_token": {"ratio_granularity": "token"},
    "segreward_mean": {"segment_reward": "mean"},
    "sw_uniform": {"segment_weighting": "uniform"},
    "sw_geometric": {"segment_weighting": "geometric"},
    "lam1": {"lam": 1.0},  # exploratory only (--cells): GAE without lambda's decay over the response
}
BASELINE_CELL = "n1"  # token-level PPO
GROUPS = {  # cells drawn together in a figure row
    "termination (paper's defaults)": lambda term, variant: variant == "",
    "value weighting": lambda term, variant: variant.startswith("vw_") or (variant == "" and term in VALUE_TERMS),
    "policy-loss segment weighting, released-code options": lambda term, variant: (
        variant.startswith(("sw_", "ratio_", "segreward_")) or (variant == "" and term in WEIGHTING_TERMS)),
}
VALUE_TERMS = ("n5", "word", "randomized")
WEIGHTING_TERMS = ("n5", "word", "whole")
FIVE, THREE = (0, 1, 2, 3, 4), (0, 1, 2)
SMOOTHING = 5  # moving-average window (steps) of the training curves
BOOTSTRAP = 2000
GOLD_SCALE = 4.0


def cell_name(term: str, variant: str) -> str:
    return term if not variant else f"{term}+{variant}"


def split_cell(cell: str) -> tuple[str, str]:
    term, _, variant = cell.partition("+")
    return term, variant


def cell_options(cell: str) -> dict:
    """PPOConfig options of a cell: its termination, then each of its variants (`word+vw_first+sw_uniform`)."""
    term, variant = split_cell(cell)
    options = dict(TERMINATIONS[term])
    for part in variant.split("+") if variant else ():
        options.update(VARIANTS[part])
    return options


def grid(tasks=tuple(TASKS), setups=tuple(SETUPS)) -> dict[tuple[str, str, str], tuple[int, ...]]:
    """{(task, setup, cell): seeds}, the issue's grid. A cell named by several parts of the grid runs on the
    union of their seeds."""
    cells: dict[tuple[str, str, str], set[int]] = {}

    def add(task, setup, term, variant, seeds):
        cells.setdefault((task, setup, cell_name(term, variant)), set()).update(seeds)

    for task in tasks:
        terms = tuple(TERMINATIONS) if task == "task1" else ("n1", "n5", "word", "whole")
        for setup in setups:
            for term in terms:
                add(task, setup, term, "", FIVE if term in ("n1", "n5", "word", "whole") else THREE)
            for term in VALUE_TERMS:
                add(task, setup, term, "", FIVE)  # equal
                add(task, setup, term, "vw_first", FIVE)
                add(task, setup, term, "vw_unit", THREE)
                add(task, setup, term, "vw_position", THREE)
            if task == "task1":
                add(task, setup, "n5", "ratio_token", THREE)
                add(task, setup, "n5", "segreward_mean", THREE)
                for term in WEIGHTING_TERMS:
                    add(task, setup, term, "sw_uniform", THREE)
                    add(task, setup, term, "sw_geometric", THREE)
    return {key: tuple(sorted(seeds)) for key, seeds in cells.items()}


def quick_grid() -> dict[tuple[str, str, str], tuple[int, ...]]:
    return {("task1", "gold_sft", "n1"): (0,), ("task1", "gold_sft", "word+vw_first"): (0,)}


def demo_config(task: str, setup: str, quick: bool, tasks: dict = TASKS, **extra):
    """The demo's configuration of a task (from `tasks`) and set-up; `extra`: other DemoConfig fields (a build's
    task_seed)."""
    from marlhf.demo.config import DemoConfig

    # "" cells are the paper's value weighting (`equal`), whatever PPOConfig's default (`first` since this study);
    # lam 0.95 was the default both studies were designed under (1 since Study II), so cells without their own lam keep it
    options = dict(out="unused", seeds=(0,), gold_reward_scale=GOLD_SCALE, value_weighting="equal", lam=0.95,
                   **tasks[task], **SETUPS[setup], **extra)
    if quick:  # seconds: the test's smoke grid
        return DemoConfig.quick(**options, pretrain_texts=256, sft_records=64, preference_records=128, ppo_steps=3,
                                ppo_batch_size=8, eval_prompts=8)
    return DemoConfig(**options)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_models(models_dir: Path, config, name: str) -> dict:
    """Build a task's tokenizer, SFT and reward model once into MODELS_DIR (from the demo `config`; the set-up does
    not change them); return their hashes and the SFT model's held-out gold reward."""
    info_file = models_dir / "models.json"
    if info_file.exists():
        return json.loads(info_file.read_text())
    models_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(models_dir.parent / f".{models_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker to need the models builds them; the others wait
        if info_file.exists():
            return json.loads(info_file.read_text())
        return _build_models(models_dir, info_file, config, name)


def _build_models(models_dir: Path, info_file: Path, config, name: str) -> dict:
    import torch

    from marlhf.demo.pipeline import build_models, evaluate_policy

    if models_dir.exists():
        shutil.rmtree(models_dir)  # a build cut off midway
    torch.set_num_threads(1)
    start = time.perf_counter()
    models = build_models(config, models_dir)
    eval_prompts = [r["prompt"] for r in models.task.prompts(config.eval_prompts, seed=2)]
    sft_metrics, _ = evaluate_policy(models.sft, models.sft, models.reward_model, models.tokenizer, models.task,
                                     eval_prompts, seed=0)
    info = {"task": name, "sft_sha256": _sha256(models_dir / "sft" / "model.safetensors"),
            "reward_sha256": _sha256(models_dir / "reward" / "model.safetensors"), "sft_held_out": sft_metrics,
            "build_seconds": round(time.perf_counter() - start, 1)}
    info_file.write_text(json.dumps(info, indent=1) + "\n")
    return info


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(task: str, setup: str, cell: str, seed: int, work: str, results: str, quick: bool) -> str:
    """One PPO run of the grid, in its own process with one torch thread; writes its result file."""
    work = Path(work)
    result = execute_run(demo_config(task, setup, quick), work / "models" / task, task, cell_options(cell), seed,
                         work / "runs" / task / setup / cell / f"seed{seed}", cell)
    result = {"task": task, "setup": setup, "cell": cell, "seed": seed, "options": result.pop("options"),
              "task_options": TASKS[task], "setup_options": SETUPS[setup], **result}
    return str(write_result(result_path(Path(results), task, setup, cell, seed), result))


def execute_run(config, models_dir: Path, models_name: str, options: dict, seed: int, run_dir: Path,
                label: str, curve_keys: tuple[str, ...] = (), after_step=None) -> dict:
    """One PPO run with the demo's `config` and the PPOConfig `options` on the models of MODELS_DIR (built first
    if needed), one torch thread; returns its per-step curves (`curve_keys`: metrics beside the usual ones),
    held-out metrics and provenance. `after_step(models, eval_prompts)`: makes train_ppo's hook after each step
    (evaluations during training)."""
    import torch

    from marlhf.demo.pipeline import GOLD_FILE, load_models, run_method
    from marlhf.logging_utils import METRICS_FILE

    torch.set_num_threads(1)
    info = ensure_models(models_dir, config, models_name)
    models = load_models(config, models_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a run cut off midway starts again
    rl_prompts = models.task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)
    eval_prompts = [r["prompt"] for r in models.task.prompts(config.eval_prompts, seed=2)]
    start = time.perf_counter()
    held_out = run_method(config, models, options, seed, run_dir, rl_prompts, eval_prompts, label,
                          after_step=after_step(models, eval_prompts) if after_step is not None else None)
    by_step = {row["step"]: row for row in _read_jsonl(run_dir / METRICS_FILE)}
    for row in _read_jsonl(run_dir / GOLD_FILE):
        by_step[row["step"]].update(row)
    keys = ("gold_reward", "rm_reward", "objective/kl", "objective/rm_score", "policy/clipfrac", "policy/approxkl",
            "val/advantage_l2", "val/return_l2", "macro/mean_segment_length", "objective/response_length",
            "loss/value", "objective/kl_coef", *curve_keys)
    curves = {key: [by_step[s].get(key) for s in sorted(by_step)] for key in keys}
    result = {
        "options": options,
        "hyper_parameters": {k: v for k, v in config.to_dict().items() if k not in ("out", "seeds")},
        "sft_sha256": info["sft_sha256"], "reward_sha256": info["reward_sha256"], "sft_held_out": info["sft_held_out"],
        "steps": sorted(by_step), "curves": curves, "held_out": held_out,
        "run_seconds": round(time.perf_counter() - start, 1),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "machine": platform.machine(), "torch_threads": torch.get_num_threads()},
    }
    shutil.rmtree(run_dir)  # the policy weights are not needed again
    return result


def write_result(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result) + "\n")
    os.replace(tmp, path)  # a result file is whole or absent
    return path


def run_in_pool(calls: dict[tuple, tuple], workers: int, desc: str) -> int:
    """Run {job: (function, arguments)} in `workers` spawned processes, printing each result file or failure;
    returns the number of failed runs (one failed run does not stop the others: it is rerun next time)."""
    from tqdm.auto import tqdm

    failed = 0
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {pool.submit(function, *args): job for job, (function, args) in calls.items()}
        for future in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc=desc):
            job = futures[future]
            try:
                tqdm.write(f"done {'/'.join(map(str, job))}: {future.result()}")
            except Exception as error:
                failed += 1
                tqdm.write(f"FAILED {'/'.join(map(str, job))}: {type(error).__name__}: {error}")
    return failed


def result_path(results: Path, task: str, setup: str, cell: str, seed: int) -> Path:
    return results / task / setup / cell / f"seed{seed}.json"


def job_order(cells: dict[tuple[str, str, str], tuple[int, ...]]) -> list[tuple[str, str, str, int]]:
    """Seeds 0-2 of every cell before seeds 3-4, so that a grid stopped midway has every cell on some seeds
    rather than some cells on all; task1_long (three times the tokens per run) last."""
    tasks = list(TASKS)
    jobs = [(task, setup, cell, seed) for (task, setup, cell), seeds in cells.items() for seed in seeds]
    return sorted(jobs, key=lambda j: (j[0] == "task1_long", j[3] >= 3, tasks.index(j[0]), j[3],
                                       list(SETUPS).index(j[1])))


# ---------------------------------------------------------------------------------------------- summary
def _smooth(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average along the last axis (the first steps average what there is)."""
    cumsum = np.cumsum(x, axis=-1)
    out = cumsum.copy()
    out[..., window:] = cumsum[..., window:] - cumsum[..., :-window]
    counts = np.minimum(np.arange(1, x.shape[-1] + 1), window)
    return out / counts


def _first_reaching(curve: np.ndarray, target: float) -> float:
    hits = np.nonzero(curve >= target)[0]
    return float(hits[0] + 1) if hits.size else math.nan  # steps are 1-based


def _gold_at_kl(kl: np.ndarray, gold: np.ndarray, target_kl: float, crossing: str = "first") -> float:
    """Gold read off the gold-vs-KL curve at `target_kl`, linearly interpolated where the KL curve first reaches
    it (`crossing="first"`, the pre-registered reading) or where it last passes it (`"last"`, added post hoc:
    Task 1-long's KL peaks early and falls back, so its first crossing lies on the early transient)."""
    if crossing == "last":
        low, high = np.minimum(kl[:-1], kl[1:]), np.maximum(kl[:-1], kl[1:])
        spans = np.nonzero((low <= target_kl) & (target_kl <= high))[0]
        if not spans.size:
            return math.nan
        i = spans[-1] + 1
        frac = (target_kl - kl[i - 1]) / (kl[i] - kl[i - 1]) if kl[i] != kl[i - 1] else 1.0
        return float(gold[i - 1] + frac * (gold[i] - gold[i - 1]))
    hits = np.nonzero(kl >= target_kl)[0]
    if not hits.size:
        return math.nan
    i = hits[0]
    if i == 0:
        return float(gold[0])
    frac = (target_kl - kl[i - 1]) / max(kl[i] - kl[i - 1], 1e-12)
    return float(gold[i - 1] + frac * (gold[i] - gold[i - 1]))


def _merits(gold: np.ndarray, kl: np.ndarray, final: np.ndarray, target: float,
            matched_kl: float) -> dict[str, float]:
    """Figures of merit of one cell from its runs' curves ([seeds, steps]) and final held-out gold ([seeds])."""
    mean_gold, mean_kl = _smooth(gold, SMOOTHING).mean(0), _smooth(kl, SMOOTHING).mean(0)
    return {"steps_to_80": _first_reaching(mean_gold, target), "auc": float(gold.mean()),
            "final_held_out_gold": float(final.mean()),
            "gold_at_matched_kl": _gold_at_kl(mean_kl, mean_gold, matched_kl),
            "gold_at_matched_kl_last": _gold_at_kl(mean_kl, mean_gold, matched_kl, crossing="last"),
            "final_kl": float(mean_kl[-1])}


def _transients(kl: np.ndarray, length: np.ndarray) -> dict:
    """Where the seed-mean KL peaks and the seed-mean response length is shortest ([seeds, steps] curves; steps
    1-based): a KL that peaks and falls back, or responses that shrink and grow again, mark an early excursion."""
    mean_kl, mean_length = kl.mean(0), length.mean(0)
    return {"kl_peak": float(mean_kl.max()), "kl_peak_step": int(mean_kl.argmax()) + 1,
            "length_start": float(mean_length[0]), "length_min": float(mean_length.min()),
            "length_min_step": int(mean_length.argmin()) + 1, "length_final": float(mean_length[-1])}


def _interval(values_by_sample: np.ndarray) -> tuple[float, float]:
    finite = values_by_sample[np.isfinite(values_by_sample)]
    if finite.size < 0.5 * values_by_sample.size:  # mostly undefined (never reached): no interval
        return math.nan, math.nan
    return float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))


def load_results(results: Path) -> dict[tuple[str, str, str], list[dict]]:
    by_cell: dict[tuple[str, str, str], list[dict]] = {}
    for path in sorted(results.glob("*/*/*/seed*.json")):
        result = json.loads(path.read_text())
        by_cell.setdefault((result["task"], result["setup"], result["cell"]), []).append(result)
    return by_cell


def summarize(results: Path, cells: dict[tuple[str, str, str], tuple[int, ...]]) -> dict:
    """Figures of merit per cell from the result files (95 % bootstrap intervals over seeds):
    steps to 80 % of token-level PPO's final gain over SFT (and PPO's steps over them), area under the gold
    curve, final held-out gold, and gold at matched KL."""
    by_cell = load_results(results)
    rng = np.random.default_rng(0)
    summary: dict = {"cells": {}, "missing_runs": [], "groups": {}}
    for key, seeds in cells.items():
        have = {r["seed"] for r in by_cell.get(key, [])}
        summary["missing_runs"] += [f"{'/'.join(key)}/seed{s}" for s in seeds if s not in have]
    for task, setup in sorted({(t, s) for t, s, _ in by_cell}, key=lambda ts: (list(TASKS).index(ts[0]), ts[1])):
        group_cells = {c: rs for (t, s, c), rs in by_cell.items() if (t, s) == (task, setup)}
        hashes = {(r["sft_sha256"], r["reward_sha256"]) for rs in group_cells.values() for r in rs}
        if len(hashes) > 1:
            raise ValueError(f"{task}/{setup}: result files come from different SFT or reward models: {hashes}")
        gold = {c: np.array([r["curves"]["gold_reward"] for r in rs]) for c, rs in group_cells.items()}
        kl = {c: np.array([r["curves"]["objective/kl"] for r in rs], dtype=float) for c, rs in group_cells.items()}
        start_gold = float(np.mean([g[:, 0].mean() for g in gold.values()]))  # step 1: the SFT policy's rollouts
        baseline = gold.get(BASELINE_CELL)
        ppo_final = float(_smooth(baseline, SMOOTHING).mean(0)[-1]) if baseline is not None else math.nan
        # No target when token-level PPO's gain over the SFT policy is within seed noise (its 95 % bootstrap
        # interval reaches 0): steps to 80 % of no gain would be read off the start of every curve. This rule
        # was added after Task 2's gain of ~0 was seen, before Task 1-long's PPO seeds 1-4 existed.
        ppo_gain_ci = (math.nan, math.nan)
        if baseline is not None:
            gain_rng = np.random.default_rng(1)  # its own stream: the cells' intervals stay as they were
            gains = [float(_smooth(baseline[gain_rng.integers(0, len(baseline), len(baseline))], SMOOTHING)
                           .mean(0)[-1]) - start_gold for _ in range(BOOTSTRAP)]
            ppo_gain_ci = (float(np.percentile(gains, 2.5)), float(np.percentile(gains, 97.5)))
        target_defined = ppo_final > start_gold and ppo_gain_ci[0] > 0
        target = start_gold + 0.8 * (ppo_final - start_gold) if target_defined else math.inf
        # Matched KL: how far token-level PPO has moved by its last step.
        matched_kl = float(_smooth(kl[BASELINE_CELL], SMOOTHING).mean(0)[-1]) if BASELINE_CELL in kl else math.nan
        ppo_steps = math.nan

        order = sorted(group_cells, key=_cell_sort_key)
        for cell in order:
            rs = group_cells[cell]
            g, k = gold[cell], kl[cell]
            final = np.array([r["held_out"]["gold_reward"] for r in rs])
            point = _merits(g, k, final, target, matched_kl)
            samples = {name: [] for name in point}
            for _ in range(BOOTSTRAP):
                pick = rng.integers(0, len(rs), len(rs))
                for name, value in _merits(g[pick], k[pick], final[pick], target, matched_kl).items():
                    samples[name].append(value)
            entry = {"seeds": sorted(r["seed"] for r in rs), **point,
                     **{f"{name}_ci": _interval(np.array(v)) for name, v in samples.items()},
                     "held_out_kl": float(np.mean([r["held_out"]["kl"] for r in rs])),
                     "clipfrac": float(np.nanmean([np.nanmean(np.array(r["curves"]["policy/clipfrac"], dtype=float))
                                                   for r in rs])),
                     "mean_segment_length": float(np.mean([np.nanmean(np.array(
                         r["curves"]["macro/mean_segment_length"], dtype=float)) for r in rs])),
                     "run_seconds": float(np.mean([r["run_seconds"] for r in rs])),
                     **_transients(k, np.array([r["curves"]["objective/response_length"] for r in rs], dtype=float))}
            if cell == BASELINE_CELL:
                ppo_steps = entry["steps_to_80"]
            summary["cells"]["/".join((task, setup, cell))] = entry
        for cell in order:
            entry = summary["cells"]["/".join((task, setup, cell))]
            entry["speedup_vs_ppo"] = ppo_steps / entry["steps_to_80"] if entry["steps_to_80"] else math.nan
        summary["groups"][f"{task}/{setup}"] = {"start_gold": start_gold, "ppo_final_train_gold": ppo_final,
                                               "ppo_gain_ci": ppo_gain_ci, "target_defined": target_defined,
                                               "target_gold_80": target, "matched_kl": matched_kl}
    return summary


# Pre-registered (README, before any Task 1-long run with `first`): `first` becomes PPOConfig's default if, in
# every comparison below, its final held-out gold is above `equal`'s with disjoint 95 % intervals and its gold
# at matched KL (first crossing) is not below `equal`'s (the intervals overlap, or it is above).
DECISION_COMPARISONS = tuple((f"{task}/{setup}", term) for task in ("task1", "task1_long") for setup in SETUPS
                             for term in ("n5", "word"))


def value_weighting_decision(summary: dict) -> dict:
    """The pre-registered rule for `value_weighting="first"` as the default, from the summary's cells:
    {"comparisons": [...], "complete": bool, "first_becomes_default": bool | None (None: cells missing)}."""
    comparisons, complete = [], True
    missing = {run.rsplit("/", 1)[0] for run in summary["missing_runs"]}
    for group, term in DECISION_COMPARISONS:
        names = {w: f"{group}/{term}{'+vw_first' if w == 'first' else ''}" for w in ("first", "equal")}
        if any(name in missing or name not in summary["cells"] for name in names.values()):
            complete = False
            continue
        first, equal = summary["cells"][names["first"]], summary["cells"][names["equal"]]
        gold_above = first["final_held_out_gold_ci"][0] > equal["final_held_out_gold_ci"][1]
        # not below: the intervals overlap or first's is above (an undefined reading, never at that KL, fails)
        kl_first, kl_equal = first["gold_at_matched_kl_ci"], equal["gold_at_matched_kl_ci"]
        kl_not_below = (not any(math.isnan(x) for x in kl_first)
                        and (any(math.isnan(x) for x in kl_equal) or kl_first[1] >= kl_equal[0]))
        comparisons.append({"group": group, "termination": term, "final_gold": (first["final_held_out_gold"],
                            equal["final_held_out_gold"]), "final_gold_above": gold_above,
                            "matched_kl_gold": (first["gold_at_matched_kl"], equal["gold_at_matched_kl"]),
                            "matched_kl_not_below": kl_not_below})
    passed = all(c["final_gold_above"] and c["matched_kl_not_below"] for c in comparisons)
    return {"comparisons": comparisons, "complete": complete, "first_becomes_default": passed if complete else None}


def _cell_sort_key(cell: str):
    term, variant = split_cell(cell)
    first_variant = variant.split("+")[0]
    return list(VARIANTS).index(first_variant), variant, list(TERMINATIONS).index(term)


def _fmt(value: float, interval: tuple[float, float] | None = None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "never" if interval is not None else "-"
    text = f"{value:.{digits}f}"
    if interval is not None and not any(math.isnan(x) for x in interval):
        text += f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
    return text


def write_summary(summary: dict, results: Path, wall: dict, exploratory: bool = False) -> None:
    (results / "summary.json").write_text(json.dumps({**summary, "wall": wall}, indent=1) + "\n")
    title = "exploratory runs (`--cells`), outside the pre-registered grid" if exploratory else "results"
    lines = [f"# Credit-assignment study: {title}", "",
             "Generated by `python benchmarks/credit_assignment.py --summarize` from the result files; do not edit.",
             "Intervals: 95 % bootstrap over seeds. Steps to 80 %: first step at which the seed-mean training gold "
             f"({SMOOTHING}-step moving average) reaches 80 % of token-level PPO's (n1) final gain over the SFT policy "
             "(never: not within 50 steps; undefined: n1's gain is within seed noise, its 95 % interval reaching 0); "
             "speed-up: n1's steps over the cell's. AUC: mean training gold over the "
             "steps. Gold at matched KL: training gold read off the seed-mean gold-vs-KL curve at the final "
             "KL of token-level PPO (n1's final KL; - : the cell never moved that far; every step's prompts are new, "
             "so training gold is on unseen prompts), where the curve first reaches it (pre-registered) and, added "
             "post hoc, where it last passes it (the same when KL only grows; they differ where KL peaks early and "
             "falls back, as in Task 1-long). KL peak and response length (post hoc, to show that excursion): on the "
             "seed-mean curves. Final gold: held-out prompts after the last step.", ""]
    if summary["missing_runs"]:
        lines += [f"**Incomplete: {len(summary['missing_runs'])} runs of the grid have no result yet** (they are "
                  "run by the next invocation of the script).", ""]
    for group, info in summary["groups"].items():
        gain_low, gain_high = info["ppo_gain_ci"]
        target = (f"80 % target {info['target_gold_80']:.3f}" if info["target_defined"]
                  else "no 80 % target: that gain is within seed noise")
        lines += [f"## {group}", "",
                  f"Start (SFT) training gold {info['start_gold']:.3f}; n1's final training gold "
                  f"{info['ppo_final_train_gold']:.3f} (gain 95 % interval [{gain_low:.3f}, {gain_high:.3f}]); "
                  f"{target}; matched KL {info['matched_kl']:.2f}. Figure: `{group.replace('/', '_')}.png`.", "",
                  "| cell | seeds | steps to 80 % | speed-up | AUC | final gold (held-out) | gold at matched KL "
                  "| same, last crossing (post hoc) | final KL | KL peak (step) | response length: start, shortest "
                  "(step), final | clip frac | mean segment | s/run |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, entry in summary["cells"].items():
            if not name.startswith(group + "/"):
                continue
            steps_to_80 = (_fmt(entry["steps_to_80"], entry["steps_to_80_ci"], 0) if info["target_defined"]
                           else "undefined")
            lines.append(
                f"| {name.split('/')[-1]} | {len(entry['seeds'])} | {steps_to_80} "
                f"| {_fmt(entry['speedup_vs_ppo'], digits=2)} | {_fmt(entry['auc'], entry['auc_ci'])} "
                f"| {_fmt(entry['final_held_out_gold'], entry['final_held_out_gold_ci'])} "
                f"| {_fmt(entry['gold_at_matched_kl'], entry['gold_at_matched_kl_ci'])} "
                f"| {_fmt(entry['gold_at_matched_kl_last'], entry['gold_at_matched_kl_last_ci'])} "
                f"| {entry['final_kl']:.1f} | {entry['kl_peak']:.1f} ({entry['kl_peak_step']}) "
                f"| {entry['length_start']:.0f}, {entry['length_min']:.0f} ({entry['length_min_step']}), "
                f"{entry['length_final']:.0f} | {entry['clipfrac']:.3f} | {entry['mean_segment_length']:.1f} "
                f"| {entry['run_seconds']:.0f} |")
        lines.append("")
    decision = summary.get("value_weighting_decision")
    if decision is not None:
        verdict = {True: "**`first` becomes the default**", False: "**`equal` stays the default**",
                   None: "not decided yet: some of these cells are incomplete"}[decision["first_becomes_default"]]
        lines += ["## Pre-registered decision: the default value weighting", "",
                  "`first` becomes PPOConfig's default if, for n = 5 and word segments in both set-ups of Task 1 and "
                  "Task 1-long, its final held-out gold is above `equal`'s with disjoint 95 % intervals and its gold "
                  f"at matched KL is not below `equal`'s (intervals overlap, or above). Verdict: {verdict}.", "",
                  "| task/set-up | segments | final gold, first vs equal | disjoint, above | gold at matched KL, "
                  "first vs equal | not below |", "|---|---|---|---|---|---|"]
        for c in decision["comparisons"]:
            lines.append(f"| {c['group']} | {c['termination']} | {c['final_gold'][0]:.3f} vs {c['final_gold'][1]:.3f} "
                         f"| {'yes' if c['final_gold_above'] else 'no'} | {_fmt(c['matched_kl_gold'][0])} vs "
                         f"{_fmt(c['matched_kl_gold'][1])} | {'yes' if c['matched_kl_not_below'] else 'no'} |")
        lines.append("")
    lines += [f"Wall time of the runs so far: {wall['run_seconds_total'] / 3600:.1f} h of run time "
              f"({wall['runs']} runs; two at a time)."]
    (results / "summary.md").write_text("\n".join(lines) + "\n")


def plot(results: Path, summary: dict) -> list[Path]:
    """One figure per task and set-up: rows = cell groups; columns = gold vs step (95 % band), gold vs KL,
    advantage L2 and return L2 vs step (the paper's Figure 11)."""
    from marlhf.evaluation.plots import pyplot

    plt = pyplot()
    by_cell = load_results(results)
    paths = []
    for group in summary["groups"]:
        task, setup = group.split("/")
        cells = sorted((c for (t, s, c) in by_cell if (t, s) == (task, setup)), key=_cell_sort_key)
        rows = [(title, [c for c in cells if rule(*split_cell(c))]) for title, rule in GROUPS.items()]
        rows = [(title, cs) for title, cs in rows if cs]
        fig, axes = plt.subplots(len(rows), 4, figsize=(20, 4.2 * len(rows)), squeeze=False, layout="constrained")
        for (title, row_cells), ax_row in zip(rows, axes):
            for cell in row_cells:
                rs = by_cell[(task, setup, cell)]
                steps = np.array(rs[0]["steps"])
                curves = {key: _smooth(np.array([r["curves"][key] for r in rs], dtype=float), SMOOTHING)
                          for key in ("gold_reward", "objective/kl", "val/advantage_l2", "val/return_l2")}
                label = f"{cell} ({len(rs)})"
                gold = curves["gold_reward"]
                (line,) = ax_row[0].plot(steps, gold.mean(0), label=label)
                if len(rs) > 1:
                    boot = gold[np.random.default_rng(0).integers(0, len(rs), (500, len(rs)))].mean(1)
                    ax_row[0].fill_between(steps, *np.percentile(boot, [2.5, 97.5], axis=0), color=line.get_color(),
                                           alpha=0.15)
                ax_row[1].plot(curves["objective/kl"].mean(0), gold.mean(0), color=line.get_color(), label=label)
                for ax, key in zip(ax_row[2:], ("val/advantage_l2", "val/return_l2")):
                    if not np.all(np.isnan(curves[key])):
                        ax.plot(steps, np.nanmean(curves[key], 0), color=line.get_color(), label=label)
            titles = ("training gold vs step (95 % band)", "training gold vs KL to SFT", "advantage L2 norm",
                      "return L2 norm")
            for ax, name in zip(ax_row, titles):
                ax.set_title(f"{group}: {title}\n{name}", fontsize=9)
                ax.grid(alpha=0.3)
                ax.set_xlabel("KL per response" if "KL" in name else "PPO step")
            ax_row[0].legend(fontsize=7, ncol=2)
        path = results / f"{group.replace('/', '_')}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def summarize_and_plot(results: Path, cells, exploratory: bool = False) -> dict:
    summary = summarize(results, cells)
    if not exploratory:
        summary["value_weighting_decision"] = value_weighting_decision(summary)
    runs = [r for rs in load_results(results).values() for r in rs]
    wall = {"runs": len(runs), "run_seconds_total": sum(r["run_seconds"] for r in runs)}
    write_summary(summary, results, wall, exploratory)
    plot(results, summary)
    return summary


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench_credit_assignment", help="models and run directories (not committed)")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "credit_assignment"),
                        help="one JSON per finished run, summary.md, summary.json, figures")
    parser.add_argument("--tasks", nargs="+", choices=tuple(TASKS), default=tuple(TASKS))
    parser.add_argument("--setups", nargs="+", choices=tuple(SETUPS), default=tuple(SETUPS))
    parser.add_argument("--workers", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--max_runs", type=int, default=None, help="stop after starting this many new runs")
    parser.add_argument("--summarize", action="store_true", help="only write the table and figures")
    parser.add_argument("--quick", action="store_true", help="a 2-cell grid with tiny sizes (seconds; the test's)")
    parser.add_argument("--cells", nargs="+", default=None,
                        help="exploratory runs outside the pre-registered grid: these cells (e.g. perplexity+vw_first) "
                             "of --tasks x --setups on --seeds; give them their own --results directory")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the --cells runs")
    arguments = parser.parse_args(argv)
    if arguments.workers < 1:
        parser.error("--workers must be >= 1")
    work, results = Path(arguments.work), Path(arguments.results)
    results.mkdir(parents=True, exist_ok=True)
    if arguments.cells:
        for cell in arguments.cells:
            term, variant = split_cell(cell)
            if term not in TERMINATIONS or not all(v in VARIANTS for v in variant.split("+")):
                parser.error(f"--cells: {cell!r} is not TERMINATION[+VARIANT] with TERMINATION in {list(TERMINATIONS)} "
                             f"and VARIANT in {[v for v in VARIANTS if v]}")
        cells = {(task, setup, cell): tuple(arguments.seeds)
                 for task in arguments.tasks for setup in arguments.setups for cell in arguments.cells}
    else:
        cells = quick_grid() if arguments.quick else grid(tuple(arguments.tasks), tuple(arguments.setups))
    jobs = [j for j in job_order(cells) if not result_path(results, *j).exists()]
    total = sum(len(s) for s in cells.values())
    print(f"credit assignment: {len(cells)} cells, {total} runs, {total - len(jobs)} done, {len(jobs)} to run",
          flush=True)
    if arguments.max_runs is not None:
        jobs = jobs[: arguments.max_runs]
    if not arguments.summarize and jobs:
        failed = run_in_pool({job: (run_one, (*job, str(work), str(results), arguments.quick)) for job in jobs},
                             arguments.workers, "grid runs")
        if failed:
            print(f"{failed} runs failed (see above); they run again next time", file=sys.stderr)
    summary = summarize_and_plot(results, cells, exploratory=bool(arguments.cells))
    print(f"wrote {results / 'summary.md'}; {len(summary['missing_runs'])} runs of the grid still to run")
    return 1 if not arguments.summarize and jobs and failed else 0


if __name__ == "__main__":
    sys.exit(main())
