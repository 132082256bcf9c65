"""Rewards, values and advantages at token and macro-action level.

Shapes follow :mod:`marlhf.segments`: ``[B, T]`` over response tokens, right-padded, ``mask``
bool. For row b with segments tau = 0..m-1 (docs/algorithm.md):

    R_tau = sum_{t in tau} r_t                      (segment_reward="sum"; "mean" divides by |tau|)
    V_tau = sum_i sigma_i V_{t_tau + i}             (value_weighting: "equal" | "unit" | "position" | "first")
    delta_tau = R_tau + gamma V_{tau+1} - V_tau,    V_m = 0
    A_tau = sum_l (gamma lam)^l delta_{tau+l},      Q_tau = A_tau + V_tau

and every token of segment tau carries A_tau and Q_tau. Sequence-level estimators (rloo, grpo,
reinforce) give one advantage per sample for the critic-free baselines.

Lambda may differ per row (a float tensor [B]): :func:`length_adaptive_lam` gives VAPO's
lam = 1 - 1 / (alpha * l) for a row of l actions, and PPO can take the critic's targets with another
lambda than the actor's advantages (VC-PPO's decoupled GAE; `lam_critic` in PPOConfig).

Macro GAE is token GAE with a lambda schedule. With `value_weighting="first"` and gamma = 1, a
segment's value is V_{t_tau}, the value of its first token's state, so its TD error telescopes:

    delta_tau = sum_{t in tau} r_t + V_{t_{tau+1}} - V_{t_tau} = sum_{t in tau} (r_t + V_{t+1} - V_t),

the sum of the token TD errors of its tokens. Hence A_tau = sum_{t in tau} delta_t + lam A_{tau+1} is
the token-level GAE A_t = delta_t + lam_{t+1} A_{t+1} at the segment's first token, under the per-token
lambda schedule lam_{t+1} = 1 inside a segment and lam where segment tau+1 starts. Its effective
per-token lambda is about lam ** (1 / n) for n-token segments (0.95 ** 0.2 = 0.990 at n = 5: a horizon
of ~100 tokens instead of ~20); the segment's other tokens carry the same A_tau, i.e. measured against
the baseline V(segment start) rather than their own state. At lam = 1 both are the Monte Carlo return
minus V_{t_tau}. tests/test_advantages.py checks the identity on random ragged batches.
"""

from __future__ import annotations

from typing import Literal

import torch

from marlhf._checks import check_finite_vector, check_like, check_mask, check_segment_ids
from marlhf.segments import (
    ValueWeighting,
    broadcast_segments,
    masked_mean,
    segment_lengths,
    segment_mean,
    segment_sum,
    segment_values,
)

SegmentReward = Literal["sum", "mean", "weighted"]
LamSchedule = Literal["constant", "length_adaptive"]  # the actor's lambda in PPO (marlhf.estimators.gae.GAEOptions)

