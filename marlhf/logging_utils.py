"""Metrics logging: one JSON line per logged step in OUTPUT_DIR/metrics.jsonl, plus experiment trackers.

API:
    logger = MetricsLogger(output_dir, report_to=("jsonl", "wandb"), is_main_process=accelerator.is_main_process,
                           resume_step=None, run_config=config.to_dict(), project="marlhf", run_name=None)
    logger.log({"loss": loss_tensor, "lr": 1e-5}, step=7)   # writes {"step": 7, "loss": ..., "lr": ...}
    logger.close()                                        # also a context manager
    check_report_to(report_to)                            # ValueError for unknown, combined-with-none or
                                                          # not-installed trackers
    read_metrics(output_dir) -> list[dict]                # the lines of metrics.jsonl
    reduce_metrics(stats, accelerator) -> dict[str, float]  # mean of each scalar over processes

Only the main process writes. A fresh run (resume_step=None) truncates metrics.jsonl; a resumed run keeps
the lines with step <= resume_step and drops the rest (rewritten to a temporary file, then renamed over the
old one), so after a crash and resume the file reads like one uninterrupted run. A torn last line (a crash
or a full disk mid-write) is dropped with a warning; a damaged line elsewhere is an error naming it.

Trackers are Accelerate's (`accelerate.tracking`): tensorboard (OUTPUT_DIR/tensorboard), wandb (files in
OUTPUT_DIR/wandb; WANDB_MODE=offline works), mlflow (MLFLOW_TRACKING_URI decides the store) and trackio.
metrics.jsonl is written whatever else is named; `none` alone writes nothing. The run config is logged once per
tracker run. OUTPUT_DIR/trackers.json keeps the tracker run ids, so a resumed run continues the same wandb,
mlflow and trackio run (TensorBoard purges the events after the checkpoint's step). Steps after the checkpoint
were already logged by the crashed launch: wandb keeps those (a resumed run recomputes them bit for bit),
mlflow records them a second time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

METRICS_FILE = "metrics.jsonl"
TRACKERS_FILE = "trackers.json"
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
ReportTo = Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio", "none"]
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "marlhf[wandb]"),
             "mlflow": ("mlflow", "marlhf[mlflow]"), "trackio": ("trackio", "marlhf[trackio]")}


def check_report_to(report_to: tuple[str, ...]) -> None:
    """ValueError unless every entry is a known sink whose package is installed, and `none` stands alone."""
    if not report_to:
        raise ValueError("report_to must name at least one sink (jsonl, tensorboard, wandb, mlflow, trackio) "
                         "or be none")
    for name in report_to:
        if name not in ("jsonl", "none", *TRACKERS):
            raise ValueError(f"report_to: unknown sink {name!r}; choose from jsonl, tensorboard, wandb, mlflow, "
                             "trackio, none")
        if name in _PACKAGES and importlib.util.find_spec(_PACKAGES[name][0]) is None:
            raise ValueError(f"report_to {name} needs the {_PACKAGES[name][0]} package: "
                             f"pip install '{_PACKAGES[name][1]}'")
    if "none" in report_to and len(report_to) > 1:
        raise ValueError(f"report_to: none writes nothing and cannot be combined with other sinks, got {report_to}")


class MetricsLogger:
    def __init__(self, output_dir: str | Path, report_to: ReportTo | tuple[ReportTo, ...] = ("jsonl",),
                 is_main_process: bool = True, resume_step: int | None = None, lock=None,
                 run_config: dict[str, Any] | None = None, project: str = "marlhf",
                 run_name: str | None = None) -> None:
        self._lock = lock  # the output directory's lock (marlhf.run_lock), released by close()
        report_to = (report_to,) if isinstance(report_to, str) else tuple(report_to)
        check_report_to(report_to)
        self.path = Path(output_dir) / METRICS_FILE
        self._file = None
        self._trackers = []
        if not is_main_process or report_to == ("none",):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept_lines = []
        if resume_step is not None and self.path.exists():
            kept_lines = [json.dumps(row) for row in _read_rows(self.path) if row["step"] <= resume_step]
        _write_atomically(self.path, "".join(line + "\n" for line in kept_lines))
        self._file = open(self.path, "a")
        names = [name for name in TRACKERS if name in report_to]
        if names:
            self._trackers = _start_trackers(names, Path(output_dir), resume_step, run_config or {}, project,
                                             run_name or Path(output_dir).resolve().name)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._file is None:
            return
        values = {name: float(_checked_scalar(name, value)) for name, value in metrics.items()}
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        for tracker in self._trackers:
            tracker.log(values, step=step)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _start_trackers(names: list[str], output_dir: Path, resume_step: int | None, run_config: dict[str, Any],
                    project: str, run_name: str) -> list:
    """Accelerate's trackers for `names`, started; a resumed run reopens the runs recorded in trackers.json."""
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, TrackioTracker, WandBTracker

    ids_path = output_dir / TRACKERS_FILE
    known = json.loads(ids_path.read_text()) if resume_step is not None and ids_path.exists() else {}
    # One id for the run's lineage: wandb's run id, and what makes the trackio run name unique in its project.
    run_id = known.get("run_id") or uuid.uuid4().hex[:8]
    configured = set(known.get("configured", ()))
    trackers = []
    for name in names:
        if name == "tensorboard":
            tracker = TensorBoardTracker("tensorboard", output_dir,
                                         purge_step=None if resume_step is None else resume_step + 1)
        elif name == "wandb":
            tracker = WandBTracker(project, id=run_id, resume="allow", name=run_name, dir=str(output_dir))
        elif name == "mlflow":
            tracker = MLflowTracker(experiment_name=project, run_id=known.get("mlflow_run_id"), run_name=run_name)
        else:
            tracker = TrackioTracker(project, name=f"{run_name}-{run_id}", resume="allow")
        tracker.start()
        if name not in configured:
            tracker.store_init_configuration(_flat_config(run_config))
            configured.add(name)
        if name == "mlflow":
            known["mlflow_run_id"] = tracker.tracker.info.run_id
        trackers.append(tracker)
    known.update(run_id=run_id, configured=sorted(configured))
    _write_atomically(ids_path, json.dumps(known, indent=1) + "\n")
    return trackers


