"""Losses of PPO / MA-PPO, reward modelling and DPO.

Each function returns ``(loss, stats)``: a 0-dim loss and a dict of detached 0-dim tensors (no
host sync here; the caller decides when to read them). Shapes follow :mod:`marlhf.segments`.

With ``segment_ids``, the PPO policy ratio of segment tau is its joint probability ratio
``exp(sum_{t in tau} (logprobs_t - old_logprobs_t))``; the clipped surrogate is computed once per
segment, weighted by the segment's token count and divided by the number of masked tokens, so
one token per segment is token-mean PPO exactly. A token's gradient is then |tau| times the token-level
one for the same advantage; ``segment_weighting`` offers the two alternatives ("uniform": the paper's
plain mean over segments; "geometric": GSPO's length-normalised ratio).

Multi-turn rows: ``mask`` is the action mask (gaps on observation tokens, ``segment_ids`` -1 there), so an
observation token has no ratio, no value target and no weight in any mean; with the turns as segments, the joint
ratio of a turn's action tokens is clipped once per turn (Turn-PPO's per-turn clipping).
"""

from __future__ import annotations

import math
import typing
from typing import Literal

import torch
import torch.nn.functional as F

from marlhf._checks import check_finite_vector, check_like, check_mask, check_segment_ids
from marlhf.segments import (ValueWeighting, masked_mean, num_segments, segment_lengths, segment_mean, segment_sum,
                             segment_values)

__all__ = ["policy_loss", "behaviour_weights", "loss_units", "check_loss_options", "value_loss", "bradley_terry_loss",
           "dpo_loss"]

SegmentWeighting = Literal["tokens", "uniform", "geometric"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]  # verl's loss_agg_mode names
RatioGranularity = Literal["macro", "token"]
StalenessCorrection = Literal["decoupled", "tis"]  # what weights a stale (off-policy) rollout's loss


def _aggregate(token_weighted: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, divisor: torch.Tensor) -> torch.Tensor:
    """Sum of a [B, S] tensor of per-unit losses already weighted by their token counts, aggregated as
    `loss_agg_mode`: token-mean divides by `divisor`; seq-mean-token-sum averages each response's sum over
    the responses with tokens; seq-mean-token-mean averages each response's token mean over them (the
    released runs: batch size 1 with accumulation)."""
    if loss_agg_mode == "token-mean":
        return token_weighted.sum() / divisor.clamp(min=1)
    rows = mask.any(dim=1)
    per_row = token_weighted.sum(dim=1)
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = per_row / mask.sum(dim=1).clamp(min=1)
    return torch.where(rows, per_row, 0.0).sum() / rows.sum().clamp(min=1)

# exp(20) ~ 4.9e8: a long segment's summed log-ratio is clamped before exp so it cannot overflow.
MAX_LOG_RATIO = 20.0


