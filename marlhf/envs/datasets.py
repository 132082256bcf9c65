"""The datasets the environment libraries make or read themselves, for the commands that read a `--dataset`: the
trainers (a SkyRL dataset is the tasks of `marlhf ppo --env skyrl_gym:ID`) and `marlhf evaluate`. The adapters
import their library only when one of its datasets is read."""

from __future__ import annotations

from typing import Any

from marlhf.envs.libraries import library_of
from marlhf.envs.reasoning_gym import load_generated
from marlhf.envs.skyrl_gym import read_tasks

__all__ = ["library_records"]


def library_records(dataset: str, stage: str, *, env: str | None, seed: int,
                    max_samples: int | None = None) -> list[dict[str, Any]] | None:
    """The records of a dataset that a library makes or reads itself: `reasoning_gym:SPEC` (generated offline), or,
    when `env` is a SkyRL-Gym environment, a SkyRL dataset file (prompts of chat messages, which marlhf.data's
    readers refuse); None for any other dataset, which marlhf.data.load_records reads."""
    if dataset.startswith("reasoning_gym:"):
        return load_generated(dataset, stage, seed=seed, max_samples=max_samples)
    if env is not None and library_of(env) == "skyrl_gym":
        return read_tasks(dataset, seed=seed, max_samples=max_samples)
    return None
