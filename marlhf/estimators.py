"""Advantage estimators behind one interface, like verl's `register_adv_est` (marlhf.plugins: the same seam as
the termination rules, policy losses and rollout engines).

An estimator turns one step's per-token rewards (KL penalty on every token, score on the last) into
per-token advantages and, when it trains a critic, returns:

    estimator.obj(batch: AdvantageBatch) -> (advantages [B, T], returns [B, T] or None)

Whether a critic is built and trained is the estimator's `needs_critic`, and the fewest responses per
prompt it works with its `min_samples_per_prompt`. Built in: `gae` (macro GAE over segments, the critic's
values; `ngram=1` is token-level GAE; its options are gamma and the lambda schedule), and the critic-free
sequence estimators `rloo`, `grpo`, `reinforce`, which give every token of a response the advantage of its
summed reward (score minus the KL penalty, as TRL's RLOO does). A new one, with options of its own:

    @dataclasses.dataclass
    class MyOptions:
        baseline: float = 0.0

    @register_estimator("my_est", needs_critic=False, options=MyOptions)
    def my_est(batch):
        totals = batch.gather_rows(batch.rewards.sum(dim=1))  # batch statistics span all processes
        ...  # batch.options.baseline; batch.config is the whole PPOConfig
        return advantages, None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.advantages import LamSchedule, SegmentReward, grpo, length_adaptive_lam, macro_gae, reinforce, rloo
from marlhf.plugins import Plugin, Registry
from marlhf.segments import num_segments

__all__ = ["AdvantageBatch", "ESTIMATORS", "register_estimator", "get_estimator", "GAEOptions"]


@dataclasses.dataclass(frozen=True)
class AdvantageBatch:
    """One step's rows on this process: rewards, values (None without a critic): float [B, T]; mask: bool
    [B, T]; segment_ids: long [B, T]; options: the estimator's own options (None if it declares none);
    gather_rows / own_rows: stack the rows of every process / take this process's rows back (identities in one
    process); config: the whole PPO config, read-only. The samples of one prompt are consecutive rows."""

    rewards: torch.Tensor
    values: torch.Tensor | None
    mask: torch.Tensor
    segment_ids: torch.Tensor
    options: Any
    gather_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    own_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    config: Any = None


Estimate = Callable[[AdvantageBatch], "tuple[torch.Tensor, torch.Tensor | None]"]
REGISTRY = Registry("advantage estimator", "advantage", needs_critic=True, min_samples_per_prompt=1)
ESTIMATORS: dict[str, Plugin] = REGISTRY.plugins


def register_estimator(name: str, *, needs_critic: bool, min_samples_per_prompt: int = 1,
                       options: type | None = None) -> Callable[[Estimate], Estimate]:
    """Decorator: register an estimator under `name` (an error if the name is taken), with its options dataclass."""
    return REGISTRY.register(name, options=options, needs_critic=needs_critic,
                             min_samples_per_prompt=min_samples_per_prompt)


def get_estimator(spec: str) -> Plugin:
    """The estimator registered as `spec`, or the one at the dotted path `package.module:function` (registered
    by importing its module; an unregistered function is taken to need a critic)."""
    return REGISTRY.get(spec)


# The built-in estimators' options are PPOConfig's flat options of the same names (marlhf.plugins).
@dataclasses.dataclass(frozen=True)
class GAEOptions:
    gamma: float = 1.0
    lam: float = 1.0
    lam_critic: float | None = None
    lam_schedule: LamSchedule = "constant"
    lam_alpha: float = 0.05
    segment_reward: SegmentReward = "sum"


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
    grpo_normalize_std: bool = True


@register_estimator("gae", needs_critic=True, options=GAEOptions)
def _gae(batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Macro GAE; the actor's lambda follows `lam_schedule` (constant `lam`, or VAPO's length-adaptive one over
    each row's macro actions), the critic's targets take `lam_critic` (none: `lam`), as VC-PPO decouples them."""
    o = batch.options

    def gae(lam):
        return macro_gae(batch.rewards, batch.values, batch.mask, batch.segment_ids, o.gamma, lam,
                         batch.config.value_weighting, o.segment_reward)

    actor_lam = (o.lam if o.lam_schedule == "constant"
                 else length_adaptive_lam(num_segments(batch.segment_ids), o.lam_alpha))
    critic_lam = o.lam if o.lam_critic is None else o.lam_critic
    advantages, returns = gae(actor_lam)
    if o.lam_schedule != "constant" or critic_lam != o.lam:
        returns = gae(critic_lam)[1]
    return advantages, returns


def _per_response(estimate: Callable[[torch.Tensor, AdvantageBatch], torch.Tensor]) -> Estimate:
    """A critic-free estimator from one that maps the summed rewards of all processes' rows [N] to [N]: every
    token of a response gets its response's advantage."""
    def fn(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
        all_advantages = estimate(batch.gather_rows(batch.rewards.sum(dim=1)), batch)
        return torch.where(batch.mask, batch.own_rows(all_advantages)[:, None], 0.0), None

    return fn


register_estimator("rloo", needs_critic=False, min_samples_per_prompt=2)(
    _per_response(lambda totals, b: rloo(totals, b.config.num_samples_per_prompt)))
register_estimator("grpo", needs_critic=False, min_samples_per_prompt=2, options=GRPOOptions)(
    _per_response(lambda totals, b: grpo(totals, b.config.num_samples_per_prompt,
                                         normalize_std=b.options.grpo_normalize_std)))
register_estimator("reinforce", needs_critic=False)(_per_response(lambda totals, b: reinforce(totals)))
