"""Metrics logging: one JSON line per logged step in OUTPUT_DIR/metrics.jsonl, optionally TensorBoard.

API:
    logger = MetricsLogger(output_dir, report_to="jsonl", is_main_process=accelerator.is_main_process,
                           resume_step=None)
    logger.log({"loss": loss_tensor, "lr": 1e-5}, step=7)   # writes {"step": 7, "loss": ..., "lr": ...}
    logger.close()                                        # also a context manager
    read_metrics(output_dir) -> list[dict]                # the lines of metrics.jsonl
    reduce_metrics(stats, accelerator) -> dict[str, float]  # mean of each scalar over processes

Only the main process writes. A fresh run (resume_step=None) truncates metrics.jsonl; a resumed run keeps
the lines with step <= resume_step and drops the rest (rewritten to a temporary file, then renamed over the
old one), so after a crash and resume the file reads like one uninterrupted run. A torn last line (a crash
or a full disk mid-write) is dropped with a warning; a damaged line elsewhere is an error naming it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, output_dir: str | Path, report_to: Literal["jsonl", "tensorboard", "none"] = "jsonl",
                 is_main_process: bool = True, resume_step: int | None = None, lock=None) -> None:
        self._lock = lock  # the output directory's lock (marlhf.run_lock), released by close()
        if report_to not in ("jsonl", "tensorboard", "none"):
            raise ValueError(f"report_to must be 'jsonl', 'tensorboard' or 'none', got {report_to!r}")
        self.path = Path(output_dir) / METRICS_FILE
        self._file = None
        self._tensorboard = None
        if not is_main_process or report_to == "none":
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept_lines = []
        if resume_step is not None and self.path.exists():
            kept_lines = [json.dumps(row) for row in _read_rows(self.path) if row["step"] <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as handle:
            handle.writelines(line + "\n" for line in kept_lines)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"),
                                              purge_step=None if resume_step is None else resume_step + 1)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._file is None:
            return
        values = {name: float(_checked_scalar(name, value)) for name, value in metrics.items()}
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
