"""Data-parallel PPO: 2 CPU processes (gloo) with P prompts each must train exactly like 1 process with 2P.

Rollouts are sampled from per-sample seeds (run seed, step, global row index), so rank r's rows are rows
r*P..(r+1)*P-1 of the single-process batch; whitening, loss normalisation and baselines are reduced across
ranks. The final policies must agree to float tolerance, under DDP and under FSDP2 (policy and critic sharded
per transformer block with configs/accelerate/fsdp.yaml's settings, in float32 on CPU: see
ppo_data_parallel_run.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from marlhf.logging_utils import read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = REPO_ROOT / "tests" / "trainers" / "ppo_data_parallel_run.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(output_dir: Path, processes: int, prompts_per_process: int, advantage: str, sharding: str = "ddp") -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(RUN), str(output_dir),
               str(prompts_per_process), advantage, sharding]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The 1-process run with 4 prompts of an advantage estimator, made once for the module."""
    made: dict[str, Path] = {}

    def run(advantage: str) -> Path:
        if advantage not in made:
            made[advantage] = tmp_path_factory.mktemp(f"ppo_one_{advantage}")
            _run(made[advantage], processes=1, prompts_per_process=4, advantage=advantage)
        return made[advantage]

    return run


# gae: critic, macro GAE, advantages whitened over all rows; reinforce: no critic, baseline = mean over all rows.
# fsdp: the policy and the critic sharded across the 2 processes (the run checks that they were).
@pytest.fixture(scope="module", params=[("gae", "ddp"), ("reinforce", "ddp"), ("gae", "fsdp")], ids="-".join)
def runs(request, one_process_run, tmp_path_factory):
    advantage, sharding = request.param
    two = tmp_path_factory.mktemp(f"ppo_two_{sharding}_{advantage}")
    _run(two, processes=2, prompts_per_process=2, advantage=advantage, sharding=sharding)
    return one_process_run(advantage), two


def test_two_processes_train_like_one_with_the_doubled_batch(runs):
    one, two = runs
    policy_one, policy_two = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert policy_one.keys() == policy_two.keys()
    for name in policy_one:
        torch.testing.assert_close(policy_two[name], policy_one[name], rtol=1e-4, atol=1e-5, msg=name)

    metrics_one, metrics_two = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in metrics_two] == [1, 2]
    for m_one, m_two in zip(metrics_one, metrics_two):
        # per-row means over equal shares of rows: the mean of the two ranks' means is the global mean
        for name in ("objective/rm_score", "objective/kl", "objective/response_length", "val/advantage_l2"):
            assert m_two[name] == pytest.approx(m_one[name], rel=1e-4, abs=1e-5), name


def test_the_update_changed_the_policy(runs, tiny_tokenizer):
    from tests.conftest import build_tiny_causal_lm

    start = build_tiny_causal_lm(tiny_tokenizer).state_dict()
    trained = load_file(str(runs[1] / "model.safetensors"))
    assert any(not torch.allclose(trained[name], start[name]) for name in trained)
