"""SkyRL-Gym's environments: `skyrl_gym:ID` (docs/envs.md#skyrl-gym).

SkyRL-Gym environments speak chat messages and reward every turn: `init(prompt)` returns the first messages and
`step(action)` the next ones (tool output, a follow-up question), the turn's reward and `done`. The task of an
episode is a record of a SkyRL dataset, `{"prompt": [messages], "env_class": ..., "reward_spec": {"ground_truth":
...}, "extra_info": {...}}`: the environment is made per episode from the record's fields other than the prompt
and env_class (SkyRL's `extras`), and its first observation is the record's prompt (its "messages" once read_tasks has
read it). `done` ends the episode
terminated (SkyRL-Gym does not tell a limit of its own from an outcome).

    env = make_env("skyrl_gym:gsm8k_multi_turn")
    messages, info = env.reset(seed, task=record)    # record: one row of a SkyRL dataset (read_tasks)
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from marlhf.config import option
from marlhf.envs.base import Env
from marlhf.envs.libraries import require
from marlhf.errors import MarlhfError, did_you_mean
from marlhf.plugins import Plugin

__all__ = ["SkyRLGymOptions", "SkyRLGymEnv", "plugin", "available", "problems", "read_tasks"]

# What an environment needs that is not here, by id (the others run offline: their reward is computed locally).
NEEDS = {
    "search": "needs a network: a retrieval server at env_config.search_url (default http://127.0.0.1:8000/retrieve)",
    "searchcode": "needs a network: a retrieval server for its search tool",
    "text2sql": "needs files: the SQLite databases under env_config.db_path (default /home/ray/default/sql_data)",
}


@dataclasses.dataclass(frozen=True)
class SkyRLGymOptions:
    """How a SkyRL-Gym environment is made."""

    env_config: dict[str, Any] | None = option(
        None, "the environment's env_config (e.g. '{search_url: http://127.0.0.1:8000/retrieve}')")
    allow_network: bool = option(False, "run an environment that needs a network or a server (refused by default)")


def available() -> list[str]:
    """The installed library's environment ids."""
    return sorted(require("skyrl_gym").registry)


def problems(env_id: str) -> tuple[str, ...]:
    """What the environment needs that is not here, one phrase each (empty: it runs offline)."""
    return (NEEDS[env_id],) if env_id in NEEDS else ()


def read_tasks(path: str | Path, *, seed: int = 0, max_samples: int | None = None) -> list[dict[str, Any]]:
    """The records of a SkyRL dataset file (.jsonl or .parquet), each an episode's task (`max_samples` of them
    drawn with `seed`, as marlhf.data.load_records draws). A chat prompt moves to "messages", what the episode
    starts from, and "prompt" becomes its messages' text: the trainers read a record's prompt as text (its length,
    the logs), never the environment's first observation."""
    from marlhf.data.records import read_rows, subsample

    rows = subsample(read_rows(path), max_samples, seed)
    return [{**row, "prompt": "\n".join(m["content"] for m in _messages(row["prompt"], str(path))),
             "messages": row["prompt"]} if isinstance(row.get("prompt"), (list, tuple)) else row for row in rows]


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise ValueError(f"{where}: a task's 'prompt' must be text or a list of chat messages, got {prompt!r:.60}")


class SkyRLGymEnv(Env):
    """A SkyRL-Gym environment, made anew from each episode's task record."""

    def __init__(self, env_id: str, options: SkyRLGymOptions | None = None) -> None:
        self.env_id, self.options = env_id, options or SkyRLGymOptions()
        if problems(env_id) and not self.options.allow_network:
            raise MarlhfError(f"skyrl_gym:{env_id} cannot run offline: {problems(env_id)[0]}; set the option "
                              f"allow_network: true when it is there")
        self.env: Any = None

    def reset(self, seed: int, task: Any = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        where = f"skyrl_gym:{self.env_id}"
        if not isinstance(task, dict) or "prompt" not in task:
            raise ValueError(f"{where}: an episode's task must be a record of a SkyRL dataset with a 'prompt' (and "
                             f"its reward_spec, extra_info), got {task!r:.60}")
        from omegaconf import OmegaConf

        skyrl_gym = require("skyrl_gym")
        extras = {key: value for key, value in task.items() if key not in ("prompt", "messages", "env_class")}
        try:
            self.env = skyrl_gym.make(self.env_id, env_config=OmegaConf.create(self.options.env_config or {}),
                                      extras=extras)
        except AssertionError as error:  # SkyRL-Gym checks a record's fields with asserts
            raise ValueError(f"{where}: the task record is refused: {error}") from None
        observation, info = self.env.init(_messages(task.get("messages", task["prompt"]), where))
        return _messages(observation, where), dict(info or {})

    def step(self, action_text: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        if self.env is None:
            raise RuntimeError("SkyRLGymEnv.step was called before reset")
        out = self.env.step(action_text)
        done = bool(out["done"])
        if done:
            self.env.close()
        return (_messages(out["observations"] or [], f"skyrl_gym:{self.env_id}"), float(out["reward"]), done, False,
                dict(out.get("metadata") or {}))


def plugin(env_id: str) -> Plugin:
    """The environment plug-in of `skyrl_gym:ID` (made as `SkyRLGymEnv(ID, options)`)."""
    names = available()
    if env_id not in names:
        raise ValueError(f"skyrl_gym has no environment {env_id!r}{did_you_mean(env_id, names)}; `marlhf envs` "
                         f"lists them")
    return Plugin("environment", f"skyrl_gym:{env_id}", functools.partial(SkyRLGymEnv, env_id), SkyRLGymOptions, {})
