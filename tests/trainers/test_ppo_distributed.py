"""Data-parallel PPO: 2 CPU processes (gloo) with P prompts each must train exactly like 1 process with 2P.

Rollouts are sampled from per-sample seeds (run seed, step, global row index), so rank r's rows are rows
r*P..(r+1)*P-1 of the single-process batch; whitening, loss normalisation and baselines are reduced across
ranks. The final policies must agree to float tolerance, under DDP and under FSDP2 (policy and critic sharded
per transformer block with configs/accelerate/fsdp.yaml's settings, in float32 on CPU: see
ppo_data_parallel_run.py). Under FSDP2, checkpoints gather the full weights and optimizer states, and a run
resumed from one continues exactly like the uninterrupted run. Under DeepSpeed ZeRO-2 and ZeRO-3 (an engine each for
policy and critic; run only where deepspeed is installed) 2 processes train like 2 under DDP.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from marlhf.logging_utils import read_metrics
from tests.sweeps import sweep

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = REPO_ROOT / "tests" / "trainers" / "ppo_data_parallel_run.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(output_dir: Path, processes: int, prompts_per_process: int, advantage: str, sharding: str = "ddp",
         *options: str) -> str:
    """Run ppo_data_parallel_run.py (options: --max_steps=N, --save_steps=N, --resume=...); return its stdout."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(RUN), str(output_dir),
               str(prompts_per_process), advantage, sharding, *options]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


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


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """The 2-process run with 2 prompts each of an advantage estimator and a sharding, made once for the module."""
    made: dict[tuple[str, str], Path] = {}

    def run(advantage: str, sharding: str) -> Path:
        if (advantage, sharding) not in made:
            made[advantage, sharding] = tmp_path_factory.mktemp(f"ppo_two_{sharding}_{advantage}")
            _run(made[advantage, sharding], processes=2, prompts_per_process=2, advantage=advantage, sharding=sharding)
        return made[advantage, sharding]

    return run


# gae: critic, macro GAE, advantages whitened over all rows; reinforce: no critic, baseline = mean over all rows;
# prefix_tree: no critic, each group's tree from the gathered token ids of all rows.
# The reinforce runs sample with sampling_noise='counter_hash', the others with one generator per row.
# fsdp: the policy and the critic sharded across the 2 processes (the run checks that they were).
# gae under fsdp runs by default (the trainer's cross-rank reductions are DDP's, and the sharding on top); the rest
# under -m slow.
@pytest.fixture(scope="module", params=sweep([("gae", "fsdp"), ("gae", "ddp"), ("reinforce", "ddp"),
                                              ("prefix_tree", "ddp")]), ids="-".join)
def runs(request, one_process_run, two_process_run):
    advantage, sharding = request.param
    return one_process_run(advantage), two_process_run(advantage, sharding)


def _assert_same_final_policy(expected_run: Path, run: Path) -> None:
    """Equal to float tolerance. Adam at lr 1e-2 magnifies the gradients' reduction-order differences (~1e-7) on
    weights whose gradient is near 0, and how much depends on the CPU's kernels: measured up to 9e-6 with lam 0.95
    and 1.6e-5 with lam 1 on one machine, 1.1e-4 on one weight of 39,072 on an AMD EPYC (1 vs 2 processes, DDP).
    Whitening per process instead of over all rows, the kind of bug this guards against, moves 74 % of the weights,
    by up to 4e-2: so a few weights may pass 1e-4, none 1e-3."""
    expected, actual = load_file(str(expected_run / "model.safetensors")), load_file(str(run / "model.safetensors"))
    assert expected.keys() == actual.keys()
    differences = torch.cat([(actual[name] - expected[name]).abs().flatten() for name in expected])
    assert differences.max() < 1e-3, f"largest weight difference {differences.max():.2e}"
    assert (differences > 1e-4).float().mean() < 1e-3, f"{(differences > 1e-4).sum()} weights differ by over 1e-4"


def test_two_processes_train_like_one_with_the_doubled_batch(runs):
    one, two = runs
    _assert_same_final_policy(one, two)

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


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (optional; pip install --no-build-isolation deepspeed==0.19.8)")
@pytest.mark.parametrize("zero", sweep(["zero2", "zero3"]))
def test_deepspeed_trains_policy_and_critic_like_ddp(two_process_run, zero):
    """2 processes under ZeRO-2 / ZeRO-3 (configs/accelerate/deepspeed_zero<N>.yaml's settings, float32 on CPU),
    each model stepped by its own engine, against 2 processes under DDP: same samples, so the same policy up to
    the order of the gradient reductions (measured at lam 1: 9e-6 at most under ZeRO-2, 1.3e-5 under ZeRO-3), and
    the same metrics, the critic's included."""
    ddp, sharded = two_process_run("gae", "ddp"), two_process_run("gae", zero)
    _assert_same_final_policy(ddp, sharded)
    metrics_ddp, metrics_sharded = read_metrics(ddp), read_metrics(sharded)
    assert [m["step"] for m in metrics_sharded] == [1, 2]
    for m_ddp, m_sharded in zip(metrics_ddp, metrics_sharded):
        assert m_sharded.keys() == m_ddp.keys()
        for name in m_ddp:
            if not name.startswith("time/"):
                assert m_sharded[name] == pytest.approx(m_ddp[name], rel=1e-4, abs=1e-5), name


