"""The policy-loss seam: what a loss sees (`PolicyLossBatch`) and its registry; the package docstring says how to
write one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.losses import LossAggregation, loss_units
from marlhf.plugins import Plugin, Registry

__all__ = ["PolicyLossBatch", "REGISTRY", "POLICY_LOSSES", "register_policy_loss"]


@dataclasses.dataclass(frozen=True)
class PolicyLossBatch:
    """One piece of an update: logprobs (with gradients), old_logprobs (the rollout's), advantages: float [B, T];
    mask: bool [B, T]; segment_ids: long [B, T]; loss_agg_mode: PPOConfig's; num_slots: the largest number of
    segments of a row (known on the host); options: the loss's own options; rollout_logprobs: the engine's own
    sampling log-probs when the run keeps them (PPOConfig.compares_rollout_logprobs), else None;
    behaviour_logprobs: with a stale rollout (PPOConfig.max_staleness > 0) the log-probs of the policy version that
    sampled it (the rollout worker's), `old_logprobs` being the proximal policy's; else None (on-policy)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    segment_ids: torch.Tensor
    loss_agg_mode: LossAggregation
    num_slots: int | None
    options: Any
    rollout_logprobs: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None


def _token_units(mask: torch.Tensor, segment_ids: torch.Tensor | None, options: Any,
                 loss_agg_mode: str) -> torch.Tensor:
    return loss_units(mask, None, "tokens", loss_agg_mode)


REGISTRY = Registry("policy loss", "policy_loss", units=_token_units)
POLICY_LOSSES: dict[str, Plugin] = REGISTRY.plugins


def register_policy_loss(name: str, *, options: type | None = None,
                         units: Callable | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register a policy loss under `name`, with its options dataclass and its `units` (default:
    tokens)."""
    return REGISTRY.register(name, options=options, **({"units": units} if units is not None else {}))