__all__ = [
    "kl_penalized_rewards",
    "length_adaptive_lam",
    "token_gae",
    "macro_gae",
    "discounted_reverse_cumsum",
    "rloo",
    "grpo",
    "reinforce",
    "whiten",
]


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * (logprobs - ref_logprobs)`` on every response token (the k1
    KL estimator) plus the sequence score on each row's last real token.

    Args:
        scores: float [B], reward-model (or task) score of each response.
        logprobs, ref_logprobs: float [B, T], policy and reference log-probs of the sampled tokens.
        mask: bool [B, T].
        kl_coef: KL penalty coefficient (>= 0).
    Returns:
        rewards: float [B, T], 0 on padding. A row with no response token gets no score.
    """
    check_mask(mask)
    check_like(logprobs, mask, "logprobs")
    check_like(ref_logprobs, mask, "ref_logprobs")
    check_finite_vector(scores, "scores")
    if scores.shape[0] != mask.shape[0]:
        raise ValueError(f"`scores` has {scores.shape[0]} rows but `mask` has {mask.shape[0]}")
    if not kl_coef >= 0 or kl_coef == float("inf"):  # NaN fails the comparison
        raise ValueError(f"`kl_coef` must be a finite number >= 0, got {kl_coef}")
    rewards = torch.where(mask, -kl_coef * (logprobs - ref_logprobs), torch.zeros_like(logprobs))
    lengths = mask.sum(dim=1)
    last = (lengths - 1).clamp(min=0)[:, None]
    score = torch.where(lengths > 0, scores.to(rewards.dtype), 0.0)[:, None]
    return rewards.scatter_add(1, last, score)


def discounted_reverse_cumsum(x: torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """``y_t = sum_{l >= t} discount^(l - t) x_l`` along the last dim, without a Python loop.

    ``discount``: a float, or a float tensor [B] with one discount per row of ``x`` [B, S]. A reverse
    cumsum when the discount is the float 1, else a matmul with the [S, S] matrix of discount powers
    ([B, S, S] for per-row discounts; exact powers, no rescaling that could overflow for long rows).
    """
    if not isinstance(discount, torch.Tensor):
        if discount == 1.0:
            return x.flip(-1).cumsum(-1).flip(-1)
        discount = torch.tensor(discount, dtype=x.dtype, device=x.device)
        per_row = False
    else:
        discount, per_row = discount.to(x.dtype)[:, None, None], True
    steps = x.shape[-1]
    offsets = torch.arange(steps, device=x.device)
    lag = offsets[None, :] - offsets[:, None]  # lag[t, l] = l - t
    powers = torch.where(lag >= 0, discount ** lag.clamp(min=0).to(x.dtype), torch.zeros((), dtype=x.dtype,
                                                                                         device=x.device))
    if per_row:  # powers [B, S, S]
        return (powers @ x[..., None])[..., 0]
    return x @ powers.T


def _check_gae_args(rewards, values, mask, gamma, lam) -> None:
    check_mask(mask)
    check_like(rewards, mask, "rewards")
    check_like(values, mask, "values")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"`gamma` must be in [0, 1], got {gamma}")
    if isinstance(lam, torch.Tensor):
        if lam.shape != mask.shape[:1]:
            raise ValueError(f"a per-row `lam` must have shape [B] = {list(mask.shape[:1])}, got {list(lam.shape)}")
        if not bool(((lam >= 0) & (lam <= 1)).all()):  # NaN fails both comparisons
            raise ValueError("every per-row `lam` must be in [0, 1]")
    elif not 0.0 <= lam <= 1.0:
        raise ValueError(f"`lam` must be in [0, 1], got {lam}")


def length_adaptive_lam(num_actions: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO's length-adaptive lambda, one per row: ``lam = 1 - 1 / (alpha * l)`` for a row of ``l``
    actions (tokens, or macro actions over segments), clamped to [0, 1] (rows shorter than 1 / alpha
    actions get 0; a row without actions gets 0).

    Args:
        num_actions: long or float [B]; alpha: > 0 (VAPO: 0.05).
    Returns:
        float [B].
    """
    if not alpha > 0:
        raise ValueError(f"`alpha` must be > 0, got {alpha}")
    scaled = alpha * num_actions.to(torch.float32)
    return torch.where(scaled > 0, 1.0 - 1.0 / scaled.clamp(min=1e-12), 0.0).clamp(0.0, 1.0)