def test_checkpoints_under_deepspeed_are_an_error(tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from marlhf.trainers.common import configure_deepspeed
    from marlhf.trainers.ppo import PPOConfig

    plugin = SimpleNamespace(deepspeed_config={"train_micro_batch_size_per_gpu": "auto"},
                             is_auto=lambda key: plugin.deepspeed_config[key] == "auto")
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(
        deepspeed_plugin=plugin))
    config = PPOConfig(output_dir=str(tmp_path), model_name_or_path="unused", save_steps=10)
    with pytest.raises(ValueError, match="checkpoints and resume do not work under DeepSpeed"):
        configure_deepspeed(accelerator, config, 4)
    configure_deepspeed(accelerator, dataclasses.replace(config, save_steps=0), 4)
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 4


@pytest.mark.slow  # two more launches; by default: resume in one process (test_ppo.py), FSDP training above
def test_fsdp_run_resumed_from_a_checkpoint_continues_like_the_uninterrupted_run(two_process_run, tmp_path,
                                                                                  tiny_tokenizer):
    """2 processes, FSDP2: step 1 saved (a collective gather of weights and optimizer states), then a second
    launch resumes from it (each process takes its shards) for step 2. The checkpoint holds what an unsharded
    run's holds; the resumed run's weights and metrics must equal those of the uninterrupted 2-step run."""
    from tests.conftest import build_tiny_causal_lm
    from tests.trainers.test_ppo import _metrics_without_timings
    from transformers import AutoModelForCausalLM

    from marlhf.checkpoint import load_state

    straight = two_process_run("gae", "fsdp")
    resumed = tmp_path / "resumed"
    _run(resumed, 2, 2, "gae", "fsdp", "--max_steps=1", "--save_steps=1")

    checkpoint = resumed / "checkpoint-1"
    full_shapes = {name: p.shape for name, p in build_tiny_causal_lm(tiny_tokenizer).named_parameters()}
    saved_policy = AutoModelForCausalLM.from_pretrained(checkpoint / "policy")
    assert {name: p.shape for name, p in saved_policy.named_parameters()} == full_shapes
    for name in ("policy", "critic"):  # numbered as optimizer.state_dict() numbers the parameters, not sharded
        optimizer = load_state(checkpoint / f"optimizer.{name}")
        numbers = [number for group in optimizer["param_groups"] for number in group["params"]]
        assert sorted(optimizer["state"]) == numbers == list(range(len(numbers)))
    policy_moments = load_state(checkpoint / "optimizer.policy")["state"]
    assert [policy_moments[i]["exp_avg"].shape for i in range(len(full_shapes))] == list(full_shapes.values())

    stdout = _run(resumed, 2, 2, "gae", "fsdp", "--max_steps=2", "--save_steps=1", "--resume=latest")
    assert f"resumed from {checkpoint} at step 1" in stdout
    assert (resumed / "checkpoint-2").is_dir()
    assert _metrics_without_timings(resumed) == _metrics_without_timings(straight)
    policy_resumed, policy_straight = (load_file(str(run / "model.safetensors")) for run in (resumed, straight))
    assert policy_resumed.keys() == policy_straight.keys()
    assert all(torch.equal(policy_resumed[name], policy_straight[name]) for name in policy_straight)


def test_fsdp_asked_for_but_not_set_up_is_an_error(monkeypatch, tmp_path):
    """`accelerate launch --config_file configs/accelerate/fsdp.yaml` on a CPU-only machine: Accelerate would
    run unsharded (here: one process) without a word."""
    from accelerate.state import AcceleratorState

    from marlhf.trainers.common import make_accelerator
    from marlhf.trainers.ppo import PPOConfig

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate keeps one process-wide state
    try:
        with pytest.raises(ValueError, match="asks for FSDP"):
            make_accelerator(PPOConfig(output_dir=str(tmp_path), model_name_or_path="unused"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_lora_under_fsdp_is_an_error(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from marlhf.trainers import common
    from marlhf.trainers.ppo import PPOConfig

    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2)
    monkeypatch.setattr(common, "Accelerator", lambda **kwargs: fsdp)
    config = PPOConfig(output_dir=str(tmp_path), model_name_or_path="unused", use_lora=True)
    with pytest.raises(ValueError, match="use_lora does not work under FSDP"):
        common.make_accelerator(config)
    assert common.make_accelerator(dataclasses.replace(config, use_lora=False)) is fsdp


GUESS_ENV = "tests/fixtures/guess_env.py:GuessNumber"


@pytest.mark.slow  # two more launches a case
@pytest.mark.parametrize("advantage", ["gae", "gigpo"])
def test_two_processes_run_episodes_like_one_with_the_doubled_batch(tmp_path, advantage):
    """Episodes of an environment (termination `turn`): each process runs its rows' episodes, whose turn tensors may
    differ in width between processes; the estimators gather them padded (GiGPO's anchor-state groups over all
    rows), so 2 processes with 2 prompts each train like 1 with 4."""
    one, two = tmp_path / "one", tmp_path / "two"
    _run(one, 1, 4, advantage, "ddp", "--env", GUESS_ENV)
    _run(two, 2, 2, advantage, "ddp", "--env", GUESS_ENV)
    _assert_same_final_policy(one, two)
    metrics_one, metrics_two = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in metrics_two] == [1, 2]
    for m_one, m_two in zip(metrics_one, metrics_two):
        assert m_two["env/episodes"] * 2 == m_one["env/episodes"] or m_two["env/episodes"] == m_one["env/episodes"]
        for name in ("objective/rm_score", "objective/kl", "val/advantage_l2"):
            assert m_two[name] == pytest.approx(m_one[name], rel=1e-4, abs=1e-5), name
