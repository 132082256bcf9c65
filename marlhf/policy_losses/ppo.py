"""`ppo`: the clipped surrogate of :func:`marlhf.losses.policy_loss`, one joint ratio per macro action (or per
token), optionally weighted by truncated importance sampling against the engine's own log-probs, and with a stale
rollout (PPOConfig.max_staleness) by the behaviour weights of decoupled PPO (docs/async.md)."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.config import option
from marlhf.losses import (RatioGranularity, SegmentWeighting, StalenessCorrection, check_loss_options, loss_units,
                           policy_loss)
from marlhf.policy_losses.base import PolicyLossBatch, register_policy_loss


@dataclasses.dataclass(frozen=True)
class ClippedOptions:
    """The ppo policy loss's options (also PPOConfig's flat flags `--clip_range`, ...: marlhf.plugins)."""

    clip_range: float = option(0.2, "PPO clip range of the policy ratio", gt=0)
    ratio_granularity: RatioGranularity = option(
        "macro", "clip one joint ratio per macro action (paper) or per-token ratios (released code)")
    segment_weighting: SegmentWeighting = option(
        "tokens", "policy loss over macro actions: each weighted by its token count (tokens), a plain mean over "
                  "macro actions (uniform, the paper's expectation), or token-count weights on the geometric mean "
                  "of the token ratios (geometric, GSPO's length-normalised ratio)")
    tis_cap: float | None = option(
        None, "truncated importance sampling for an engine whose numerics differ from the trainer's: weight the "
              "ppo loss of each unit (token, or macro action with macro ratios) by min(pi_trainer / pi_rollout, "
              "tis_cap), the trainer's recomputed old probability over the engine's sampling one (a product over "
              "a macro action's tokens); none: off", gt=0)
    # bounded staleness (PPOConfig.max_staleness > 0): marlhf.losses.behaviour_weights
    staleness_correction: StalenessCorrection = option(
        "decoupled", "max_staleness > 0: weight each unit by pi_prox / pi_behav, dropping those above behaviour_cap "
                     "(decoupled PPO, AReaL) or truncating them to it (tis)")
    behaviour_cap: float | None = option(5.0, "max_staleness > 0: the cap of the behaviour ratio (none: none)", gt=0)

    def __post_init__(self) -> None:
        # the rule between its own options (the one with loss_agg_mode, the run's option, PPOConfig checks)
        check_loss_options("token-mean", self.ratio_granularity, self.segment_weighting)


def clipped_units(mask: torch.Tensor, segment_ids: torch.Tensor | None, options: ClippedOptions,
                  loss_agg_mode: str) -> torch.Tensor:
    """What the loss is a mean over: tokens, or macro actions weighted by `segment_weighting` (marlhf.losses)."""
    return loss_units(mask, segment_ids, options.segment_weighting, loss_agg_mode)


@register_policy_loss("ppo", options=ClippedOptions, units=clipped_units)
def clipped(batch: PolicyLossBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    o = batch.options
    return policy_loss(batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask, batch.segment_ids,
                       o.clip_range, o.ratio_granularity, o.segment_weighting, batch.loss_agg_mode, batch.num_slots,
                       batch.rollout_logprobs, o.tis_cap, batch.behaviour_logprobs, o.behaviour_cap,
                       o.staleness_correction)
