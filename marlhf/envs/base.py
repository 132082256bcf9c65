"""The environment seam: the protocol a multi-turn environment keeps (`Env`), what an observation is, the registry,
and how a run makes one (`make_env`); the package docstring says how to write one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Union

from marlhf.plugins import Plugin, Registry

__all__ = ["Env", "Observation", "Message", "REGISTRY", "ENVS", "register_env", "get_env", "make_env",
           "check_observation", "clone_env"]

Message = Mapping[str, str]  # {"role": ..., "content": ...}
Observation = Union[str, list[Message]]  # what `reset` and `step` return: text, or chat messages


class Env:
    """A Gymnasium-shaped text environment, one episode at a time:

        reset(seed: int, task: Any) -> (observation, info)
        step(action_text: str) -> (observation, reward, terminated, truncated, info)

    An observation is text or a list of chat messages ({"role", "content"}); `reward` is this turn's reward (a
    number; 0 when the environment gives none until the end); `terminated`: the episode reached its end (an
    outcome); `truncated`: it was cut (a limit of the environment's own). `info` is a dict, logged by nobody.

    Subclassing `Env` is optional (the rollout calls `reset` and `step` only) but gives `clone()`: a new instance
    made with the same constructor arguments, reset with the same seed and task and stepped with the same actions.
    Replaying is the default because an environment that draws from a process-wide RNG (`random`, numpy's global
    state) cannot be deep-copied with its randomness; an environment whose state can be copied overrides `clone`.
    """

    _init_args: tuple[tuple[Any, ...], dict[str, Any]]
    _history: tuple[int, Any, list[str]] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Env:
        env = super().__new__(cls)
        env._init_args = (args, kwargs)  # what clone() builds its fresh instance from
        env._history = None
        return env

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "reset" in cls.__dict__:
            cls.reset = _recording_reset(cls.__dict__["reset"])
        if "step" in cls.__dict__:
            cls.step = _recording_step(cls.__dict__["step"])

    def reset(self, seed: int, task: Any = None) -> tuple[Observation, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must define reset(seed, task)")

    def step(self, action_text: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must define step(action_text)")

    def clone(self) -> Env:
        """A new environment in this one's state: by default a fresh instance replaying seed, task and actions."""
        fresh = type(self)(*self._init_args[0], **self._init_args[1])
        if self._history is not None:
            seed, task, actions = self._history
            fresh.reset(seed, task)
            for action in actions:
                fresh.step(action)
        return fresh


def _recording_reset(reset: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reset)
    def recorded(self: Env, seed: int, task: Any = None) -> Any:
        result = reset(self, seed, task)
        self._history = (seed, task, [])
        return result

    return recorded


def _recording_step(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def recorded(self: Env, action_text: str) -> Any:
        if self._history is None:
            raise RuntimeError(f"{type(self).__name__}.step was called before reset")
        if self.__dict__.get("_stepping"):  # a subclass's step calling its parent's: the outer call records
            return step(self, action_text)
        self._stepping = True
        try:
            result = step(self, action_text)
        finally:
            self._stepping = False
        self._history[2].append(action_text)
        return result

    return recorded


def clone_env(env: Any) -> Any:
    """`env.clone()`; a ValueError naming the environment when it has none (it neither subclasses `Env` nor
    defines `clone`)."""
    if not callable(getattr(env, "clone", None)):
        raise ValueError(f"environment {type(env).__name__} cannot be cloned: subclass marlhf.envs.Env (which replays "
                         "seed, task and actions) or define clone()")
    return env.clone()


def check_observation(observation: Any) -> str | None:
    """None when `observation` is text or a list of {"role", "content"} messages of strings, else what is wrong."""
    if isinstance(observation, str):
        return None
    if not isinstance(observation, list):
        return f"a {type(observation).__name__}"
    for message in observation:
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return f"a message {message!r:.60} without string 'role' and 'content'"
    return None


REGISTRY = Registry("environment", "env")
ENVS: dict[str, Plugin] = REGISTRY.plugins


def register_env(name: str, *, options: type | None = None) -> Callable[[Any], Any]:
    """Decorator: register the environment class (or factory) under `name`, with its options dataclass; a class
    with options is made as `cls(options)`, one without as `cls()`."""
    return REGISTRY.register(name, options=options)


def get_env(spec: str) -> Plugin:
    """The environment registered as `spec`, an environment of a library as `LIBRARY:ID` (marlhf.envs.libraries:
    `reasoning_gym:NAME`, `textarena:ID`, `skyrl_gym:ID`), or the class at `package.module:Class` or
    `path/to/file.py:Class`."""
    from marlhf.envs.libraries import library_plugin

    return library_plugin(spec) or REGISTRY.get(spec)


def make_env(spec: str | Plugin, options: Mapping[str, Any] | None = None) -> Any:
    """A new environment of the kind `spec` names, with its options read from `options` (a ValueError names an
    option it does not declare)."""
    plugin = get_env(spec) if isinstance(spec, str) else spec
    values = plugin.make_options(dict(options or {}))
    return plugin.obj() if values is None else plugin.obj(values)
