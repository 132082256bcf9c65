"""The advantage-estimator seam: what an estimator sees (`AdvantageBatch`) and its registry; the package docstring
says how to write one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from marlhf.plugins import Plugin, Registry
from marlhf.segments import ValueWeighting

__all__ = ["AdvantageBatch", "ContinueAndScore", "Estimate", "REGISTRY", "ESTIMATORS", "register_estimator",
           "get_estimator"]


class ContinueAndScore(Protocol):
    """The trainer's `continue_and_score(rows, prefix_lengths, k) -> scores`: for each n, `k` continuations of row
    `rows[n]`'s prompt and its first `prefix_lengths[n]` response tokens, sampled by the run's rollout engine (all
    in one call, each continuation from its own seed keyed by the run's seed, the step, its row, the prefix length
    and its sample index) up to the run's response length, and the final score of each full response (prefix +
    continuation), as the run scores its responses (reward model or reward functions, clipped to rm_score_clip).
    rows, prefix_lengths: long [N] (this process's rows); returns float [N, k]."""

    def __call__(self, rows: torch.Tensor, prefix_lengths: torch.Tensor, k: int) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class AdvantageBatch:
    """One step's rows on this process: rewards, values (None without a critic): float [B, T]; mask: bool
    [B, T]; segment_ids: long [B, T]; options: the estimator's own options (None if it declares none);
    num_samples_per_prompt: the group size, the samples of one prompt being consecutive rows (over all processes'
    rows, which gather_rows stacks); value_weighting: how a macro action's value is read from its tokens' values
    (marlhf.segments), the same for the critic's loss; gather_rows / own_rows: stack the rows of every process /
    take this process's rows back (identities in one process); response_ids: long [B, T], the sampled tokens (None
    when the caller has none); entropy: float [B, T], the entropy of the sampling policy's distribution at each
    token, from the forward that gives the PPO ratio's denominator (None unless the estimator is registered with
    ``reads_entropy=True``); continue_and_score: Monte-Carlo continuations of response prefixes and their scores
    (ContinueAndScore; None outside a trainer); turn_ids: long [B, T], for multi-turn episodes (one a row; ``mask``
    is then the action mask, False on observation tokens) the 0-based policy turn of each action token, -1 on
    observations and padding (None for single-turn rows); turn_state_ids: long [B, K], an id of the environment's
    state before turn k (equal ids: identical states, GiGPO's anchor states), -1 past an episode's turns (None
    unless the rows are multi-turn)."""

    rewards: torch.Tensor
    values: torch.Tensor | None
    mask: torch.Tensor
    segment_ids: torch.Tensor
    options: Any
    num_samples_per_prompt: int
    value_weighting: ValueWeighting
    gather_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    own_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    response_ids: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    continue_and_score: ContinueAndScore | None = None
    turn_ids: torch.Tensor | None = None
    turn_state_ids: torch.Tensor | None = None


Estimate = Callable[[AdvantageBatch], "tuple[torch.Tensor, torch.Tensor | None]"]
REGISTRY = Registry("advantage estimator", "advantage", needs_critic=True, min_samples_per_prompt=1,
                    reads_entropy=False)
ESTIMATORS: dict[str, Plugin] = REGISTRY.plugins


def register_estimator(name: str, *, needs_critic: bool, min_samples_per_prompt: int = 1,
                       options: type | None = None, reads_entropy: bool = False) -> Callable[[Estimate], Estimate]:
    """Decorator: register an estimator under `name` (an error if the name is taken), with its options dataclass.
    `reads_entropy=True` asks PPO for `batch.entropy`, which costs a vocabulary-wide sum per token; without it
    `batch.entropy` is None."""
    return REGISTRY.register(name, options=options, needs_critic=needs_critic,
                             min_samples_per_prompt=min_samples_per_prompt, reads_entropy=reads_entropy)


def get_estimator(spec: str) -> Plugin:
    """The estimator registered as `spec`, or the one at the dotted path `package.module:function` (registered
    by importing its module; an unregistered function is taken to need a critic)."""
    return REGISTRY.get(spec)