def token_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard token-level GAE.

    Args:
        rewards, values: float [B, T]; mask: bool [B, T].
        lam: a float, or float [B], one lambda per row.
    Returns:
        (advantages, returns): float [B, T], 0 on padding; returns = advantages + values.
    """
    _check_gae_args(rewards, values, mask, gamma, lam)
    zeros = torch.zeros_like(values)
    rewards = torch.where(mask, rewards, zeros)
    values = torch.where(mask, values, zeros)
    next_values = torch.cat([values[:, 1:], zeros[:, :1]], dim=1)  # 0 past the last token
    deltas = rewards + gamma * next_values - values
    advantages = discounted_reverse_cumsum(deltas, gamma * lam)
    advantages = torch.where(mask, advantages, zeros)
    return advantages, torch.where(mask, advantages + values, zeros)


def macro_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    value_weighting: ValueWeighting = "equal",
    segment_reward: SegmentReward = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over macro actions (segments); with one token per segment it equals :func:`token_gae`.

    Args:
        rewards, values: float [B, T]; mask: bool [B, T]; segment_ids: long [B, T].
        lam: a float, or float [B], one lambda per row (over its segments).
        value_weighting: how token values form a segment value (see :func:`marlhf.segments.value_weights`).
        segment_reward: "sum" (the paper), "mean" (the released code with `equal`, which shrinks the KL
            penalty by about 1/|tau|) or "weighted" (the released code in general: the token rewards weighted
            by the value weighting's sigma, as its segment values are; with `equal` it is "mean"; the released
            `position` weights 1/(i+1), earliest token heaviest, which marlhf does not offer: docs/algorithm.md).
    Returns:
        (advantages, returns): float [B, T]; every token of segment tau carries A_tau and Q_tau;
        0 on padding.
    """
    _check_gae_args(rewards, values, mask, gamma, lam)
    check_segment_ids(segment_ids, mask)
    if segment_reward not in ("sum", "mean", "weighted"):
        raise ValueError(f"`segment_reward` must be 'sum', 'mean' or 'weighted', got {segment_reward!r}")
    lengths = segment_lengths(segment_ids)  # [B, S]
    if segment_reward == "sum":
        seg_rewards = segment_sum(rewards, segment_ids, lengths.shape[1])
    elif segment_reward == "mean":
        seg_rewards = segment_mean(rewards, segment_ids, lengths)
    else:
        seg_rewards = segment_values(rewards, segment_ids, value_weighting, lengths)
    seg_values = segment_values(values, segment_ids, value_weighting, lengths)  # 0 on missing segments
    next_values = torch.cat([seg_values[:, 1:], seg_values.new_zeros(seg_values.shape[0], 1)], dim=1)
    deltas = seg_rewards + gamma * next_values - seg_values  # 0 on missing segments
    seg_advantages = discounted_reverse_cumsum(deltas, gamma * lam)
    advantages = broadcast_segments(seg_advantages, segment_ids)
    returns = broadcast_segments(seg_advantages + seg_values, segment_ids)
    check_like(returns, mask, "returns (rewards and values too large: the sums overflow)")
    return advantages, returns


def _check_groups(scores: torch.Tensor, group_size: int, minimum: int) -> None:
    check_finite_vector(scores, "scores")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < minimum:
        raise ValueError(f"`group_size` must be an int >= {minimum}, got {group_size!r}")
    if scores.shape[0] % group_size:
        raise ValueError(f"`scores` has {scores.shape[0]} entries, not a multiple of group_size={group_size}")


def rloo(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: each sample's score minus the mean of the other samples of its
    prompt. ``scores`` is [N] with the ``group_size`` samples of a prompt consecutive; returns [N]."""
    _check_groups(scores, group_size, minimum=2)
    grouped = scores.view(-1, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


def grpo(scores: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage: score minus the group mean, divided by the group's (unbiased)
    std when ``normalize_std``. ``scores`` [N], consecutive groups; returns [N]."""
    _check_groups(scores, group_size, minimum=2 if normalize_std else 1)
    grouped = scores.view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1)


def reinforce(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: [N] -> [N]."""
    check_finite_vector(scores, "scores")
    return scores - scores.mean()


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to unit variance over masked positions (and zero mean when ``shift_mean``).

    The variance is the biased one (divided by the number of masked positions); verl and TRL divide by
    one fewer, which differs by a factor sqrt(N / (N - 1)) on the result (under 0.1 % past 500 tokens).

    Returns float [B, T], 0 on padding.
    """
    check_mask(mask)
    check_like(x, mask, "x")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out))
