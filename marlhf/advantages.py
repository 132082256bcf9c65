"""Rewards, values and advantages at token and macro-action level.

Shapes follow :mod:`marlhf.segments`: ``[B, T]`` over response tokens, right-padded, ``mask``
bool. For row b with segments tau = 0..m-1 (docs/algorithm.md):

    R_tau = sum_{t in tau} r_t                      (segment_reward="sum"; "mean" divides by |tau|)
    V_tau = sum_i sigma_i V_{t_tau + i}             (value_weighting: "equal" | "unit" | "position" | "first")
    delta_tau = R_tau + gamma V_{tau+1} - V_tau,    V_m = 0
    A_tau = sum_l (gamma lam)^l delta_{tau+l},      Q_tau = A_tau + V_tau

and every token of segment tau carries A_tau and Q_tau. Sequence-level estimators (rloo, grpo,
reinforce) give one advantage per sample for the critic-free baselines; prefix_tree_advantages (TEMPO) and
entropy_weighted (GTPO / GRPO-S) give critic-free per-token advantages over a group, and low_prob_advantage_mask
(SPO) keeps an advantage only on decision tokens (docs/algorithm.md).

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

Defaults. The functions' defaults are the paper's (`lam=0.95`, `value_weighting="equal"`; the signatures of
:func:`macro_gae` and :func:`token_gae` are fixed by the project's contract with these defaults). PPO's trainer does
not rely on them: its defaults are `lam=1` and `value_weighting="first"` (Study II's and Study I's results:
docs/configuration.md#why-the-defaults), and it always passes gamma, lam, value_weighting and segment_reward
explicitly (marlhf.estimators.gae, and marlhf.losses.value_loss in marlhf.trainers.ppo), so a default here never
decides a training run.
"""

from __future__ import annotations

from typing import Literal

import torch

from marlhf._checks import check_finite_vector, check_like, check_mask, check_segment_ids, check_turn_ids
from marlhf.segments import (
    ValueWeighting,
    broadcast_segments,
    has_gaps,
    last_positions,
    low_prob_tokens,
    masked_mean,
    pack_actions,
    segment_first_token,
    segment_last_token,
    segment_lengths,
    segment_mean,
    segment_sum,
    segment_values,
    unpack_actions,
)

SegmentReward = Literal["sum", "mean", "weighted"]
Discount = Literal["segment", "token"]  # what gamma discounts in macro_gae: a macro action, or each action token
LamSchedule = Literal["constant", "length_adaptive"]  # the actor's lambda in PPO (marlhf.estimators.gae.GAEOptions)
EntropyLevel = Literal["token", "sequence"]  # GTPO or GRPO-S (entropy_weighted)
GiGPOMode = Literal["mean_norm", "mean_std_norm"]  # the authors' names: minus the group mean, or also / its std
EpisodeStatistics = Literal["steps", "episodes"]  # GiGPO's episode-level group statistics: over steps or episodes

