"""`gae`: macro GAE over the segments with the critic's values (`ngram=1`: token-level GAE), with the actor's lambda
constant or length-adaptive (VAPO) and the critic's apart (VC-PPO). On multi-turn rows it runs over the action tokens
(observations skipped, as verl does); with the `turn` termination and `value_weighting: first` it is Turn-PPO's GAE
over turns, gamma per turn (`discount: segment`) or per action token (`discount: token`)."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.advantages import Discount, LamSchedule, SegmentReward, length_adaptive_lam, macro_gae
from marlhf.config import option
from marlhf.estimators.base import AdvantageBatch, register_estimator
from marlhf.segments import num_segments


@dataclasses.dataclass(frozen=True)
class GAEOptions:
    """The gae estimator's options (also PPOConfig's flat flags `--gamma`, `--lam`, ...: marlhf.plugins). Why `lam`
    defaults to 1 and not the paper's 0.95: docs/configuration.md#why-the-defaults."""

    gamma: float = option(1.0, "discount over macro actions", ge=0, le=1)
    lam: float = option(1.0, "GAE lambda over macro actions", ge=0, le=1)
    lam_critic: float | None = option(
        None, "GAE lambda of the critic's targets, apart from the actor's advantages (VC-PPO's decoupled GAE uses 1); "
              "over macro actions like lam: the segment values' regression targets (none: lam)", ge=0, le=1)
    lam_schedule: LamSchedule = option(
        "constant", "the actor's GAE lambda: lam for every response (constant), or VAPO's 1 - 1 / (lam_alpha * l) "
                    "for a response of l macro actions (l tokens at ngram 1; clamped to [0, 1]; the critic's "
                    "targets keep lam_critic, or lam)")
    lam_alpha: float = option(0.05, "length_adaptive: alpha (VAPO: 0.05)", gt=0)
    segment_reward: SegmentReward = option(
        "sum", "reward of a macro action: sum of its token rewards (paper), their mean (released code with equal "
               "values), or weighted like its value (released code: value_weighting's weights)")
    discount: Discount = option(
        "segment", "what gamma discounts: one step per macro action (segment; per turn with the turn termination, "
                   "Turn-PPO) or each action token (token: gamma^n over a macro action of n action tokens, its "
                   "rewards discounted inside it; needs segment_reward sum)")

    def __post_init__(self) -> None:
        if self.discount == "token" and self.segment_reward != "sum":
            raise ValueError(f"advantage estimator 'gae' option 'discount' token needs segment_reward 'sum', got "
                             f"{self.segment_reward!r}")


@register_estimator("gae", needs_critic=True, options=GAEOptions)
def gae(batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Macro GAE; the actor's lambda follows `lam_schedule` (constant `lam`, or VAPO's length-adaptive one over
    each row's macro actions), the critic's targets take `lam_critic` (none: `lam`), as VC-PPO decouples them."""
    o = batch.options

    def estimate(lam):
        return macro_gae(batch.rewards, batch.values, batch.mask, batch.segment_ids, o.gamma, lam,
                         batch.value_weighting, o.segment_reward, o.discount)

    actor_lam = (o.lam if o.lam_schedule == "constant"
                 else length_adaptive_lam(num_segments(batch.segment_ids), o.lam_alpha))
    critic_lam = o.lam if o.lam_critic is None else o.lam_critic
    advantages, returns = estimate(actor_lam)
    if o.lam_schedule != "constant" or critic_lam != o.lam:
        returns = estimate(critic_lam)[1]
    return advantages, returns
