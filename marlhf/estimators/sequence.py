"""The critic-free sequence estimators `rloo`, `grpo` and `reinforce`: every token of a response gets the advantage
of its summed reward (score minus the KL penalty, as TRL's RLOO does), against a baseline over its group."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from marlhf.advantages import grpo, reinforce, rloo
from marlhf.config import option
from marlhf.estimators.base import AdvantageBatch, Estimate, register_estimator


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
    grpo_normalize_std: bool = option(True, "divide by the group's standard deviation")


def per_response(estimate: Callable[[torch.Tensor, AdvantageBatch], torch.Tensor]) -> Estimate:
    """A critic-free estimator from one that maps the summed rewards of all processes' rows [N] to [N]: every
    token of a response gets its response's advantage. A multi-turn episode (``mask`` the action mask) is one
    response: its outcome is its rewards summed over its action tokens, its advantage on its action tokens."""
    def fn(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
        totals = torch.where(batch.mask, batch.rewards, 0.0).sum(dim=1)
        all_advantages = estimate(batch.gather_rows(totals), batch)
        return torch.where(batch.mask, batch.own_rows(all_advantages)[:, None], 0.0), None

    return fn


register_estimator("rloo", needs_critic=False, min_samples_per_prompt=2)(
    per_response(lambda totals, b: rloo(totals, b.num_samples_per_prompt)))
register_estimator("grpo", needs_critic=False, min_samples_per_prompt=2, options=GRPOOptions)(
    per_response(lambda totals, b: grpo(totals, b.num_samples_per_prompt, normalize_std=b.options.grpo_normalize_std)))
register_estimator("reinforce", needs_critic=False)(per_response(lambda totals, b: reinforce(totals)))
