from __future__ import annotations

import importlib.util
import json
import sqlite3
import subprocess
import sys

import pytest
import torch

from marlhf.logging_utils import TRACKERS_FILE, MetricsLogger, check_report_to, read_metrics, reduce_metrics


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
        MetricsLogger(tmp_path, "comet")
    assert reduce_metrics({"a": torch.tensor(2.0), "b": 3}) == {"a": 2.0, "b": 3.0}


def test_report_to_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="unknown sink 'comet'"):
        check_report_to(("jsonl", "comet"))
    with pytest.raises(ValueError, match="cannot be combined"):
        check_report_to(("none", "tensorboard"))
    with pytest.raises(ValueError, match="at least one"):
        check_report_to(())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name))
    with pytest.raises(ValueError, match=r"needs the wandb package: pip install 'marlhf\[wandb\]'"):
        check_report_to(("jsonl", "wandb"))
    check_report_to(("jsonl", "tensorboard"))


TRACKER_PACKAGES = ("wandb", "mlflow", "trackio")


@pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in TRACKER_PACKAGES),
                    reason="the tracker extras are not installed (pip install 'marlhf[wandb,mlflow,trackio]')")
def test_trackers_log_the_run_and_a_resume_continues_it(tmp_path, tiny_model_dir, tiny_records):
    """`marlhf sft --report_to tensorboard wandb mlflow trackio`, then a resume that runs one more step: the real
    libraries, offline, every file under tmp_path. The resumed launch must log into the same mlflow run, the same
    wandb run id and the same trackio run, and the run config is logged once."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_CONFIG_HOME": str(home / ".config"), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb_data"), "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
           "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
           "OMP_NUM_THREADS": "1"}
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))

    def sft(*arguments):
        child = subprocess.run(
            [sys.executable, "-m", "marlhf", "sft", "--model_name_or_path", str(tiny_model_dir), "--dataset",
             str(records), "--output_dir", "run", "--max_prompt_length", "32", "--max_length", "64",
             "--save_steps", "1", "--report_to", "jsonl", "tensorboard", "wandb", "mlflow", "trackio", *arguments],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]

    sft("--max_steps", "2")
    sft("--max_steps", "3", "--resume", "latest")
    run = tmp_path / "run"
    steps = [row["step"] for row in read_metrics(run)]
    assert steps == [1, 2, 3]
    ids = json.loads((run / TRACKERS_FILE).read_text())
    assert ids["configured"] == ["mlflow", "tensorboard", "trackio", "wandb"]

    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    wandb_runs = sorted(path.name for path in (run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(name.endswith("-" + ids["run_id"]) for name in wandb_runs)

    query = ("import json, sys, mlflow; c = mlflow.tracking.MlflowClient(); "
             "runs = [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id])]; "
             "print(json.dumps([[r.info.run_id, r.data.params.get('learning_rate'), "
             "[m.step for m in c.get_metric_history(r.info.run_id, 'loss')]] for r in runs]))")
    child = subprocess.run([sys.executable, "-c", query], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout) == [[ids["mlflow_run_id"], "2e-05", steps]]

    with sqlite3.connect(tmp_path / "trackio" / "marlhf.db") as db:
        logged = db.execute("SELECT run_name, step FROM metrics ORDER BY step").fetchall()
    assert logged == [(f"run-{ids['run_id']}", step) for step in steps]
    assert not any(path for path in tmp_path.iterdir() if path.name not in (
        "home", "hf", "trackio", "wandb", "wandb_cache", "wandb_config", "wandb_data", "mlruns", "run", "sft.jsonl"))