def _flat_config(run_config: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The config as the scalars every tracker takes: lists as JSON text, None as "none"."""
    return {key: "none" if value is None else value if isinstance(value, (bool, int, float, str))
            else json.dumps(value) for key, value in run_config.items()}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _checked_scalar(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"metric {name!r} must be a number or a one-element tensor, got {type(value).__name__}")


def read_metrics(output_dir: str | Path) -> list[dict[str, float]]:
    return _read_rows(Path(output_dir) / METRICS_FILE)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a torn last line is dropped with a warning, any other bad line is an error."""
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a {\"step\": ...} object")
        except ValueError as error:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: dropping a torn last line ({error})", stacklevel=3)
                break
            raise ValueError(f"{path}:{number} is not a metrics row ({error})") from None
        rows.append(row)
    return rows


def reduce_metrics(stats: dict[str, Any], accelerator=None) -> dict[str, float]:
    """Mean of each scalar metric over all processes (identity on one process). The tensors are read to the
    host together, in one device read."""
    if not stats:
        return {}
    names = list(stats)
    scalars = [_checked_scalar(name, stats[name]) for name in names]
    device = accelerator.device if accelerator is not None else next(
        (x.device for x in scalars if isinstance(x, torch.Tensor)), torch.device("cpu"))
    values = torch.stack([x.to(device, torch.float64) if isinstance(x, torch.Tensor)
                          else torch.tensor(x, dtype=torch.float64, device=device) for x in scalars])
    if accelerator is not None and accelerator.num_processes > 1:
        values = accelerator.reduce(values, reduction="mean")
    return dict(zip(names, values.tolist()))
