"""The fuzzer's inputs (tiny models, built once), offline Hub, and the stub that keeps runs from starting."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from marlhf import cli
from marlhf.modeling import ScalarHeadModel
from tests.fuzz.harness import Started


def pytest_generate_tests(metafunc):
    """A fuzz test that takes `fuzz_depth` runs `quick` by default and `full` under `-m slow` (tests/fuzz/__init__)."""
    if "fuzz_depth" in metafunc.fixturenames:
        metafunc.parametrize("fuzz_depth", ["quick", pytest.param("full", marks=pytest.mark.slow)])


@pytest.fixture(scope="session")
def fuzz_models(tmp_path_factory, tiny_model_dir, tiny_tokenizer) -> dict[str, Path]:
    """policy: the tiny Llama; reward: a ScalarHeadModel on it."""
    torch.manual_seed(5)
    reward = tmp_path_factory.mktemp("fuzz_rm")
    ScalarHeadModel.from_pretrained(tiny_model_dir).save_pretrained(reward)
    tiny_tokenizer.save_pretrained(reward)
    return {"policy": Path(tiny_model_dir), "reward": reward}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """A name that is not a local path is a Hub id: answered offline at once, never looked up."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    yield


@pytest.fixture
def no_runs(monkeypatch):
    """The trainers, evaluate and the demo refuse to start (an invalid option must stop before them)."""
    def started(*args, **kwargs):
        raise Started("a run started on an invalid input")

    # The demo's pipeline binds the trainers by name when it is first imported: imported under the patches below, it
    # would keep `started` for the rest of the process (a later demo test on the same xdist worker then fails).
    importlib.import_module("marlhf.demo.pipeline")
    for module, _, function, _ in cli.COMMANDS.values():
        monkeypatch.setattr(importlib.import_module(module), function, started)
    monkeypatch.setattr("marlhf.demo.pipeline.run_demo", started)
