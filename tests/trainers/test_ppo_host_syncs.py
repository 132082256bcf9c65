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

import marlhf
import marlhf.trainers.ppo as ppo
from marlhf.checkpoint import list_checkpoints
from tests.trainers.test_ppo import RECORDS, _config, count_e

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
STAGES = ("make_experience", "macro_actions", "estimate_advantages", "ppo_update", "step_metrics")
PACKAGE = str(Path(marlhf.__file__).parent)


@pytest.fixture
def count_reads(monkeypatch):
    """Counter of reads per (stage, method, file, line), made by marlhf code inside the PPO step's stages."""
    counts: collections.Counter = collections.Counter()
    inside: list[str | None] = [None]

    def counting(name, method):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if inside[0] and caller.startswith(PACKAGE):
                counts[(inside[0], name, Path(caller).name, sys._getframe(1).f_lineno)] += 1
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
    reads = [_reads_in_one_step(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer, termination=termination,
                                **layout) for layout in LAYOUTS]
    assert reads[0] == reads[1] == reads[2], reads
    assert reads[0] <= 40, sorted(count_reads.items())  # boundary checks, host lengths, one metrics read
    update = {key: n for key, n in count_reads.items() if key[0] == "ppo_update"}
    assert not [key for key in update if key[2] in ("losses.py", "segments.py", "advantages.py")], update
    assert sum(update.values()) <= 16, update  # its boundary checks, segment counts, permutations, finiteness


def test_the_count_sees_checks_inside_the_pieces(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer,
                                                 monkeypatch):
    """With the pieces' value checks back on, the reads grow with the pieces: the counter can fail."""
    monkeypatch.setattr(ppo, "trusted_inputs", contextlib.nullcontext)
    reads = [_reads_in_one_step(tmp_path, count_reads, make_tiny_causal_lm, tiny_tokenizer, **layout)
             for layout in LAYOUTS]
    assert reads[0] < reads[1] < reads[2], reads


def test_a_non_finite_update_stops_before_saving(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    """The pieces skip the value checks, so NaN log-probs from the model are caught once after the update."""
    real = ppo.response_logprobs
    monkeypatch.setattr(ppo, "response_logprobs", lambda *args, **kwargs: real(*args, **kwargs) * float("nan"))
    config = _config(tmp_path, max_steps=2, ppo_epochs=2, save_steps=1)
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        ppo.train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert list_checkpoints(config.output_dir) == []
    assert not (Path(config.output_dir) / "model.safetensors").exists()