def _check_policy_loss_inputs(mask: torch.Tensor, clip: float, tis_cap: float | None,
                              **tensors: torch.Tensor | None) -> None:
    """policy_loss's tensors shaped like the mask, its clip and TIS cap valid, at most one off-policy correction."""
    check_mask(mask, gaps=True)
    for name in ("logprobs", "old_logprobs", "advantages"):
        check_like(tensors[name], mask, name)
    if not clip > 0:
        raise ValueError(f"`clip` must be > 0, got {clip}")
    if tis_cap is not None:
        if not tis_cap > 0:
            raise ValueError(f"`tis_cap` must be > 0, got {tis_cap}")
        if tensors["rollout_logprobs"] is None:
            raise ValueError("`tis_cap` needs the rollout engine's sampling log-probs (`rollout_logprobs`)")
        check_like(tensors["rollout_logprobs"], mask, "rollout_logprobs")
    if tensors["behaviour_logprobs"] is not None:
        if tis_cap is not None:
            raise ValueError("`tis_cap` and `behaviour_logprobs` are two corrections of one gap: give one")
        check_like(tensors["behaviour_logprobs"], mask, "behaviour_logprobs")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    clip: float = 0.2,
    ratio_granularity: RatioGranularity = "macro",
    segment_weighting: SegmentWeighting = "tokens",
    loss_agg_mode: LossAggregation = "token-mean",
    num_slots: int | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_cap: float | None = None,
    staleness_correction: StalenessCorrection = "decoupled",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate at token or macro-action granularity.

    Args:
        logprobs: float [B, T], current policy log-probs (with grad).
        old_logprobs: float [B, T], log-probs at rollout time.
        advantages: float [B, T]; with segments, constant within each segment (as macro_gae gives).
        mask: bool [B, T].
        segment_ids: long [B, T] or None (one token per segment). ``fixed_ngram(mask, None)``
            gives the whole-sequence update.
        clip: epsilon of the clipped ratio (> 0).
        ratio_granularity: "macro" clips each segment's joint ratio (the paper); "token" clips
            per-token ratios with the segment advantage copied to each token (the released code).
        segment_weighting: with macro ratios, "tokens" weighs each segment's surrogate by its token count
            and divides by the number of masked tokens; "uniform" takes the plain mean over segments (the
            paper's expectation); "geometric" uses the segment ratio exp(mean_t log-ratio), the geometric
            mean of its token ratios (GSPO's for sequences), weighted by token count, so a token's gradient
            at ratio 1 equals the token-level one. The divisor is :func:`loss_units`.
        loss_agg_mode: verl's names; "token-mean" (one mean over the batch's tokens), "seq-mean-token-mean"
            (each response's token mean, averaged over responses: the released runs) or "seq-mean-token-sum".
            The seq-mean modes need segment_weighting="tokens".
        num_slots: the largest number of segments of a row, when the caller knows it on the host (saves the
            device read of ``segment_ids.max()``).
        rollout_logprobs: float [B, T], the rollout engine's own log-probs of the drawn tokens, when they differ
            from ``old_logprobs`` (the trainer's recomputation; another kernel, another precision, or a lagging
            policy): with ``tis_cap``, truncated importance sampling (Yao et al. 2025) corrects the off-policy
            gap: each unit's clipped surrogate is weighted by min(exp(sum(old_logprobs - rollout_logprobs)),
            tis_cap), the sum over the unit's tokens (the segment's joint ratio, also with "geometric"). The
            weight carries no gradient.
        tis_cap: the cap C > 0 of those weights; None: off (and ``rollout_logprobs`` unused).
        behaviour_logprobs: float [B, T], the log-probs of the drawn tokens under the policy that sampled them
            when it lags the one the update starts from (bounded-staleness PPO: an older policy version, in a
            rollout worker). Then ``old_logprobs`` is the proximal policy (recomputed at the start of the update)
            that the ratio is clipped around, and each unit's clipped surrogate is weighted by
            :func:`behaviour_weights` of its behaviour ratio pi_prox / pi_behav (decoupled PPO, Hilton et al.
            2021). None: on-policy, no weight (and the two options below unused). Not with ``tis_cap``.
        behaviour_cap: the cap C > 0 of the behaviour ratio (None: none).
        staleness_correction: "decoupled" (units whose ratio exceeds C are dropped, as AReaL does) or "tis"
            (the ratio truncated at C, as ``tis_cap`` does).
    Returns:
        loss, stats with clipfrac, approxkl (k3 estimator), ratio_mean, ratio_max, all over
        segments (tokens when there are no segments).
    """
    _check_policy_loss_inputs(mask, clip, tis_cap, logprobs=logprobs, old_logprobs=old_logprobs,
                              advantages=advantages, rollout_logprobs=rollout_logprobs,
                              behaviour_logprobs=behaviour_logprobs)
    check_loss_options(loss_agg_mode, ratio_granularity, segment_weighting)

    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zeros)
    advantages = torch.where(mask, advantages, zeros)
    # truncated importance sampling: log(pi_old_trainer / pi_rollout) of each token, summed per unit below
    log_is = torch.where(mask, old_logprobs - rollout_logprobs, zeros).detach() if tis_cap is not None else None
    # bounded staleness: log(pi_prox / pi_behav) of each token, summed per unit below (a macro action's joint ratio)
    log_behaviour = (torch.where(mask, old_logprobs - behaviour_logprobs, zeros).detach()
                     if behaviour_logprobs is not None else None)
    if segment_ids is None or ratio_granularity == "token":
        units = mask  # every token is its own unit
        weights = mask.to(logprobs.dtype)
    else:
        check_segment_ids(segment_ids, mask, num_slots=num_slots)
        lengths = segment_lengths(segment_ids, num_slots)  # [B, S]
        weights, units = lengths.to(logprobs.dtype), lengths > 0
        log_ratio = segment_sum(log_ratio, segment_ids, lengths.shape[1])
        if log_is is not None:
            log_is = segment_sum(log_is, segment_ids, lengths.shape[1])
        if log_behaviour is not None:
            log_behaviour = segment_sum(log_behaviour, segment_ids, lengths.shape[1])
        advantages = segment_mean(advantages, segment_ids, lengths)
        if segment_weighting == "geometric":
            log_ratio = log_ratio / lengths.clamp(min=1)
        elif segment_weighting == "uniform":
            weights = units.to(logprobs.dtype)

    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    per_unit = torch.maximum(surrogate, clipped)
    if log_is is not None:
        tis_weight = torch.exp(log_is.clamp(-MAX_LOG_RATIO, math.log(tis_cap)))  # min(ratio, C), no overflow
        per_unit = per_unit * tis_weight
    if log_behaviour is not None:
        behaviour_weight = behaviour_weights(log_behaviour, units, behaviour_cap, staleness_correction)
        per_unit = per_unit * behaviour_weight
    loss = _aggregate(per_unit * weights, mask, loss_agg_mode,
                      loss_units(mask, segment_ids, segment_weighting, loss_agg_mode))

    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > surrogate).float(), units),
            "approxkl": masked_mean((ratio - 1.0) - log_ratio, units),
            "ratio_mean": masked_mean(ratio, units),
            "ratio_max": torch.where(units, ratio, torch.zeros_like(ratio)).max() if units.numel() else ratio.new_zeros(()),
        }
        if log_is is not None:
            stats["tis_weight_mean"] = masked_mean(tis_weight, units)
        if log_behaviour is not None:
            stats["behaviour_weight_mean"] = masked_mean(behaviour_weight, units)
            stats["behaviour_dropped"] = masked_mean((units & (behaviour_weight == 0)).float(), units)
    check_finite_vector(loss.detach().reshape(1), "loss (advantages too large: the surrogate overflows)")
    return loss, stats


def behaviour_weights(log_ratio: torch.Tensor, units: torch.Tensor, cap: float | None = None,
                      correction: StalenessCorrection = "decoupled") -> torch.Tensor:
    """The weights that make a stale rollout's PPO loss an estimate of the on-policy one (decoupled PPO).

    Each unit (a token, or a macro action: its tokens' log-ratios summed, the action's joint ratio) was drawn from
    the behaviour policy pi_behav, an older version than the proximal policy pi_prox that PPO clips around; its
    importance weight is w = pi_prox / pi_behav = exp(log_ratio). With a cap C: "decoupled" keeps w where w <= C
    and gives 0 above it (AReaL's decoupled loss: a unit the old policy made unlikely for the new one is left
    out, not counted at a truncated weight); "tis" gives min(w, C) (truncated importance sampling, Yao et al.
    2025: biased towards the behaviour policy above C, never dropping). No gradient flows through the weights.

    Args:
        log_ratio: float [B, S], log(pi_prox / pi_behav) of each unit (0 where ``units`` is False).
        units: bool [B, S], which entries are units (padding and empty segment slots: False).
        cap: C > 0, or None: no cap (plain importance weights, clamped only against overflow).
        correction: "decoupled" or "tis".
    Returns:
        float [B, S]: the weights, 0 where ``units`` is False.
    """
    if correction not in typing.get_args(StalenessCorrection):
        raise ValueError(f"`staleness_correction` must be one of {list(typing.get_args(StalenessCorrection))}, got "
                         f"{correction!r}")
    if cap is not None and not cap > 0:
        raise ValueError(f"`behaviour_cap` must be > 0, got {cap}")
    log_ratio = log_ratio.detach()
    upper = MAX_LOG_RATIO if cap is None else min(MAX_LOG_RATIO, math.log(cap))
    weights = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, upper if correction == "tis" else MAX_LOG_RATIO))
    if correction == "decoupled" and cap is not None:
        weights = torch.where(log_ratio <= math.log(cap), weights, 0.0)
    return torch.where(units, weights, 0.0)


def check_loss_options(loss_agg_mode: str, ratio_granularity: str = "macro", segment_weighting: str = "tokens") -> None:
    """The losses' options and the rules between them (PPOConfig checks a run's with this too)."""
    for name, value, alias in (("loss_agg_mode", loss_agg_mode, LossAggregation),
                               ("ratio_granularity", ratio_granularity, RatioGranularity),
                               ("segment_weighting", segment_weighting, SegmentWeighting)):
        if value not in typing.get_args(alias):
            raise ValueError(f"`{name}` must be one of {list(typing.get_args(alias))}, got {value!r}")
    if segment_weighting != "tokens" and ratio_granularity == "token":
        raise ValueError(f"segment_weighting={segment_weighting!r} needs ratio_granularity='macro'")
    if loss_agg_mode != "token-mean" and segment_weighting != "tokens":
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} needs segment_weighting='tokens'")


def loss_units(mask: torch.Tensor, segment_ids: torch.Tensor | None = None,
                      segment_weighting: SegmentWeighting = "tokens",
                      loss_agg_mode: LossAggregation = "token-mean") -> torch.Tensor:
    """What :func:`policy_loss` (and :func:`value_loss`, with the default weighting) averages over: the
    responses with tokens for the seq-mean modes, the number of segments with ``segment_weighting="uniform"``,
    else the number of masked tokens (0-dim long). A loss over several pieces of a batch is their sum, each
    weighted by its share of the batch's units."""
    if loss_agg_mode != "token-mean":
        return mask.any(dim=1).sum()
    if segment_weighting == "uniform" and segment_ids is not None:
        return num_segments(segment_ids).sum()
    return mask.sum()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    clip: float | None = None,
    value_weighting: ValueWeighting = "equal",
    loss_agg_mode: LossAggregation = "token-mean",
    num_slots: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``0.5 * max((V - Q)^2, (V_clipped - Q)^2)`` (unclipped when ``clip`` is None).

    ``value_weighting`` defaults to the paper's "equal"; PPO's trainer passes its own explicitly (PPOConfig's
    default "first": marlhf.advantages, Defaults).

    With segments, the predicted value of segment tau is the weighted sum of its token values
    (same weighting as in macro_gae) and is regressed to Q_tau; each segment is weighted by its
    token count and the sum divided by the number of masked tokens (``loss_agg_mode`` as in
    :func:`policy_loss`). Without segments (``segment_ids=None``) every token's value is regressed to its
    return: with returns constant within a segment, that is the released code's per-token critic loss.

    Args:
        values: float [B, T], current critic values (with grad).
        old_values: float [B, T], values at rollout time (for clipping).
        returns: float [B, T], GAE returns (constant within a segment).
        mask: bool [B, T]; segment_ids: long [B, T] or None.
        clip: value clip range around old values, or None.
        num_slots: as in :func:`policy_loss`.
    Returns:
        loss, stats with vf_clipfrac.
    """
    check_mask(mask, gaps=True)
    check_like(values, mask, "values")
    check_like(old_values, mask, "old_values")
    check_like(returns, mask, "returns")
    if clip is not None and not clip > 0:
        raise ValueError(f"`clip` must be > 0 or None, got {clip}")
    check_loss_options(loss_agg_mode)

    if segment_ids is None:
        units, weights = mask, mask.to(values.dtype)
        zeros = torch.zeros_like(values)
        values, old_values, returns = (torch.where(mask, x, zeros) for x in (values, old_values, returns))
    else:
        check_segment_ids(segment_ids, mask, num_slots=num_slots)
        lengths = segment_lengths(segment_ids, num_slots)
        weights, units = lengths.to(values.dtype), lengths > 0
        values = segment_values(values, segment_ids, value_weighting, lengths)
        old_values = segment_values(old_values, segment_ids, value_weighting, lengths)
        returns = segment_mean(returns, segment_ids, lengths)

    squared = (values - returns) ** 2
    if clip is None:
        per_unit = squared
        clipfrac = torch.zeros((), device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        squared_clipped = (clipped_values - returns) ** 2
        per_unit = torch.maximum(squared, squared_clipped)
        clipfrac = masked_mean((squared_clipped > squared).float(), units).detach()
    loss = 0.5 * _aggregate(per_unit * weights, mask, loss_agg_mode, mask.sum())
    check_finite_vector(loss.detach().reshape(1), "loss (values or returns too large: the squares overflow)")
    return loss, {"vf_clipfrac": clipfrac}


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model loss ``-log sigmoid(r_chosen - r_rejected)``, mean over pairs.

    Args:
        chosen_scores, rejected_scores: float [B].
    Returns:
        loss, stats with accuracy (chosen scored strictly higher) and margin (mean difference).
    """
    check_finite_vector(chosen_scores, "chosen_scores")
    check_finite_vector(rejected_scores, "rejected_scores")
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"`chosen_scores` {tuple(chosen_scores.shape)} and `rejected_scores` "
            f"{tuple(rejected_scores.shape)} must have the same shape"
        )
    margin = chosen_scores - rejected_scores
    loss = -F.logsigmoid(margin).mean()
    return loss, {"accuracy": (margin > 0).float().mean().detach(), "margin": margin.mean().detach()}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct Preference Optimization (Rafailov et al., 2023), with optional conservative label
    smoothing.

    Args:
        *_logps: float [B], summed response log-probs under the policy and the frozen reference.
        beta: inverse temperature (> 0). label_smoothing: in [0, 0.5).
    Returns:
        loss, stats with accuracy, chosen_reward, rejected_reward, margin (implicit rewards
        beta * (log pi - log pi_ref)).
    """
    names = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
    tensors = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    for name, x in zip(names, tensors):
        check_finite_vector(x, name)
        if x.shape != policy_chosen_logps.shape:
            raise ValueError(f"`{name}` has shape {tuple(x.shape)}, expected {tuple(policy_chosen_logps.shape)}")
    if not beta > 0:
        raise ValueError(f"`beta` must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {label_smoothing}")
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    logits = chosen_rewards - rejected_rewards
    loss = (-(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)).mean()
    stats = {
        "accuracy": (logits > 0).float().mean().detach(),
        "chosen_reward": chosen_rewards.mean().detach(),
        "rejected_reward": rejected_rewards.mean().detach(),
        "margin": logits.mean().detach(),
    }
    return loss, stats
