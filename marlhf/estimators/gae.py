"""`gae`: macro GAE over the segments with the critic's values (`ngram=1`: token-level GAE), with the actor's lambda
constant or length-adaptive (VAPO) and the critic's apart (VC-PPO)."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.advantages import LamSchedule, SegmentReward, length_adaptive_lam, macro_gae
from marlhf.estimators.base import AdvantageBatch, register_estimator
from marlhf.segments import num_segments


# PPOConfig's flat options of the same names (marlhf.plugins).
@dataclasses.dataclass(frozen=True)
class GAEOptions:
    gamma: float = 1.0
    lam: float = 1.0
    lam_critic: float | None = None
    lam_schedule: LamSchedule = "constant"
    lam_alpha: float = 0.05
    segment_reward: SegmentReward = "sum"


@register_estimator("gae", needs_critic=True, options=GAEOptions)
def gae(batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Macro GAE; the actor's lambda follows `lam_schedule` (constant `lam`, or VAPO's length-adaptive one over
    each row's macro actions), the critic's targets take `lam_critic` (none: `lam`), as VC-PPO decouples them."""
    o = batch.options

    def estimate(lam):
        return macro_gae(batch.rewards, batch.values, batch.mask, batch.segment_ids, o.gamma, lam,
                         batch.value_weighting, o.segment_reward)

    actor_lam = (o.lam if o.lam_schedule == "constant"
                 else length_adaptive_lam(num_segments(batch.segment_ids), o.lam_alpha))
    critic_lam = o.lam if o.lam_critic is None else o.lam_critic
    advantages, returns = estimate(actor_lam)
    if o.lam_schedule != "constant" or critic_lam != o.lam:
        returns = estimate(critic_lam)[1]
    return advantages, returns
