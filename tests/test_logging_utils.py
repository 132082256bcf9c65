from __future__ import annotations

import pytest
import torch

from marlhf.logging_utils import MetricsLogger, read_metrics, reduce_metrics


def test_jsonl_lines_and_resume_truncation(tmp_path):
    with MetricsLogger(tmp_path, "jsonl") as logger:
        for step in (1, 2, 3):
            logger.log({"loss": torch.tensor(float(step)), "lr": 0.5}, step)
    assert read_metrics(tmp_path) == [{"step": s, "loss": float(s), "lr": 0.5} for s in (1, 2, 3)]
    with MetricsLogger(tmp_path, "jsonl", resume_step=2) as logger:  # steps after the checkpoint are redone
        logger.log({"loss": 9.0}, 3)
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 9.0)]
    MetricsLogger(tmp_path, "jsonl").close()  # a fresh run starts a fresh file
    assert read_metrics(tmp_path) == []


def test_non_main_process_and_none_write_nothing(tmp_path):
    MetricsLogger(tmp_path / "a", "jsonl", is_main_process=False).log({"x": 1.0}, 1)
    MetricsLogger(tmp_path / "b", "none").log({"x": 1.0}, 1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_tensorboard_events_written(tmp_path):
    with MetricsLogger(tmp_path, "tensorboard") as logger:
        logger.log({"loss": 1.0}, 1)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]


def test_bad_metric_values(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match="loss"):
            logger.log({"loss": torch.ones(2)}, 1)
        with pytest.raises(ValueError, match="name"):
            logger.log({"name": "text"}, 1)
    with pytest.raises(ValueError, match="report_to"):
        MetricsLogger(tmp_path, "wandb")
    assert reduce_metrics({"a": torch.tensor(2.0), "b": 3}) == {"a": 2.0, "b": 3.0}
