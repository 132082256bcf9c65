"""Advantage estimators behind one interface, like verl's `register_adv_est`.

An estimator turns one step's per-token rewards (KL penalty on every token, score on the last) into
per-token advantages and, when it trains a critic, returns:

    estimator.fn(batch: AdvantageBatch) -> (advantages [B, T], returns [B, T] or None)

Whether a critic is built and trained is the estimator's `needs_critic`, and the fewest responses per
prompt it works with its `min_samples_per_prompt`. Built in: `gae` (macro GAE over segments, the critic's
values; `ngram=1` is token-level GAE), and the critic-free sequence estimators `rloo`, `grpo`,
`reinforce`, which give every token of a response the advantage of its summed reward (score minus the KL
penalty, as TRL's RLOO does). A new one:

    @register_estimator("my_est", needs_critic=False)
    def my_est(batch):
        totals = batch.gather_rows(batch.rewards.sum(dim=1))  # batch statistics span all processes
        ...
        return advantages, None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.advantages import grpo, length_adaptive_lam, macro_gae, reinforce, rloo
from marlhf.segments import num_segments

__all__ = ["AdvantageBatch", "AdvantageEstimator", "ESTIMATORS", "register_estimator", "get_estimator"]


@dataclasses.dataclass(frozen=True)
class AdvantageBatch:
    """One step's rows on this process: rewards, values (None without a critic): float [B, T]; mask: bool
    [B, T]; segment_ids: long [B, T]; options: the PPO config; gather_rows / own_rows: stack the rows of
    every process / take this process's rows back (identities in one process). The samples of one prompt
    are consecutive rows."""

    rewards: torch.Tensor
    values: torch.Tensor | None
    mask: torch.Tensor
    segment_ids: torch.Tensor
    options: Any
    gather_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    own_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x


Estimate = Callable[[AdvantageBatch], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: Estimate
    needs_critic: bool
    min_samples_per_prompt: int = 1


ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_estimator(name: str, *, needs_critic: bool, min_samples_per_prompt: int = 1) -> Callable[[Estimate], Estimate]:
    """Decorator: register an estimator under `name` (an error if the name is taken)."""
    def decorate(fn: Estimate) -> Estimate:
        if name in ESTIMATORS and ESTIMATORS[name].fn is not fn:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_critic, min_samples_per_prompt)
        return fn

    return decorate


def get_estimator(name: str) -> AdvantageEstimator:
    if name not in ESTIMATORS:
        raise ValueError(f"advantage must be one of {sorted(ESTIMATORS)}, got {name!r}")
    return ESTIMATORS[name]


@register_estimator("gae", needs_critic=True)
def _gae(batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Macro GAE; the actor's lambda follows `lam_schedule` (constant `lam`, or VAPO's length-adaptive one over
    each row's macro actions), the critic's targets take `lam_critic` (none: `lam`), as VC-PPO decouples them."""
    o = batch.options

    def gae(lam):
        return macro_gae(batch.rewards, batch.values, batch.mask, batch.segment_ids, o.gamma, lam,
                         o.value_weighting, o.segment_reward)

    actor_lam = (o.lam if o.lam_schedule == "constant"
                 else length_adaptive_lam(num_segments(batch.segment_ids), o.lam_alpha))
    critic_lam = o.lam if o.lam_critic is None else o.lam_critic
    advantages, returns = gae(actor_lam)
    if o.lam_schedule != "constant" or critic_lam != o.lam:
        returns = gae(critic_lam)[1]
    return advantages, returns


def _sequence(estimate: Callable[[torch.Tensor, Any], torch.Tensor]) -> Estimate:
    """A critic-free estimator from one that maps the summed rewards of all processes' rows [N] to [N]."""
    def fn(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
        all_advantages = estimate(batch.gather_rows(batch.rewards.sum(dim=1)), batch.options)
        return torch.where(batch.mask, batch.own_rows(all_advantages)[:, None], 0.0), None

    return fn


register_estimator("rloo", needs_critic=False, min_samples_per_prompt=2)(
    _sequence(lambda totals, o: rloo(totals, o.num_samples_per_prompt)))
register_estimator("grpo", needs_critic=False, min_samples_per_prompt=2)(
    _sequence(lambda totals, o: grpo(totals, o.num_samples_per_prompt, normalize_std=o.grpo_normalize_std)))
register_estimator("reinforce", needs_critic=False)(_sequence(lambda totals, o: reinforce(totals)))