__all__ = [
    "kl_penalized_rewards",
    "length_adaptive_lam",
    "token_gae",
    "macro_gae",
    "discounted_reverse_cumsum",
    "rloo",
    "grpo",
    "reinforce",
    "prefix_tree_advantages",
    "mc_segment_advantages",
    "low_prob_advantage_mask",
    "entropy_shaped_rewards",
    "entropy_weighted",
    "gigpo",
    "whiten",
]


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    turn_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * (logprobs - ref_logprobs)`` on every response token (the k1
    KL estimator) plus the sequence score on each row's last real token.

    Multi-turn rows (``mask`` the action mask, with gaps on observations): the KL penalty is on the action tokens
    only; the score lands on the row's last action token, or, with ``turn_ids``, ``scores`` is [B, K], one reward
    per turn (the environment's reward for turn k's action), each on the last action token of its turn.

    Args:
        scores: float [B], reward-model (or task) score of each response; float [B, K] with ``turn_ids``.
        logprobs, ref_logprobs: float [B, T], policy and reference log-probs of the sampled tokens.
        mask: bool [B, T].
        kl_coef: KL penalty coefficient (>= 0).
        turn_ids: long [B, T], the turn of each action token, -1 elsewhere (K > the largest), or None.
    Returns:
        rewards: float [B, T], 0 on padding. A row with no response token gets no score.
    """
    check_mask(mask, gaps=True)
    check_like(logprobs, mask, "logprobs")
    check_like(ref_logprobs, mask, "ref_logprobs")
    if turn_ids is None:
        check_finite_vector(scores, "scores")
    if scores.shape[0] != mask.shape[0]:
        raise ValueError(f"`scores` has {scores.shape[0]} rows but `mask` has {mask.shape[0]}")
    if not kl_coef >= 0 or kl_coef == float("inf"):  # NaN fails the comparison
        raise ValueError(f"`kl_coef` must be a finite number >= 0, got {kl_coef}")
    rewards = torch.where(mask, -kl_coef * (logprobs - ref_logprobs), torch.zeros_like(logprobs))
    if turn_ids is not None:
        return rewards + _turn_rewards_on_tokens(scores, turn_ids, mask).to(rewards.dtype)
    last = last_positions(mask)[:, None]
    score = torch.where(mask.any(dim=1), scores.to(rewards.dtype), 0.0)[:, None]
    return rewards.scatter_add(1, last, score)


def _turn_rewards_on_tokens(turn_rewards: torch.Tensor, turn_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, K] turn rewards -> [B, T], each on the last action token of its turn (turn_ids as segment ids)."""
    if not isinstance(turn_rewards, torch.Tensor) or turn_rewards.dim() != 2 or not turn_rewards.is_floating_point():
        raise ValueError("with `turn_ids`, `scores` must be a float [B, K] tensor of turn rewards")
    check_turn_ids(turn_ids, mask, turn_rewards.shape[1])
    check_finite_vector(turn_rewards.reshape(-1), "scores (turn rewards)")
    last = segment_last_token(turn_ids)
    placed = turn_rewards.gather(1, turn_ids.clamp(min=0)) if turn_rewards.shape[1] else turn_rewards.new_zeros(
        turn_ids.shape)
    return torch.where(last, placed, 0.0)


