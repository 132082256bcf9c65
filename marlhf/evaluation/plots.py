"""Training diagnostics from runs' metrics.jsonl: the curves MA-RLHF argues from.

Runs are grouped by a label (default: a run directory named `seed<k>` takes its parent's name, so
`runs/ma_ppo/seed1` and `runs/ma_ppo/seed2` are two seeds of "ma_ppo"; any other run directory its own name,
so `runs/tour/ppo` is "ppo"); each group is drawn as the mean over its runs with a band of one standard
deviation, at the steps every run of the group logged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marlhf.data.records import read_jsonl
from marlhf.logging_utils import METRICS_FILE

# Metric name in metrics.jsonl -> axis title. Drawn in this order when present.
DIAGNOSTICS: dict[str, str] = {
    "objective/rm_score": "reward (score of the responses)",
    "objective/kl": "KL(policy || reference) per response",
    "val/advantage_l2": "L2 norm of the advantages",
    "val/return_l2": "L2 norm of the returns",
    "macro/mean_segment_length": "mean macro-action length (tokens)",
    "objective/repetition": "repeated token 3-gram fraction",
    "objective/response_length": "response length (tokens)",
}


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (PNG files; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class RunMetrics:
    label: str
    path: Path
    rows: list[dict[str, float]]  # the lines of metrics.jsonl

    def curve(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the lines that logged `metric`; a resumed run's repeated steps keep the last."""
        by_step = {int(row["step"]): float(row[metric]) for row in self.rows if metric in row}
        steps = np.array(sorted(by_step), dtype=np.int64)
        return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def default_label(run_dir: str | Path) -> str:
    """A run's group: its parent directory's name for a `seed<k>` directory (seeds of one method), else its own."""
    path = Path(run_dir).resolve()
    return path.parent.name if re.fullmatch(r"seed\d+", path.name) else path.name


def load_runs(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[RunMetrics]:
    """Read RUN_DIR/metrics.jsonl of each run; `labels` (one per run) group them, default: parent dir name."""
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"labels must give one label per run directory, got {len(labels)} for {len(run_dirs)} runs")
    runs = []
    for index, run_dir in enumerate(run_dirs):
        path = Path(run_dir)
        metrics_file = path / METRICS_FILE
        if not metrics_file.is_file():
            raise ValueError(f"run directory {str(path)!r} has no {METRICS_FILE}")
        rows = read_jsonl(metrics_file, fields=("step",))
        if not rows:
            raise ValueError(f"{metrics_file} holds no metrics")
        label = labels[index] if labels is not None else default_label(path)
        runs.append(RunMetrics(label, path, rows))
    return runs


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` points (fewer at the start); window 1 is the identity."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


@dataclass
class GroupCurve:
    steps: np.ndarray
    mean: np.ndarray
    std: np.ndarray  # over runs (population std; 0 with one run)
    num_runs: int


def group_curves(runs: Sequence[RunMetrics], metric: str, smoothing: int = 1) -> dict[str, GroupCurve]:
    """Mean and spread over the runs of each label at the steps all of them logged `metric`.
    Labels whose runs never logged it (or share no step) are left out."""
    per_label: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for run in runs:
        steps, values = run.curve(metric)
        if len(steps):
            per_label.setdefault(run.label, []).append((steps, moving_average(values, smoothing)))
    curves = {}
    for label, pairs in per_label.items():
        common = pairs[0][0]
        for steps, _ in pairs[1:]:
            common = np.intersect1d(common, steps)
        if not len(common):
            continue
        stacked = np.stack([values[np.searchsorted(steps, common)] for steps, values in pairs])
        curves[label] = GroupCurve(common, stacked.mean(0), stacked.std(0), len(pairs))
    return curves


BANDS = "lines: mean over each label's runs; bands: +-1 standard deviation over them"


def _draw(ax, curves: dict[str, GroupCurve], title: str, metric: str) -> None:
    from matplotlib.ticker import MaxNLocator

    for label, curve in curves.items():
        runs = f"{curve.num_runs} run{'s' if curve.num_runs > 1 else ''}"
        (line,) = ax.plot(curve.steps, curve.mean, label=f"{label} ({runs})", linewidth=1.5)
        if curve.num_runs > 1:
            ax.fill_between(curve.steps, curve.mean - curve.std, curve.mean + curve.std, color=line.get_color(), alpha=0.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("PPO step")
    ax.set_ylabel(metric, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_diagnostics(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    labels: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    smoothing: int = 1,
) -> list[Path]:
    """One PNG per metric (named after it, "/" -> "_") and `diagnostics.png` with every panel, in
    `out_dir`. `metrics` default: those of DIAGNOSTICS that any run logged. Returns the paths written."""
    runs = load_runs(run_dirs, labels)
    if metrics is None:
        logged = {key for run in runs for row in run.rows for key in row}
        metrics = [m for m in DIAGNOSTICS if m in logged]
    panels = [(m, group_curves(runs, m, smoothing)) for m in metrics]
    missing = [m for m, curves in panels if not curves]
    if missing:
        raise ValueError(f"no run logged the metrics {missing}")
    if not panels:
        raise ValueError(f"the runs logged none of the diagnostics {list(DIAGNOSTICS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    written = []
    for metric, curves in panels:
        fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
        _draw(ax, curves, DIAGNOSTICS.get(metric, metric), metric)
        fig.suptitle(BANDS, fontsize=8)
        written.append(out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', metric)}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), layout="constrained", squeeze=False)
    for ax, (metric, curves) in zip(axes.flat, panels):
        _draw(ax, curves, DIAGNOSTICS.get(metric, metric), metric)
    fig.suptitle(BANDS, fontsize=10)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    written.append(out_dir / "diagnostics.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
