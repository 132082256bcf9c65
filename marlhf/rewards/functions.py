"""Reward functions in TRL's convention, several at once, in place of a reward model.

    reward = RewardFunctions([correctness, brevity], weights=[1.0, 0.1])
    scores = reward(prompts, completions, **record_fields)   # the weighted sum per response
    reward.last_means                                       # {"correctness": mean, "brevity": mean} of the call

A function that takes keyword arguments is called as `fn(prompts, completions, **record_fields)`, TRL's GRPO
convention: every field of the responses' records other than the prompt, as a list with one entry per
response. A function of two arguments is called as `fn(prompts, completions)` (marlhf's form). From the
command line: `marlhf ppo --reward_fns my_pkg.rewards:correctness my_pkg.rewards:brevity --reward_weights 1
0.1`; PPO logs each function's mean as `rewards/<name>`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from marlhf.imports import import_function


def takes_record_fields(function: Callable) -> bool:
    """Whether `function` accepts keyword arguments beyond (prompts, completions): TRL's convention."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
    return any(p.kind is p.VAR_KEYWORD for p in parameters) or len(parameters) > 2


class RewardFunctions:
    """The weighted sum of several reward functions (weights default to 1), each one's mean kept for logging."""

    def __init__(self, functions: Sequence[Callable], weights: Sequence[float] | None = None) -> None:
        if not functions:
            raise ValueError("give at least one reward function")
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} reward_weights for {len(functions)} reward functions")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights must be finite, got {weights}")
        self.functions, self.weights = list(functions), weights
        self.names = _unique([getattr(f, "__name__", "reward") for f in functions])
        self._with_fields = [takes_record_fields(f) for f in functions]
        self.last_means: dict[str, float] = {}

    @classmethod
    def from_paths(cls, paths: Sequence[str], weights: Sequence[float] | None = None) -> RewardFunctions:
        return cls([import_function(path, "reward_fns") for path in paths], weights)

    def __call__(self, prompts: list[str], completions: list[str], **record_fields: list[Any]) -> list[float]:
        total = [0.0] * len(completions)
        for function, weight, name, with_fields in zip(self.functions, self.weights, self.names, self._with_fields):
            scores = function(prompts, completions, **record_fields) if with_fields else function(prompts, completions)
            scores = [float(s) for s in scores]
            if len(scores) != len(completions):
                raise ValueError(f"reward function {name!r} returned {len(scores)} scores for "
                                 f"{len(completions)} completions")
            if not all(math.isfinite(s) for s in scores):
                raise ValueError(f"reward function {name!r} returned NaN or inf")
            self.last_means[name] = sum(scores) / max(len(scores), 1)
            total = [t + weight * s for t, s in zip(total, scores)]
        return total


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique
