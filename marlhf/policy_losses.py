"""Policy losses behind one interface (marlhf.plugins: the same seam as the termination rules, advantage
estimators and rollout engines).

A policy loss maps one piece of a PPO update to ``(loss, stats)``:

    loss.obj(batch: PolicyLossBatch) -> (0-dim loss, {name: 0-dim tensor})

PPO logs `loss/policy` and, when the stats have them, `policy/clipfrac` and `policy/approxkl`. Its `units`
trait says what the loss is a mean over, `units(mask, segment_ids, options, loss_agg_mode) -> 0-dim tensor`,
so that pieces of one mini-batch add up to one mean (default: tokens, or responses with a seq-mean
`loss_agg_mode`). Built in: `ppo`, the clipped surrogate of :func:`marlhf.losses.policy_loss` (one joint ratio
per macro action; its options are PPOConfig's clip_range, ratio_granularity and segment_weighting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.losses import RatioGranularity, SegmentWeighting, loss_units, policy_loss
from marlhf.plugins import Plugin, Registry

__all__ = ["PolicyLossBatch", "POLICY_LOSSES", "register_policy_loss", "get_policy_loss", "ClippedOptions"]


@dataclasses.dataclass(frozen=True)
class PolicyLossBatch:
    """One piece of an update: logprobs (with gradients), old_logprobs (the rollout's), advantages: float [B, T];
    mask: bool [B, T]; segment_ids: long [B, T]; loss_agg_mode: PPOConfig's; num_slots: the largest number of
    segments of a row (known on the host); options: the loss's own options; config: the whole PPO config; rollout_logprobs: the engine's own
    sampling log-probs when the run keeps them (PPOConfig.compares_rollout_logprobs), else None."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    segment_ids: torch.Tensor
    loss_agg_mode: str
    num_slots: int | None
    options: Any
    config: Any = None
    rollout_logprobs: torch.Tensor | None = None


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


def get_policy_loss(spec: str) -> Plugin:
    """The loss registered as `spec`, or the one at the dotted path `package.module:function`."""
    return REGISTRY.get(spec)


@dataclasses.dataclass(frozen=True)
class ClippedOptions:
    clip_range: float = 0.2
    ratio_granularity: RatioGranularity = "macro"
    segment_weighting: SegmentWeighting = "tokens"
    tis_cap: float | None = None


def _clipped_units(mask: torch.Tensor, segment_ids: torch.Tensor | None, options: ClippedOptions,
                   loss_agg_mode: str) -> torch.Tensor:
    return loss_units(mask, segment_ids, options.segment_weighting, loss_agg_mode)


@register_policy_loss("ppo", options=ClippedOptions, units=_clipped_units)
def _clipped(batch: PolicyLossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    o = batch.options
    return policy_loss(batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask, batch.segment_ids,
                       o.clip_range, o.ratio_granularity, o.segment_weighting, batch.loss_agg_mode, batch.num_slots,
                       batch.rollout_logprobs, o.tis_cap)
