"""`entropy_weighted`: GTPO's token-level entropy weighting of the group-relative reward (Dynamic Entropy Weighting,
arXiv 2508.04349), GRPO-S with `level: sequence`. Critic-free. It reads the sampling policy's entropy at each token
(`reads_entropy`), which PPO takes from the forward that gives the ratio's denominator."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.advantages import EntropyLevel, entropy_weighted as entropy_weighted_advantages
from marlhf.config import option
from marlhf.estimators.base import AdvantageBatch, register_estimator


@dataclasses.dataclass(frozen=True)
class EntropyWeightedOptions:
    level: EntropyLevel = option("token", "token: GTPO, per-token entropy shares; sequence: GRPO-S, mean entropy "
                                          "per response")
    alpha1: float = option(1.0, "weight of the outcome in the shaped reward (the paper: 1)", ge=0)
    alpha2: float = option(0.1, "weight of the entropy share in the shaped reward (the paper: 0.1)", ge=0)
    success_threshold: float = option(0.5, "a response whose summed reward is above it is a success")


@register_estimator("entropy_weighted", needs_critic=False, min_samples_per_prompt=2,
                    options=EntropyWeightedOptions, reads_entropy=True)
def entropy_weighted(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
    """GTPO / GRPO-S (marlhf.advantages.entropy_weighted) over all processes' rows, from the sampling policy's
    entropy at each token. A response's outcome is its summed reward, score minus the KL penalty, as `grpo`'s
    (`rewards.sum(1)`)."""
    if batch.entropy is None:
        raise ValueError("advantage 'entropy_weighted' needs the sampling policy's entropy (AdvantageBatch.entropy)")
    o = batch.options
    totals = batch.gather_rows(batch.rewards.sum(dim=1))
    mask, entropy = batch.gather_rows(batch.mask), batch.gather_rows(batch.entropy)
    advantages = entropy_weighted_advantages(totals, entropy, mask, batch.num_samples_per_prompt, o.level, o.alpha1,
                                             o.alpha2, o.success_threshold)
    return batch.own_rows(advantages), None
