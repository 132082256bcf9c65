"""The rollout worker process (marlhf.engines.worker): what it samples, and its life cycle: start, stop, the
trainer killed (SIGKILL, SIGINT), the worker killed, failing or hung."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from marlhf.engines import HFEngine, HFOptions
from marlhf.engines.worker import RolloutWorker, WorkerSpec
from marlhf.errors import MarlhfError
from marlhf.data.encoding import pad_sequences
from tests.sweeps import sweep

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLING = dict(max_new_tokens=6, temperature=0.8, top_k=0, top_p=1.0, eos_token_id=2, pad_token_id=0,
                return_logprobs=True)


class HangingEngine:
    """An engine whose generate never returns (a stuck kernel, a deadlock)."""

    def __init__(self, context=None) -> None:
        pass

    def sync_weights(self, policy) -> None:
        pass

    def generate(self, *args, **kwargs):
        time.sleep(3600)

    def close(self) -> None:
        pass


class FailingEngine(HangingEngine):
    def generate(self, *args, **kwargs):
        raise RuntimeError("the device fell over\nsecond line")


def _prompts(tokenizer, n: int = 4):
    ids = [tokenizer(f"Human: tell me about {word}\n\nAssistant:").input_ids
           for word in ("cats", "tea", "maps", "rain")[:n]]
    prompt_ids, prompt_mask = pad_sequences(ids, tokenizer.pad_token_id, "left")
    return prompt_ids, prompt_mask.bool()


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (our own child not yet reaped) counts as gone
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_worker_samples_what_the_engine_samples_in_process_and_stops(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    policy = make_tiny_causal_lm().eval()
    prompt_ids, prompt_mask = _prompts(tiny_tokenizer)
    seeds = [11, 12, 13, 14]
    engine = HFEngine()
    engine.sync_weights(policy)
    expected = engine.generate(prompt_ids, prompt_mask, row_seeds=seeds, **SAMPLING)

    log = tmp_path / "rollout_worker_0.log"
    worker = RolloutWorker(WorkerSpec("hf", HFOptions(), max_length=64, threads=1, log_path=str(log), timeout=120))
    try:
        worker.send_weights(policy)
        worker.submit(0, prompt_ids, prompt_mask, row_seeds=seeds, **SAMPLING)
        with torch.no_grad():  # new weights: the next request is sampled with them, the first one was not
            for parameter in policy.parameters():
                parameter.mul_(1.5)
        worker.send_weights(policy)
        worker.submit(1, prompt_ids, prompt_mask, row_seeds=seeds, **SAMPLING)
        second, _, _ = worker.result(1)  # out of order: the first is kept until asked for
        first, seconds, tokens = worker.result(0)
    finally:
        worker.close()
    assert torch.equal(first.response_ids, expected.response_ids)
    assert torch.equal(first.response_mask, expected.response_mask)
    torch.testing.assert_close(first.logprobs, expected.logprobs)
    assert seconds > 0 and tokens == int(expected.response_mask.sum())
    engine.sync_weights(policy)
    assert torch.equal(second.response_ids, engine.generate(prompt_ids, prompt_mask, row_seeds=seeds,
                                                            **SAMPLING).response_ids)
    assert not worker.process.is_alive() and worker.process.exitcode == 0
    assert "rollout worker 0: pid" in log.read_text()


@pytest.mark.parametrize("fault", sweep(["hung", "killed", "failed"]))  # hung, the timeout, by default
def test_a_dead_hung_or_failing_worker_stops_the_trainer_within_the_timeout(fault, tmp_path, make_tiny_causal_lm,
                                                                            tiny_tokenizer):
    engine = {"killed": "tests.test_rollout_worker:HangingEngine", "hung": "tests.test_rollout_worker:HangingEngine",
              "failed": "tests.test_rollout_worker:FailingEngine"}[fault]
    log = tmp_path / "rollout_worker_3.log"
    timeout = 3.0 if fault == "hung" else 60.0  # the others must not time out while the worker starts
    worker = RolloutWorker(WorkerSpec(engine, log_path=str(log), index=3, timeout=timeout))
    prompt_ids, prompt_mask = _prompts(tiny_tokenizer, 2)
    try:
        worker.send_weights(make_tiny_causal_lm())
        worker.submit(0, prompt_ids, prompt_mask, row_seeds=[1, 2], **SAMPLING)
        if fault == "killed":
            time.sleep(0.5)
            os.kill(worker.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(MarlhfError) as caught:
            worker.result(0)
        waited = time.monotonic() - start
    finally:
        worker.close()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"rollout worker 3 (pid {worker.process.pid})")
    assert message.endswith(f"its log: {log}")
    assert {"killed": "exited with status -9", "hung": "sent nothing for 3 s",
            "failed": "failed: the device fell over second line (exit status 1)"}[fault] in message
    assert waited < 3.0 + 20  # the timeout, after the worker's start-up on a busy machine
    assert not worker.process.is_alive()
    if fault == "failed":
        assert "Traceback" in log.read_text()  # the traceback stays in the worker's log


_TRAINER = """
import signal, sys, time, torch
from marlhf.engines.worker import RolloutWorker, WorkerSpec
# A suite started in the background (bash `cmd &`, `trap "" INT`) hands its children SIGINT ignored, and Python then
# keeps it ignored: a terminal's Ctrl-C is what this test stands for, so take it back.
signal.signal(signal.SIGINT, signal.default_int_handler)
worker = RolloutWorker(WorkerSpec("tests.test_rollout_worker:HangingEngine", log_path=sys.argv[1]))
try:
    print(worker.process.pid, flush=True)
    time.sleep(600)
finally:
    worker.close()
"""


@pytest.mark.parametrize("signal_number", sweep([signal.SIGKILL, signal.SIGINT]))
def test_no_worker_outlives_its_trainer(signal_number, tmp_path):
    """SIGKILL of the trainer: the kernel kills the worker (PR_SET_PDEATHSIG); SIGINT (Ctrl-C): the trainer's
    KeyboardInterrupt closes it. No orphan either way."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(tmp_path / "worker.log")], env=env, cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker_pid = int(trainer.stdout.readline())
        time.sleep(1.0)
        trainer.send_signal(signal_number)
        trainer.wait(60)  # close() may take 20 s by design (ask, terminate, kill); more on a loaded machine
        assert _gone(worker_pid, within=15), f"worker {worker_pid} outlived its trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()


def test_a_trainer_read_from_stdin_can_start_a_worker(tmp_path):
    """`python - <<EOF` (a heredoc, as benchmarks/gpu.sh runs its trainer) has no main script for spawn to re-run."""
    script = f"""
from marlhf.engines import HFOptions
from marlhf.engines.worker import RolloutWorker, WorkerSpec
worker = RolloutWorker(WorkerSpec("hf", HFOptions(), 64, 1, {str(tmp_path / 'w.log')!r}, 0, 60))
worker._put(("stop",))
worker.process.join(60)
print("exit", worker.process.exitcode)
worker.close()
"""
    result = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
    assert result.stdout.strip().endswith("exit 0"), result.stderr[-2000:]
