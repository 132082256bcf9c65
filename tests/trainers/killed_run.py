"""Run a trainer in a child process and SIGKILL it right after it logs a given step: the crash half of
the resume tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import importlib, json, os, signal, sys
import torch
from marlhf.logging_utils import MetricsLogger

module, config_class, train, config_path, records_path, kill_after = sys.argv[1:]
log = MetricsLogger.log

def log_then_die(self, metrics, step):
    log(self, metrics, step)
    if step == int(kill_after):
        os.kill(os.getpid(), signal.SIGKILL)

MetricsLogger.log = log_then_die
torch.set_num_threads(1)  # as in the test process (tests/conftest.py), so both compute bit-identical numbers
trainer = importlib.import_module(module)
getattr(trainer, train)(getattr(trainer, config_class).from_yaml(config_path), json.load(open(records_path)))
"""


def run_until_killed(module: str, config_class: str, train: str, config, records: list[dict], kill_after: int,
                     work_dir: Path) -> None:
    """Train `config` with `module.train` on `records` in a child process killed by SIGKILL after it logs
    step `kill_after`; assert it died that way."""
    config_path, records_path = work_dir / "killed_run.yaml", work_dir / "killed_run_records.json"
    config.save_yaml(config_path)
    records_path.write_text(json.dumps(records))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", _SCRIPT, module, config_class, train, str(config_path),
                            str(records_path), str(kill_after)], env=env, cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -9, child.stderr[-2000:]