def discounted_reverse_cumsum(x: torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """``y_t = sum_{l >= t} discount^(l - t) x_l`` along the last dim, without a Python loop.

    ``discount``: a float, or a float tensor [B] with one discount per row of ``x`` [B, S], or a float tensor
    [B, S] with one per step, ``y_t = x_t + discount_t y_{t+1}``. A reverse cumsum when the discount is the float
    1, else a matmul with the [S, S] matrix of discount powers ([B, S, S] for per-row or per-step discounts; exact
    powers and products, no rescaling that could overflow for long rows).
    """
    if isinstance(discount, torch.Tensor) and discount.dim() == 2:
        return (_step_discount_products(discount.to(x.dtype)) @ x[..., None])[..., 0]
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


def _step_discount_products(discount: torch.Tensor) -> torch.Tensor:
    """[B, S] per-step discounts d -> [B, S, S] with [b, t, l] = d_t d_{t+1} ... d_{l-1} for l >= t (1 at l = t),
    0 for l < t: a cumulative product along l of d_{l-1} from t + 1 on."""
    steps = discount.shape[-1]
    offsets = torch.arange(steps, device=discount.device)
    after = offsets[None, :] > offsets[:, None]  # [t, l]: l > t
    previous = torch.cat([discount.new_ones(discount.shape[0], 1), discount[:, :-1]], dim=1)  # d_{l-1}
    factors = torch.where(after, previous[:, None, :], torch.ones((), dtype=discount.dtype, device=discount.device))
    return torch.where(offsets[None, :] >= offsets[:, None], factors.cumprod(dim=-1), 0.0)


def _check_gae_args(rewards, values, mask, gamma, lam) -> None:
    check_mask(mask, gaps=True)
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

    With gaps in ``mask`` (a multi-turn action mask), GAE runs over the action tokens only: "the next token" is the
    next action token, and observation positions are skipped, not zero-reward steps (verl's multi-turn GAE); their
    rewards and values are ignored. Rows without gaps take the single-turn path unchanged.

    Args:
        rewards, values: float [B, T]; mask: bool [B, T].
        lam: a float, or float [B], one lambda per row. The default is the paper's 0.95; PPO passes its own
            (default 1: the module docstring's Defaults).
    Returns:
        (advantages, returns): float [B, T], 0 on padding; returns = advantages + values.
    """
    _check_gae_args(rewards, values, mask, gamma, lam)
    if has_gaps(mask):
        (packed_rewards, packed_mask), (packed_values, _) = pack_actions(rewards, mask), pack_actions(values, mask)
        advantages, returns = token_gae(packed_rewards, packed_values, packed_mask, gamma, lam)
        return unpack_actions(advantages, mask), unpack_actions(returns, mask)
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
    discount: Discount = "segment",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over macro actions (segments); with one token per segment it equals :func:`token_gae`.

    Multi-turn rows: ``mask`` is the action mask (gaps on observations) and ``segment_ids`` -1 there, a segment
    never spanning one; the next segment is the next one of the row, after the observation. With the turns as
    segments (``turn`` termination) and ``value_weighting="first"`` this is Turn-PPO's GAE over turns (each turn
    valued at its first action token, after the observation; docs/algorithm.md#multi-turn).

    Args:
        rewards, values: float [B, T]; mask: bool [B, T]; segment_ids: long [B, T].
        lam: a float, or float [B], one lambda per row (over its segments).
        value_weighting: how token values form a segment value (see :func:`marlhf.segments.value_weights`).
        The defaults of lam (0.95) and value_weighting ("equal") are the paper's; PPO's trainer passes its own
        explicitly (lam=1, value_weighting="first" by default: the module docstring's Defaults).
        segment_reward: "sum" (the paper), "mean" (the released code with `equal`, which shrinks the KL
            penalty by about 1/|tau|) or "weighted" (the released code in general: the token rewards weighted
            by the value weighting's sigma, as its segment values are; with `equal` it is "mean"; the released
            `position` weights 1/(i+1), earliest token heaviest, which marlhf does not offer: docs/algorithm.md).
        discount: "segment" (gamma once per macro action, the paper) or "token" (gamma per action token: a macro
            action of n tokens is discounted by gamma^n and its rewards by gamma^i within it, i = 0..n-1;
            with "first" it is token GAE under the lambda schedule 1 inside a segment; needs segment_reward "sum").
    Returns:
        (advantages, returns): float [B, T]; every token of segment tau carries A_tau and Q_tau;
        0 on padding.
    """
    _check_gae_args(rewards, values, mask, gamma, lam)
    check_segment_ids(segment_ids, mask)
    if segment_reward not in ("sum", "mean", "weighted"):
        raise ValueError(f"`segment_reward` must be 'sum', 'mean' or 'weighted', got {segment_reward!r}")
    if discount not in ("segment", "token"):
        raise ValueError(f"`discount` must be 'segment' or 'token', got {discount!r}")
    if discount == "token" and segment_reward != "sum":
        raise ValueError(f"discount='token' discounts rewards inside a macro action: it needs segment_reward='sum', "
                         f"got {segment_reward!r}")
    lengths = segment_lengths(segment_ids)  # [B, S]
    if discount == "token":
        seg_rewards = segment_sum(rewards * _discount_within_segments(segment_ids, gamma, rewards.dtype),
                                  segment_ids, lengths.shape[1])
    elif segment_reward == "sum":
        seg_rewards = segment_sum(rewards, segment_ids, lengths.shape[1])
    elif segment_reward == "mean":
        seg_rewards = segment_mean(rewards, segment_ids, lengths)
    else:
        seg_rewards = segment_values(rewards, segment_ids, value_weighting, lengths)
    seg_values = segment_values(values, segment_ids, value_weighting, lengths)  # 0 on missing segments
    next_values = torch.cat([seg_values[:, 1:], seg_values.new_zeros(seg_values.shape[0], 1)], dim=1)
    if discount == "token":  # per-step discounts gamma^|tau| (1 on missing segments, whose deltas are 0)
        seg_gamma = torch.tensor(gamma, dtype=seg_values.dtype, device=seg_values.device) ** lengths.to(
            seg_values.dtype)
        deltas = seg_rewards + seg_gamma * next_values - seg_values
        seg_lam = lam[:, None].to(seg_values.dtype) if isinstance(lam, torch.Tensor) else lam
        seg_advantages = discounted_reverse_cumsum(deltas, seg_gamma * seg_lam)
    else:
        deltas = seg_rewards + gamma * next_values - seg_values  # 0 on missing segments
        seg_advantages = discounted_reverse_cumsum(deltas, gamma * lam)
    advantages = broadcast_segments(seg_advantages, segment_ids)
    returns = broadcast_segments(seg_advantages + seg_values, segment_ids)
    check_like(returns, mask, "returns (rewards and values too large: the sums overflow)")
    return advantages, returns


def _discount_within_segments(segment_ids: torch.Tensor, gamma: float, dtype: torch.dtype) -> torch.Tensor:
    """gamma^i on the i-th token of each segment (i = 0 first), [B, T]; a segment is a run of positions."""
    positions = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.where(segment_first_token(segment_ids), positions, 0).cummax(dim=1).values
    return torch.tensor(gamma, dtype=dtype, device=segment_ids.device) ** (positions - starts).to(dtype)


def _check_groups(scores: torch.Tensor, group_size: int, minimum: int) -> None:
    check_finite_vector(scores, "scores")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < minimum:
        raise ValueError(f"`group_size` must be an int >= {minimum}, got {group_size!r}")
    if scores.shape[0] % group_size:
        raise ValueError(f"`scores` has {scores.shape[0]} entries, not a multiple of group_size={group_size}")


def rloo(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: each sample's score minus the mean of the other samples of its
    prompt. ``scores`` is [N] with the ``group_size`` samples of a prompt consecutive; returns [N] in scores' dtype,
    computed in float64 (a group of equal scores gets exactly 0)."""
    _check_groups(scores, group_size, minimum=2)
    grouped = scores.view(-1, group_size).to(torch.float64)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1).to(scores.dtype)


def grpo(scores: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage: score minus the group mean, divided by the group's (unbiased)
    std when ``normalize_std``. ``scores`` [N], consecutive groups; returns [N] in scores' dtype. The group's mean
    and std are computed in float64: in float32 eight scores of 0.1 have a mean an ulp off and a std of ~1e-8, and
    would get advantages of -0.0074 instead of 0."""
    _check_groups(scores, group_size, minimum=2 if normalize_std else 1)
    grouped = scores.view(-1, group_size).to(torch.float64)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1).to(scores.dtype)


def reinforce(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: [N] -> [N]."""
    check_finite_vector(scores, "scores")
    return scores - scores.mean()


def prefix_tree_advantages(
    scores: torch.Tensor,
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """TEMPO / Prefix-to-Tree (arXiv 2509.18314): GRPO's advantage plus a TD correction on the prefix tree of the
    group's responses.

    The ``group_size`` responses to one prompt (consecutive rows) form a tree whose nodes are their prefixes;
    V(node) is the mean score of the responses through it (V(root) = the group mean). Token t of response i moves
    from node y_{<t} to node y_{<=t}, and gets

        A_{i,t} = (R_i - mean_G + V(y_{<=t}) - V(y_{<t})) / (std_G + eps)

    (no division when not ``normalize_std``; std_G unbiased). The TD term is non-zero only where the group branches:
    it is 0 on a token all responses through y_{<t} share, and once a response is alone in its branch
    V(y_{<=t}) = V(y_{<t}) = R_i, so the rest of it gets GRPO's advantage. Identical responses give GRPO everywhere;
    responses that differ at their first token give GRPO after it and 2 GRPO on it (V(y_0) - V(root) = R_i - mean_G).

    As the authors' ``compute_tempo_outcome_advantage`` (github fatebreaker/tempo, verl/trainer/ppo/core_algos.py)
    computes it, with the tree read from the mask: a response that ends at node y_{<t} counts in the values of that
    node and its ancestors, not in any child (the authors compare raw token ids, padding included, which is the same
    whenever the pad id is not the other response's token there). Their code gives NaN for a group of one under
    std normalisation (the std of one score); here that is a ValueError, as in :func:`grpo`; without it, 0.

    Args:
        scores: float [N], one outcome per response, the ``group_size`` responses of a prompt consecutive (NaN or
            inf raise a ValueError).
        response_ids: long [N, T], the sampled tokens (padding ignored); mask: bool [N, T].
    Returns:
        advantages: [N, T] in scores' dtype (the group statistics and node values computed in float64, as in
        :func:`grpo`), 0 on padding.
    """
    check_mask(mask)
    _check_groups(scores, group_size, minimum=2 if normalize_std else 1)
    if not isinstance(response_ids, torch.Tensor) or response_ids.shape != mask.shape:
        raise ValueError(f"`response_ids` must be a tensor shaped like `mask` {tuple(mask.shape)}")
    if scores.shape[0] != mask.shape[0]:
        raise ValueError(f"`scores` has {scores.shape[0]} rows but `mask` has {mask.shape[0]}")
    groups, width = scores.shape[0] // group_size, mask.shape[1]
    ids = response_ids.view(groups, group_size, 1, width)
    live = mask.view(groups, group_size, 1, width)
    # through[c, i, k, t]: response k shares response i's first t + 1 tokens, i.e. passes through node y_{i,<=t}
    same = (ids == ids.transpose(1, 2)) & live & live.transpose(1, 2)
    through = same.cummin(dim=-1).values
    grouped = scores.view(groups, group_size).to(torch.float64)  # exact group statistics, as in grpo
    weights = through.to(torch.float64)
    node_value = (weights * grouped[:, None, :, None]).sum(dim=2) / weights.sum(dim=2).clamp(min=1)  # [G', g, T]
    mean = grouped.mean(dim=1, keepdim=True)
    parent_value = torch.cat([mean[:, :, None].expand(-1, group_size, 1), node_value[..., :-1]], dim=-1)
    advantages = (grouped - mean)[..., None] + node_value - parent_value
    if normalize_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True)[..., None] + eps)
    advantages = advantages.reshape(mask.shape).to(scores.dtype)
    return torch.where(mask, advantages, torch.zeros_like(advantages))


def mc_segment_advantages(
    boundary_values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor
) -> torch.Tensor:
    """Monte-Carlo macro-action advantages (VinePPO, arXiv 2410.01679; SPO-chain, arXiv 2505.23564): segment tau
    of a row of m segments, starting at boundary t_tau, gets

        A_tau = sum_{t in tau} r_t + V(t_{tau+1}) - V(t_tau),    V(t_m) = 0,

    on every token, with V(t_tau) the Monte-Carlo estimate of the final score from the state before response token
    t_tau (`boundary_values`). The rewards are the KL penalty on every token and the score added on the last, so
    the last segment's is score - V(t_{m-1}) + its KL rewards and every other one's V(next) - V(its start) + its
    KL rewards. It is macro GAE's TD error (gamma 1, lambda 0, `value_weighting="first"`) with the Monte-Carlo
    values in place of the critic's.

    Args:
        boundary_values: float [B, S], V of each segment's start (slots past a row's last segment ignored).
        rewards: float [B, T]; mask: bool [B, T]; segment_ids: long [B, T], at most S segments per row.
    Returns:
        advantages: float [B, T], 0 on padding.
    """
    check_like(rewards, mask, "rewards")
    check_segment_ids(segment_ids, mask)
    if boundary_values.dim() != 2 or boundary_values.shape[0] != mask.shape[0]:
        raise ValueError(f"`boundary_values` must be [B, S], B = {mask.shape[0]}, got {tuple(boundary_values.shape)}")
    slots = boundary_values.shape[1]
    if mask.any() and int(segment_ids.max()) >= slots:
        raise ValueError(f"`segment_ids` has more segments than `boundary_values`' {slots} slots")
    present = segment_lengths(segment_ids, slots) > 0
    values = torch.where(present, boundary_values.to(rewards.dtype), 0.0)  # V(t_m) = 0 past the last segment
    next_values = torch.cat([values[:, 1:], values.new_zeros(values.shape[0], 1)], dim=1)
    return broadcast_segments(segment_sum(rewards, segment_ids, slots) + next_values - values, segment_ids)


def low_prob_advantage_mask(
    advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, threshold: float = 0.9
) -> torch.Tensor:
    """SPO's probability mask (arXiv 2505.23564): keep a token's advantage only where the sampling policy gave the
    sampled token probability below ``threshold`` (strict, :func:`marlhf.segments.low_prob_tokens`), 0 elsewhere.

    Applied to per-token advantages, so a macro action's advantage lands on its decision tokens only, and a macro
    action without such a token contributes nothing. SPO's trainer also drops the masked tokens from the loss's
    token mean (``action_mask & (exp(old_logprobs) < 0.9)``, src/treetune/trainers/ppo_trainer.py); a zero
    advantage gives them no gradient but they still count in marlhf's denominators. PPO applies the mask after
    `whiten_advantages`, which whitens over all response tokens; SPO whitens over the kept ones (unbiased variance,
    n - 1). NaN or inf advantages or log-probs on response tokens raise a ValueError.

    Args:
        advantages, logprobs: float [B, T]; mask: bool [B, T]; threshold: in [0, 1] (SPO: 0.9).
    Returns:
        float [B, T], 0 on padding.
    """
    check_like(advantages, mask, "advantages")
    keep = low_prob_tokens(mask, logprobs, threshold)
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def entropy_shaped_rewards(
    scores: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    level: EntropyLevel = "token",
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    success_threshold: float = 0.5,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GTPO's and GRPO-S's entropy-shaped rewards (Dynamic Entropy Weighting, Tan et al., arXiv 2508.04349).

    A response succeeds when its score is above ``success_threshold`` (the paper's r in {0, 1}). Per group of
    ``group_size`` consecutive responses, with H_{i,t} the sampling policy's entropy at token t of response i:

    - ``level="token"`` (GTPO, Eq. 3 and 5): d_t (h_t) counts the successes (failures) still generating at t, a
      finished response's entropy counting as 0 there, and

          r+_{i,t} = alpha1 r_i + alpha2 H_{i,t} / sum_{k in O+} H_{k,t} * d_t
          r-_{j,t} = -alpha1 - alpha2 (1 / H_{j,t}) / sum_{k in O-} (1 / H_{k,t}) * h_t

      per position the successes' rewards sum to (alpha1 + alpha2) d_t when r = 1 (Proposition 2.2).
    - ``level="sequence"`` (GRPO-S, Eq. 8 and 9): with H^_i the mean entropy of response i, n (m) the successes
      (failures) with at least one token,

          r+_i = alpha1 r_i + alpha2 H^_i / sum_{k in O+} H^_k * n
          r-_j = -alpha1 - alpha2 (1 / H^_j) / sum_{k in O-} (1 / H^_k) * m

      and an empty response gets alpha1 r_i or -alpha1 (the paper has none; its H^ would be 0/0).

    ``alpha1``/``alpha2`` are the paper's alpha or beta (its runs: 1 and 0.1). ``eps`` is Remark 2.1's constant,
    added only where a denominator can be 0: H / max(sum H, eps) and 1 / (H + eps) (so a lone response's share is
    exactly 1, which the standardisation would otherwise blow up from an eps-sized difference). A failure gets
    -alpha1 whatever its score (Eq. 5); a success keeps its score in alpha1 r_i (Eq. 3). Computed in float64. NaN
    or inf scores, or entropies on response tokens, raise a ValueError.

    Args:
        scores: float [N], consecutive groups; entropy: float [N, T] (>= 0); mask: bool [N, T].
    Returns:
        float [N, T] shaped token rewards, 0 on padding (``"token"``), or float [N] (``"sequence"``).
    """
    check_mask(mask)
    check_like(entropy, mask, "entropy")
    _check_groups(scores, group_size, minimum=1)
    if scores.shape[0] != mask.shape[0]:
        raise ValueError(f"`scores` has {scores.shape[0]} rows but `mask` has {mask.shape[0]}")
    if level not in ("token", "sequence"):
        raise ValueError(f"`level` must be 'token' or 'sequence', got {level!r}")
    success = (scores > success_threshold).view(-1, group_size)
    r = scores.to(torch.float64).view(-1, group_size)
    h = torch.where(mask, entropy.to(torch.float64), 0.0)
    if level == "sequence":
        shaped = _shaped(r, masked_mean(h, mask, dim=1).view_as(r), mask.any(dim=1).view_as(r), success,
                         alpha1, alpha2, eps)
        return shaped.reshape(-1).to(scores.dtype)
    live = mask.view(scores.shape[0] // group_size, group_size, mask.shape[1])
    shaped = _shaped(r[..., None], h.view(live.shape), live, success[..., None], alpha1, alpha2, eps)
    return torch.where(mask, shaped.reshape(mask.shape), 0.0).to(entropy.dtype)


def _shaped(r, h, live, success, alpha1, alpha2, eps):
    """Eq. 3/5 (or 9) along dim 1, the group: a live success's share of the positive mass grows with its entropy,
    a live failure's share of the negative mass with its inverse entropy; entries that are not live get none."""
    positive, negative = live & success, live & ~success
    h_pos = torch.where(positive, h, 0.0)
    bonus = h_pos / h_pos.sum(dim=1, keepdim=True).clamp(min=eps) * positive.sum(dim=1, keepdim=True)
    inverse = torch.where(negative, 1.0 / (h + eps), 0.0)
    penalty = inverse / inverse.sum(dim=1, keepdim=True).clamp(min=eps) * negative.sum(dim=1, keepdim=True)
    return torch.where(success, alpha1 * r + alpha2 * bonus, -alpha1 - alpha2 * penalty)


def entropy_weighted(
    scores: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    level: EntropyLevel = "token",
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    success_threshold: float = 0.5,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GTPO / GRPO-S advantages (arXiv 2508.04349) from :func:`entropy_shaped_rewards`.

    - ``"token"`` (GTPO, Eq. 6): successes and failures are normalised separately, each over all its shaped token
      rewards in the group, A+_{i,t} = (r+_{i,t} - mean(R+)) / std(R+) and likewise A- over R-. As written, each
      set's advantages then have mean 0 (the outcome enters only through which set a response is in). The paper's
      Discussion says its implementation compares entropies across the batch: ``group_size = N`` does that.
    - ``"sequence"`` (GRPO-S, Eq. 1 on the shaped rewards, Eq. 46): A_i = (r^_i - mean) / std over the group's
      responses, broadcast to every token of a response. With equal entropies and scores in {0, 1} this is
      :func:`grpo` (the shaped rewards are an affine map of the scores). GRPO-S's sequence-level importance weight
      (Eq. 11) belongs to the policy loss, not here.

    std is unbiased and ``eps`` is added to it; a set or group of one entry gets 0 (nothing to compare with).

    Args:
        as :func:`entropy_shaped_rewards`.
    Returns:
        advantages: float [N, T], 0 on padding.
    """
    shaped = entropy_shaped_rewards(scores, entropy, mask, group_size, level, alpha1, alpha2, success_threshold, eps)
    if level == "sequence":
        grouped = shaped.to(torch.float64).view(-1, group_size)
        members = torch.ones_like(grouped, dtype=torch.bool)
        advantages = _standardize(grouped, members, eps).reshape(-1, 1).expand(mask.shape)
    else:
        grouped = shaped.to(torch.float64).view(scores.shape[0] // group_size, group_size, mask.shape[1])
        live = mask.view(grouped.shape)
        success = (scores > success_threshold).view(-1, group_size, 1)
        # one normalisation per (group, set): flatten each group's tokens, then standardise each set apart
        flat = grouped.reshape(grouped.shape[0], -1)
        advantages = torch.zeros_like(flat)
        for members in ((live & success).reshape(flat.shape), (live & ~success).reshape(flat.shape)):
            advantages = torch.where(members, _standardize(flat, members, eps), advantages)
        advantages = advantages.reshape(mask.shape)
    return torch.where(mask, advantages, 0.0).to(entropy.dtype)


def _standardize(x: torch.Tensor, members: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) along dim 1 over `members` (std unbiased; 0 for a single member)."""
    count = members.sum(dim=1, keepdim=True)
    mean = torch.where(members, x, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(members, x - mean, 0.0)
    std = (centered.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return centered / (std + eps)


def gigpo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    turn_ids: torch.Tensor,
    turn_state_ids: torch.Tensor,
    group_size: int,
    gamma: float = 0.95,
    step_advantage_w: float = 1.0,
    mode: GiGPOMode = "mean_norm",
    episode_statistics: EpisodeStatistics = "steps",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO (Feng et al., arXiv 2505.10978), as the authors' code computes it (langfengQ/verl-agent,
    gigpo/core_gigpo.py, ``compute_gigpo_outcome_advantage``), one episode a row.

    Episode i (of a prompt's ``group_size`` consecutive rows) has turns k = 0..n_i-1 (``turn_state_ids`` >= 0), turn
    rewards r_{i,k} (the rewards summed over turn k's action tokens: the environment's reward, minus the KL penalty
    when there is one), return R_i = sum_k r_{i,k}, and step returns G_{i,k} = sum_{j >= k} gamma^(j-k) r_{i,j}.

    - Episode level: A^E_i = R_i - mean, or (R_i - mean) / (std + eps) with ``mode="mean_std_norm"``, the mean and
      (unbiased) std over the group. ``episode_statistics="steps"`` (the code: one row per step, every row carrying
      its episode's return) takes them over the group's steps, episode i counted n_i times; ``"episodes"`` over its
      episodes, each once (the paper's Eq. 3). An episode-level group of one has mean 0 and std 1, as in the code.
    - Step level: the steps of a group's episodes with equal ``turn_state_ids`` (the anchor state: the same
      environment state before the turn) form a step group; A^S_{i,k} = G_{i,k} - mean, or / (std + eps) likewise,
      over the step group (a step group of one gets 0).
    - Every action token of turn k of episode i gets A^E_i + ``step_advantage_w`` A^S_{i,k}.

    The code's defaults differ from the paper's text: ``mode="mean_norm"`` (its config's default: no division; the
    paper's Eq. 3 and 7 divide by a factor F_norm, the group's std), statistics over steps, and gamma 0.95 (its
    example runs' ``algorithm.gamma``); ``mode="mean_std_norm"`` and ``episode_statistics="episodes"`` give the
    paper's. A turn's reward is what its action tokens carry: a turn without action tokens has none.

    Args:
        rewards: float [B, T]; mask: bool [B, T], the action mask (gaps on observations); turn_ids: long [B, T], the
            turn of each action token (-1 elsewhere); turn_state_ids: long [B, K], an id of the state before turn k
            (equal ids: identical states), -1 past the episode's turns; group_size: episodes per prompt.
    Returns:
        advantages: float [B, T], 0 off the action tokens.
    """
    if episode_statistics not in ("steps", "episodes") or mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"`episode_statistics` must be 'steps' or 'episodes' and `mode` 'mean_norm' or "
                         f"'mean_std_norm', got {episode_statistics!r}, {mode!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"`gamma` must be in [0, 1], got {gamma}")
    turn_rewards, turns = _gigpo_turns(rewards, mask, turn_ids, turn_state_ids, group_size)
    episode_returns = turn_rewards.sum(dim=1)
    counts = turns.sum(dim=1) if episode_statistics == "steps" else turns.any(dim=1).long()
    groups = torch.arange(mask.shape[0], device=mask.device) // group_size
    episode = _group_normalized(episode_returns, groups, counts.to(rewards.dtype), mode == "mean_std_norm", eps,
                                single_mean_zero=True)
    step_returns = discounted_reverse_cumsum(turn_rewards, gamma)
    present = turns.reshape(-1)
    keys = groups[:, None] * (int(turn_state_ids.max()) + 1 if turn_state_ids.numel() else 1) + turn_state_ids
    step_groups = torch.unique(keys.reshape(-1)[present], return_inverse=True)[1]
    step = torch.zeros_like(step_returns).reshape(-1)
    step[present] = _group_normalized(step_returns.reshape(-1)[present], step_groups,
                                      torch.ones_like(step_groups, dtype=rewards.dtype), mode == "mean_std_norm", eps,
                                      single_mean_zero=False)
    per_turn = episode[:, None] + step_advantage_w * step.view_as(step_returns)
    placed = per_turn.gather(1, turn_ids.clamp(min=0)) if per_turn.shape[1] else torch.zeros_like(rewards)
    return torch.where(mask, placed, 0.0)


def _gigpo_turns(rewards, mask, turn_ids, turn_state_ids, group_size) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO's inputs checked: (turn rewards float [B, K], turns bool [B, K]: the episode's turns)."""
    check_mask(mask, gaps=True)
    check_like(rewards, mask, "rewards")
    if not isinstance(turn_state_ids, torch.Tensor) or turn_state_ids.dtype != torch.long or \
            turn_state_ids.dim() != 2 or turn_state_ids.shape[0] != mask.shape[0]:
        raise ValueError(f"`turn_state_ids` must be a long [B, K] tensor, B = {mask.shape[0]}")
    check_turn_ids(turn_ids, mask, turn_state_ids.shape[1])
    _check_groups(rewards.new_zeros(mask.shape[0]), group_size, minimum=1)
    turns = turn_state_ids >= 0
    if bool((turns[:, 1:] & ~turns[:, :-1]).any()) or bool((turn_state_ids < -1).any()):
        raise ValueError("`turn_state_ids` must be >= 0 on an episode's turns, then -1")
    acted = segment_sum(torch.ones_like(rewards), turn_ids, turns.shape[1]) > 0
    if bool((acted & ~turns).any()):
        raise ValueError("`turn_state_ids` is -1 on a turn that has action tokens (`turn_ids`)")
    return segment_sum(torch.where(mask, rewards, 0.0), turn_ids, turns.shape[1]), turns


def _group_normalized(x: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor, divide_std: bool, eps: float,
                      single_mean_zero: bool) -> torch.Tensor:
    """x minus its group's weighted mean (and / (std + eps), the unbiased std of the group's multiset, x_i counted
    weights_i times); a group of total weight 1 has mean 0 (single_mean_zero) or its own value, and std 1."""
    slots = int(groups.max()) + 1 if groups.numel() else 0
    count = x.new_zeros(slots).scatter_add(0, groups, weights)
    mean = x.new_zeros(slots).scatter_add(0, groups, weights * x) / count.clamp(min=1)
    centered = x - mean[groups]
    var = x.new_zeros(slots).scatter_add(0, groups, weights * centered ** 2) / (count - 1).clamp(min=1)
    single = (count <= 1)[groups]
    if single_mean_zero:
        centered = torch.where(single, x, centered)
    else:
        centered = torch.where(single, 0.0, centered)
    if divide_std:
        centered = centered / (torch.where(single, 1.0, var[groups].sqrt()) + eps)
    return centered


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to unit variance over masked positions (and zero mean when ``shift_mean``); a multi-turn
    action mask (gaps on observations) normalises over the action tokens.

    The variance is the biased one (divided by the number of masked positions); verl and TRL divide by
    one fewer, which differs by a factor sqrt(N / (N - 1)) on the result (under 0.1 % past 500 tokens).

    Returns float [B, T], 0 on padding.
    """
    check_mask(mask, gaps=True)
    check_like(x, mask, "x")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out))
