"""Device -> host reads in one PPO step: a small number that does not grow with the mini-batches or pieces.

On an accelerator every read (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `.cpu()`, ...) waits for the
queued work, so the update's loops must hold none. On the CPU nothing waits, so the test counts the calls
themselves, made from marlhf's own code during the step's stages.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import marlhf
import marlhf.trainers.ppo as ppo
from marlhf.checkpoint import list_checkpoints
from marlhf.logging_utils import read_metrics
from tests.trainers.test_ppo import RECORDS, _config, count_e

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
STAGES = ("sample", "score", "macro_actions", "estimate_advantages", "ppo_update", "step_metrics")
PACKAGE = str(Path(marlhf.__file__).parent)


@pytest.fixture
def count_reads(monkeypatch):
    """Counter of reads per (stage, method, file, function), made by marlhf code inside the PPO step's stages."""
    counts: collections.Counter = collections.Counter()
    inside: list[str | None] = [None]

    def counting(name, method):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if inside[0] and caller.startswith(PACKAGE):
                counts[(inside[0], name, Path(caller).name, sys._getframe(1).f_code.co_name)] += 1
            return method(self, *args, **kwargs)
        return read

    def in_step(name, stage):
        def run(*args, **kwargs):
            inside[0] = name
            try:
                return stage(*args, **kwargs)
            finally:
                inside[0] = None
        return run

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for stage in STAGES:
        monkeypatch.setattr(ppo, stage, in_step(stage, getattr(ppo, stage)))
    return counts


def _reads_in_one_step(tmp_path, counts, make_tiny_causal_lm, tiny_tokenizer, **overrides) -> int:
    counts.clear()
    config = _config(tmp_path, output_dir=str(tmp_path / f"ppo{len(list(tmp_path.iterdir()))}"), max_steps=1,
                     per_device_batch_size=8, ppo_epochs=2, **overrides)
    ppo.train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    return sum(counts.values())


LAYOUTS = [dict(mini_batch_size=8), dict(mini_batch_size=4, gradient_accumulation_steps=2),
           dict(mini_batch_size=2, gradient_accumulation_steps=2)]  # 2, 8 and 16 pieces


@pytest.mark.parametrize("termination", ["fixed", "word"])
def test_reads_do_not_grow_with_mini_batches_or_pieces(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer,
                                                       termination):
    """Beyond one read per optimizer step (the finite-update guard's gradient norm, as a GradScaler's), a
    step's reads are a constant, whatever the number of mini-batches and pieces."""
    reads, guard_reads = [], []
    for layout in LAYOUTS:
        _reads_in_one_step(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer, termination=termination,
                           **layout)
        guard = sum(n for key, n in count_reads.items() if key[3] == "allows")  # FiniteUpdates.allows
        guard_reads.append(guard)
        reads.append(sum(count_reads.values()) - guard)
    optimizer_steps = [2 * 2 * 8 // layout["mini_batch_size"] for layout in LAYOUTS]  # epochs x models x mini-batches
    assert guard_reads == optimizer_steps
    assert reads[0] == reads[1] == reads[2], reads
    assert reads[0] <= 40, sorted(count_reads.items())  # boundary checks, host lengths, one metrics read
    update = {key: n for key, n in count_reads.items() if key[0] == "ppo_update" and key[3] != "allows"}
    assert not [key for key in update if key[2] in ("losses.py", "segments.py", "advantages.py")], update
    assert sum(update.values()) <= 16, update  # its boundary checks, segment counts, permutations


def test_the_count_sees_checks_inside_the_pieces(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer,
                                                 monkeypatch):
    """With the pieces' value checks back on, the reads grow with the pieces: the counter can fail."""
    monkeypatch.setattr(ppo, "trusted_inputs", contextlib.nullcontext)
    reads = [_reads_in_one_step(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer, **layout)
             for layout in LAYOUTS]
    assert reads[0] < reads[1] < reads[2], reads


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    """The pieces skip the value checks; NaN log-probs from the model give a NaN gradient norm, whose optimizer
    step the guard skips and counts. One is survived with finite weights; more than nonfinite_skip_limit in a
    row stop the run before anything is saved."""
    real = ppo.response_logprobs
    calls = []

    def first_piece_nan(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs) * (float("nan") if len(calls) == 1 else 1.0)

    monkeypatch.setattr(ppo, "response_logprobs", first_piece_nan)
    config = _config(tmp_path, max_steps=2, ppo_epochs=2, save_steps=1)
    policy = ppo.train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert [m["train/skipped_steps"] for m in read_metrics(config.output_dir)] == [1, 1]
    assert all(torch.isfinite(p).all() for p in policy.parameters())

    monkeypatch.setattr(ppo, "response_logprobs", lambda *args, **kwargs: real(*args, **kwargs) * float("nan"))
    config = _config(tmp_path, output_dir=str(tmp_path / "nan"), max_steps=2, ppo_epochs=2, save_steps=1)
    with pytest.raises(FloatingPointError, match="NaN or inf gradient norm"):
        ppo.train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    saved = list_checkpoints(config.output_dir)
    assert saved  # step 1 skipped 2 policy steps (limit 3) and was saved: with the weights it started with
    for checkpoint in saved:
        assert all(torch.isfinite(w).all() for w in load_file(checkpoint / "policy" / "model.safetensors").values())
    assert not (Path(config.output_dir) / "model.safetensors").exists()
