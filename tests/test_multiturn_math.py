"""Multi-turn rows (issue 47, docs/algorithm.md#multi-turn): the core functions on an action mask with gaps (False on
the observation tokens between turns, `segment_ids` -1 there), against slow per-episode references on random
multi-turn batches (ragged turns, empty observations, one-turn episodes, truncated episodes, all padding), and the
invariance that matters: an observation token's log-prob, value or reward changes no advantage and no gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marlhf._checks import check_segment_ids
from marlhf.advantages import discounted_reverse_cumsum, kl_penalized_rewards, macro_gae, token_gae, whiten
from marlhf.losses import loss_units, policy_loss, value_loss
from marlhf.segments import (fixed_ngram, has_gaps, last_positions, pack_actions, segment_first_token,
                             segment_last_token, split_by_turns, split_last_token, unpack_actions, value_weights)
from tests.reference import macro_gae_ref, policy_loss_ref, segments_of_row, value_loss_ref


def random_episodes(batch: int, width: int, g: torch.Generator, max_turns: int = 4):
    """A random multi-turn batch over the response region: per row, turns of 1-4 action tokens, each but the last
    followed by an observation of 0-3 tokens (0: an empty observation), cut at `width` (a truncated episode). Row 0
    is all padding, row 1 a one-turn episode. Returns (action mask, real-token mask, turn_ids), [B, T] each."""
    action = torch.zeros(batch, width, dtype=torch.bool)
    real = torch.zeros(batch, width, dtype=torch.bool)
    turn_ids = torch.full((batch, width), -1, dtype=torch.long)
    for b in range(batch):
        turns = 0 if b == 0 else 1 if b == 1 else int(torch.randint(1, max_turns + 1, (1,), generator=g))
        t = 0
        for k in range(turns):
            for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
                if t < width:
                    action[b, t], real[b, t], turn_ids[b, t] = True, True, k
                t += 1
            if k + 1 < turns:
                for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
                    if t < width:
                        real[b, t] = True
                    t += 1
    return action, real, turn_ids


def _batch(seed: int, batch: int = 10, width: int = 16):
    g = torch.Generator().manual_seed(seed)
    action, real, turn_ids = random_episodes(batch, width, g)
    x = [torch.randn(batch, width, generator=g, dtype=torch.double) for _ in range(3)]
    return action, real, turn_ids, x, g


def _random_segments(turn_ids: torch.Tensor, g: torch.Generator, p: float = 0.3) -> torch.Tensor:
    """Random segments inside the turns: a segment starts at every turn start and elsewhere with probability p."""
    cuts = torch.rand(turn_ids.shape, generator=g) < p
    return split_by_turns(cuts.long().cumsum(dim=1), turn_ids)


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-9, atol=1e-9)


def verl_token_gae_ref(rewards, values, action, gamma, lam):
    """Multi-turn token GAE as verl computes it (compute_gae_advantage_return, verl/trainer/ppo/core_algos.py): one
    pass right to left over every position; on a non-action position the next value and the running advantage are
    carried over unchanged (the observation is skipped, not a zero-reward step)."""
    batch, width = rewards.shape
    adv = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        next_value, running = 0.0, 0.0
        for t in reversed(range(width)):
            if action[b, t]:
                running = float(rewards[b, t]) + gamma * next_value - float(values[b, t]) + gamma * lam * running
                next_value = float(values[b, t])
                adv[b][t] = running
    return adv


def test_random_episodes_have_every_edge_case():
    action, real, turn_ids = random_episodes(40, 16, torch.Generator().manual_seed(0))
    check_segment_ids(split_by_turns(turn_ids, turn_ids), action)
    assert not action[0].any() and action[1].any() and not has_gaps(action[1:2])
    assert has_gaps(action) and (action[:, -1]).any()  # gaps, and episodes cut at the width
    adjacent = (turn_ids[:, 1:] > turn_ids[:, :-1]) & (turn_ids[:, :-1] >= 0)
    assert adjacent.any()  # an empty observation: two turns side by side


def test_has_gaps_pack_and_unpack():
    mask = torch.tensor([[True, False, True, False], [True, True, False, False], [False, False, False, False]])
    assert has_gaps(mask) and not has_gaps(mask[1:])
    x = torch.arange(12.0).view(3, 4)
    packed, packed_mask = pack_actions(x, mask)
    assert packed.tolist() == [[0.0, 2.0, 0.0, 0.0], [4.0, 5.0, 0.0, 0.0], [0.0] * 4]
    assert packed_mask.tolist() == [[True, True, False, False], [True, True, False, False], [False] * 4]
    assert unpack_actions(packed, mask).tolist() == [[0.0, 0.0, 2.0, 0.0], [4.0, 5.0, 0.0, 0.0], [0.0] * 4]
    assert last_positions(mask).tolist() == [2, 1, 0]


def test_segment_ids_never_span_a_gap():
    mask = torch.tensor([[True, True, False, True, True, False]])
    check_segment_ids(torch.tensor([[0, 0, -1, 1, 1, -1]]), mask)
    with pytest.raises(ValueError, match="never spans an observation"):
        check_segment_ids(torch.tensor([[0, 0, -1, 0, 1, -1]]), mask)
    with pytest.raises(ValueError, match="contiguously"):
        check_segment_ids(torch.tensor([[0, 0, -1, 2, 2, -1]]), mask)
    with pytest.raises(ValueError, match="-1 on padding"):
        check_segment_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]), mask)


def test_split_by_turns():
    turn_ids = torch.tensor([[0, 0, -1, 1, 1, 2, 2, -1]])  # an empty observation between turns 1 and 2
    rule = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    assert split_by_turns(rule, turn_ids).tolist() == [[0, 0, -1, 1, 2, 3, 3, -1]]
    assert split_by_turns(turn_ids, turn_ids).tolist() == [[0, 0, -1, 1, 1, 2, 2, -1]]
    single = torch.tensor([[0, 0, 0, -1]])  # one turn, right-padded: a valid segmentation is kept
    assert split_by_turns(torch.tensor([[0, 1, 1, -1]]), single).tolist() == [[0, 1, 1, -1]]


@pytest.mark.parametrize("seed", range(4))
def test_segment_boundaries_and_value_weights_per_turn(seed):
    action, _, turn_ids, (values, _, _), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    first, last = segment_first_token(segment_ids), segment_last_token(segment_ids)
    for b in range(action.shape[0]):
        for positions in segments_of_row(segment_ids[b].tolist()):
            assert positions == list(range(positions[0], positions[-1] + 1))  # a run: never spans a gap
            assert first[b, positions].tolist() == [True] + [False] * (len(positions) - 1)
            assert last[b, positions].tolist() == [False] * (len(positions) - 1) + [True]
    for weighting in ("equal", "unit", "first", "position"):
        w = value_weights(segment_ids, action, weighting, torch.double)
        packed_ids = pack_actions(segment_ids.double() + 1, action)[0].long() - 1
        packed_w = value_weights(packed_ids, packed_ids >= 0, weighting, torch.double)
        torch.testing.assert_close(w, unpack_actions(packed_w, action))
        assert (w[~action] == 0).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_token_gae_skips_observations_as_verl_does(seed, gamma, lam):
    action, _, _, (rewards, values, _), _ = _batch(seed)
    adv, ret = token_gae(rewards, values, action, gamma, lam)
    expected = verl_token_gae_ref(rewards, values, action, gamma, lam)
    _close(adv, expected)
    _close(ret, torch.where(action, torch.tensor(expected, dtype=torch.double) + values, 0.0))
    # the same as macro GAE over one-token segments numbered across the gaps
    one_token = torch.where(action, action.long().cumsum(dim=1) - 1, -1)
    macro = macro_gae(rewards, values, action, one_token, gamma, lam)
    torch.testing.assert_close(macro[0], adv)
    torch.testing.assert_close(macro[1], ret)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighting", ["equal", "unit", "first", "position"])
@pytest.mark.parametrize("segment_reward", ["sum", "mean"])
def test_macro_gae_on_gaps_matches_reference(seed, weighting, segment_reward):
    action, _, turn_ids, (rewards, values, _), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    adv, ret = macro_gae(rewards, values, action, segment_ids, 0.9, 0.8, weighting, segment_reward)
    adv_ref, ret_ref = macro_gae_ref(rewards.tolist(), values.tolist(), segment_ids.tolist(), 0.9, 0.8, weighting,
                                     segment_reward)
    _close(adv, adv_ref)
    _close(ret, ret_ref)


@pytest.mark.parametrize("seed", range(3))
def test_observation_tokens_change_no_advantage(seed):
    action, _, turn_ids, (rewards, values, noise), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    moved_rewards = torch.where(action, rewards, noise)
    moved_values = torch.where(action, values, 3 * noise)
    for fn in (lambda r, v: token_gae(r, v, action, 0.9, 0.8),
               lambda r, v: macro_gae(r, v, action, segment_ids, 0.9, 0.8, "first"),
               lambda r, v: macro_gae(r, v, action, segment_ids, 0.9, 0.8, "equal", discount="token")):
        for a, b in zip(fn(rewards, values), fn(moved_rewards, moved_values)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert (a[~action] == 0).all()
    torch.testing.assert_close(whiten(rewards, action), whiten(moved_rewards, action), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_kl_rewards_and_whiten_on_gaps(seed):
    action, _, turn_ids, (logprobs, ref, x), g = _batch(seed)
    scores = torch.randn(action.shape[0], generator=g, dtype=torch.double)
    rewards = kl_penalized_rewards(scores, logprobs, ref, action, 0.1)
    for b in range(action.shape[0]):
        positions = action[b].nonzero().flatten().tolist()
        expected = torch.zeros(action.shape[1], dtype=torch.double)
        for t in positions:
            expected[t] = -0.1 * (logprobs[b, t] - ref[b, t])
        if positions:
            expected[positions[-1]] += scores[b]
        _close(rewards[b], expected)
    turns = int(turn_ids.max()) + 1
    turn_rewards = torch.randn(action.shape[0], turns, generator=g, dtype=torch.double)
    per_turn = kl_penalized_rewards(turn_rewards, logprobs, ref, action, 0.0, turn_ids)
    for b in range(action.shape[0]):
        for k in range(turns):
            positions = (turn_ids[b] == k).nonzero().flatten().tolist()
            for t in positions:
                assert per_turn[b, t] == (turn_rewards[b, k] if t == positions[-1] else 0.0)
    assert (per_turn[~action] == 0).all()
    with pytest.raises(ValueError, match="turn_ids"):
        kl_penalized_rewards(turn_rewards[:, :1], logprobs, ref, action, 0.0, turn_ids)
    white = whiten(x, action)
    values = x[action]
    _close(white[action], (values - values.mean()) / (values.var(unbiased=False) + 1e-8).sqrt())
    assert (white[~action] == 0).all()


def test_split_last_token_on_gaps():
    mask = torch.tensor([[True, True, False, True, False], [True, True, False, True, True], [False] * 5])
    ids = torch.tensor([[0, 0, -1, 1, -1], [0, 0, -1, 1, 1], [-1] * 5])
    assert split_last_token(ids, mask).tolist() == [[0, 0, -1, 1, -1], [0, 0, -1, 1, 2], [-1] * 5]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("granularity,weighting", [("macro", "tokens"), ("macro", "uniform"), ("macro", "geometric"),
                                                   ("token", "tokens")])
def test_policy_loss_on_gaps_matches_reference(seed, granularity, weighting):
    action, _, turn_ids, (logprobs, old, noise), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    old = logprobs + 0.3 * old
    advantages = macro_gae(noise, noise, action, segment_ids, 1.0, 0.9)[0]
    loss, stats = policy_loss(logprobs, old, advantages, action, segment_ids, 0.2, granularity, weighting)
    expected, clipfrac = policy_loss_ref(logprobs.tolist(), old.tolist(), advantages.tolist(), segment_ids.tolist(),
                                         0.2, granularity, weighting)
    _close(loss, expected)
    assert abs(float(stats["clipfrac"]) - clipfrac) < 1e-6  # a float32 mean
    units = loss_units(action, segment_ids, weighting)
    assert int(units) == (int((segment_ids.max(dim=1).values + 1).sum()) if weighting == "uniform"
                          else int(action.sum()))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("granularity", ["macro", "token"])
def test_observation_log_probs_change_no_gradient(seed, granularity):
    """The issue's test: an observation token's log-prob (current or old), advantage or value moves neither the
    policy loss nor any gradient, and its own gradient is 0."""
    action, _, turn_ids, (logprobs, old, values), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    advantages, returns = macro_gae(old, values, action, segment_ids, 1.0, 0.9, "first")
    old = logprobs.detach() + 0.2 * old
    noise = torch.randn(action.shape, generator=g, dtype=torch.double)

    def grads(shift):
        lp = torch.where(action, logprobs, logprobs + 5 * shift).requires_grad_(True)
        vals = torch.where(action, values, values - 7 * shift).requires_grad_(True)
        loss = policy_loss(lp, torch.where(action, old, old + shift), torch.where(action, advantages, 9 * shift),
                           action, segment_ids, 0.2, granularity)[0]
        critic = value_loss(vals, torch.where(action, values, shift), torch.where(action, returns, -shift), action,
                            segment_ids, 0.5, "first")[0]
        (loss + critic).backward()
        return loss.detach(), critic.detach(), lp.grad, vals.grad

    base, moved = grads(torch.zeros_like(noise)), grads(noise)
    for a, b in zip(base, moved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (base[2][~action] == 0).all() and (base[3][~action] == 0).all()
    assert base[2][action].abs().sum() > 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighting", ["equal", "first", "unit"])
def test_value_loss_on_gaps_matches_reference(seed, weighting):
    action, _, turn_ids, (values, old, returns), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    returns = macro_gae(returns, old, action, segment_ids, 1.0, 0.9, weighting)[1]
    loss, _ = value_loss(values, old, returns, action, segment_ids, 0.3, weighting)
    _close(loss, value_loss_ref(values.tolist(), old.tolist(), returns.tolist(), segment_ids.tolist(), 0.3,
                                weighting))


def test_rules_see_the_real_tokens_and_are_cut_at_turns():
    """A single-turn rule (here fixed n-grams) runs on the right-padded mask of every real token; split_by_turns
    keeps its cuts, adds one at every turn start and drops the observation tokens."""
    action, real, turn_ids, _, _ = _batch(0)
    segment_ids = split_by_turns(fixed_ngram(real, 3), turn_ids)
    check_segment_ids(segment_ids, action)
    for b in range(action.shape[0]):
        for positions in segments_of_row(segment_ids[b].tolist()):
            assert len({t // 3 for t in positions}) == 1 and len(set(turn_ids[b, positions].tolist())) == 1


# ---- the `turn` termination rule and how every rule composes with the turns
def _segmentation_batch(rule: str, real, turn_ids, options=None):
    from marlhf.termination import SegmentationBatch, get_termination

    plugin = get_termination(rule)
    options = plugin.options(**(options or {})) if plugin.options is not None else None
    return plugin, SegmentationBatch(torch.zeros_like(turn_ids), real, None, None, options, seed=0, turn_ids=turn_ids)


@pytest.mark.parametrize("seed", range(3))
def test_turn_rule_makes_each_turn_one_macro_action(seed):
    from marlhf.termination import segment

    action, real, turn_ids, _, _ = _batch(seed)
    segment_ids, _ = segment(*_segmentation_batch("turn", real, turn_ids))
    check_segment_ids(segment_ids, action)
    assert torch.equal(segment_ids, turn_ids)  # every turn has action tokens: the ids are the turns'
    skipped = torch.where(turn_ids >= 2, turn_ids + 1, turn_ids)  # a turn without action tokens (e.g. cut at 0)
    assert torch.equal(segment(*_segmentation_batch("turn", real, skipped))[0], turn_ids)


def test_turn_rule_errors_in_one_line():
    from marlhf.termination import SegmentationBatch, get_termination, segment

    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^termination 'turn' needs the policy turn of each token"):
        segment("turn", SegmentationBatch(torch.zeros(2, 3, dtype=torch.long), mask, None, None, None, seed=0))
    bad = torch.tensor([[0, 0, 1], [1, 0, -1]])
    with pytest.raises(ValueError, match="nondecreasing"):
        segment("turn", SegmentationBatch(torch.zeros_like(bad), mask, None, None, None, seed=0, turn_ids=bad))
    assert get_termination("turn").reads_reference is False


@pytest.mark.parametrize("rule,options", [("fixed", {"ngram": 3}), ("fixed", {"ngram": 1}), ("randomized", None)])
def test_every_rule_is_cut_at_the_turns(rule, options):
    from marlhf.termination import segment

    action, real, turn_ids, _, _ = _batch(1)
    plugin, batch = _segmentation_batch(rule, real, turn_ids, options)
    alone = plugin.obj(batch)
    segment_ids, _ = segment(plugin, batch)
    check_segment_ids(segment_ids, action)
    for b in range(action.shape[0]):
        for positions in segments_of_row(segment_ids[b].tolist()):
            assert len(set(turn_ids[b, positions].tolist())) == 1 and len(set(alone[b, positions].tolist())) == 1
        starts = [positions[0] for positions in segments_of_row(segment_ids[b].tolist())]
        expected = [t for t in action[b].nonzero().flatten().tolist()
                    if t == 0 or turn_ids[b, t - 1] != turn_ids[b, t] or alone[b, t - 1] != alone[b, t]]
        assert starts == expected


def test_single_turn_rows_segment_as_before():
    """turn_ids 0 on every token of right-padded rows changes no rule's segments."""
    from marlhf.termination import segment

    lengths = torch.tensor([0, 1, 7, 12, 5])
    mask = torch.arange(12)[None, :] < lengths[:, None]
    turn_ids = torch.where(mask, 0, -1)
    for rule, options in (("fixed", {"ngram": 3}), ("randomized", None), ("turn", None)):
        plugin, batch = _segmentation_batch(rule, mask, turn_ids, options)
        with_turns = segment(plugin, batch)[0]
        if rule == "turn":
            assert torch.equal(with_turns, fixed_ngram(mask, None))
        else:
            assert torch.equal(with_turns, segment(plugin, dataclasses.replace(batch, turn_ids=None))[0])


# ---- turn-level GAE (Turn-PPO) = macro GAE over the turns with the value at each turn's first action token
def turn_gae_ref(rewards, values, turn_ids, gamma, lam, discount):
    """Turn-PPO per episode, from the formulas: turn k (action tokens t_k .. t_k + n_k - 1, observations skipped) has
    V_k = V(t_k), R_k = sum_i g^i r_{t_k + i} and a discount D_k (g = 1 and D_k = gamma per turn; g = gamma and
    D_k = gamma^n_k per token); A_k = R_k + D_k V_{k+1} - V_k + D_k lam A_{k+1}, V_K = 0, Q_k = A_k + V_k."""
    batch, width = rewards.shape
    adv, ret = torch.zeros(batch, width, dtype=torch.double), torch.zeros(batch, width, dtype=torch.double)
    for b in range(batch):
        turns = [(turn_ids[b] == k).nonzero().flatten().tolist() for k in range(int(turn_ids[b].max()) + 1)]
        running, next_value = 0.0, 0.0
        for positions in reversed(turns):
            g = gamma if discount == "token" else 1.0
            d = gamma ** len(positions) if discount == "token" else gamma
            reward = sum(g ** i * float(rewards[b, t]) for i, t in enumerate(positions))
            value = float(values[b, positions[0]])
            running = reward + d * next_value - value + d * lam * running
            next_value = value
            adv[b, positions], ret[b, positions] = running, running + value
    return adv, ret


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("discount", ["segment", "token"])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.9), (0.9, 1.0), (1.0, 0.95), (0.5, 0.0)])
def test_turn_level_gae_matches_turn_ppo_reference(seed, discount, gamma, lam):
    action, _, turn_ids, (rewards, values, _), _ = _batch(seed)
    adv, ret = macro_gae(rewards, values, action, turn_ids, gamma, lam, "first", "sum", discount)
    adv_ref, ret_ref = turn_gae_ref(rewards, values, turn_ids, gamma, lam, discount)
    _close(adv, adv_ref)
    _close(ret, ret_ref)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (0.97, 1.0)])
def test_discount_per_token_is_token_gae_under_a_lambda_schedule(seed, gamma, lam):
    """With discount 'token' and 'first', macro GAE at each segment's first token is token GAE (observations
    skipped) with lambda 1 inside a segment and lam where the next one starts; one-token segments are token GAE."""
    action, _, turn_ids, (rewards, values, _), g = _batch(seed)
    segment_ids = _random_segments(turn_ids, g)
    adv, _ = macro_gae(rewards, values, action, segment_ids, gamma, lam, "first", "sum", "token")
    for b in range(action.shape[0]):
        positions = action[b].nonzero().flatten().tolist()
        running, next_value, expected = 0.0, 0.0, {}
        for i in reversed(range(len(positions))):
            t = positions[i]
            starts_next = i + 1 < len(positions) and segment_ids[b, positions[i + 1]] != segment_ids[b, t]
            running = (float(rewards[b, t]) + gamma * next_value - float(values[b, t])
                       + gamma * (lam if starts_next else 1.0) * running)
            next_value, expected[t] = float(values[b, t]), running
        for t in segment_first_token(segment_ids)[b].nonzero().flatten().tolist():
            assert abs(float(adv[b, t]) - expected[t]) < 1e-9
    one_token = torch.where(action, action.long().cumsum(dim=1) - 1, -1)
    for a, b in zip(macro_gae(rewards, values, action, one_token, gamma, lam, "equal", "sum", "token"),
                    token_gae(rewards, values, action, gamma, lam)):
        torch.testing.assert_close(a, b)


def test_discount_per_token_takes_per_row_lambda_and_checks_its_options():
    action, _, turn_ids, (rewards, values, _), _ = _batch(0)
    lam = torch.linspace(0, 1, action.shape[0], dtype=torch.double)
    adv, _ = macro_gae(rewards, values, action, turn_ids, 0.9, lam, "first", "sum", "token")
    for b in range(action.shape[0]):
        row = slice(b, b + 1)
        _close(adv[row], turn_gae_ref(rewards[row], values[row], turn_ids[row], 0.9, float(lam[b]), "token")[0])
    with pytest.raises(ValueError, match="needs segment_reward='sum'"):
        macro_gae(rewards, values, action, turn_ids, 0.9, 0.9, "first", "mean", "token")
    with pytest.raises(ValueError, match="`discount` must be"):
        macro_gae(rewards, values, action, turn_ids, 0.9, 0.9, "first", "sum", "turn")
    from marlhf.estimators import GAEOptions

    with pytest.raises(ValueError, match="needs segment_reward 'sum'"):
        GAEOptions(discount="token", segment_reward="mean")


def test_discounted_reverse_cumsum_per_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.double)
    d = torch.rand(4, 6, generator=g, dtype=torch.double)
    d[0, 2] = 0.0
    expected = torch.zeros_like(x)
    for b in range(4):
        running = 0.0
        for t in reversed(range(6)):
            running = float(x[b, t]) + float(d[b, t]) * running
            expected[b, t] = running
    torch.testing.assert_close(discounted_reverse_cumsum(x, d), expected)
    constant = torch.full((4, 6), 0.7, dtype=torch.double)
    torch.testing.assert_close(discounted_reverse_cumsum(x, constant), discounted_reverse_cumsum(x, 0.7))


def test_gae_estimator_is_turn_ppo_with_the_turn_rule():
    from marlhf.estimators import AdvantageBatch, GAEOptions, get_estimator

    action, _, turn_ids, (rewards, values, _), _ = _batch(2)
    for discount in ("segment", "token"):
        options = GAEOptions(gamma=0.99, lam=0.9, discount=discount)
        adv, ret = get_estimator("gae").obj(AdvantageBatch(rewards, values, action, turn_ids, options, 1, "first"))
        adv_ref, ret_ref = turn_gae_ref(rewards, values, turn_ids, 0.99, 0.9, discount)
        _close(adv, adv_ref)
        _close(ret, ret_ref)


def test_per_turn_clipping_is_the_turns_joint_ratio():
    """A turn-sized macro action is clipped once, on the product of its action tokens' ratios: observations between
    turns take no part."""
    mask = torch.tensor([[True, True, False, False, True, False]])
    turn_ids = torch.tensor([[0, 0, -1, -1, 1, -1]])
    old = torch.zeros(1, 6, dtype=torch.double)
    logprobs = torch.tensor([[0.1, 0.1, 5.0, -5.0, -0.01, 3.0]], dtype=torch.double)
    advantages = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]], dtype=torch.double)
    loss, stats = policy_loss(logprobs, old, advantages, mask, turn_ids, clip=0.2)
    ratios = torch.tensor([0.2, -0.01], dtype=torch.double).exp()  # turn 0: exp(0.1 + 0.1), clipped at 1.2
    expected = -(2 * ratios[0].clamp(max=1.2) + ratios[1]) / 3
    _close(loss, expected)
    assert float(stats["clipfrac"]) == 0.5


# ---- GiGPO and GRPO / RLOO over episodes
def _gigpo_batch(seed: int, group_size: int, groups: int = 4, width: int = 16):
    """Episodes of `groups` prompts; anchor states drawn from a few ids per turn (turn 0: the prompt's one initial
    state), so that step groups form across and within episodes; an all-padding row and a one-turn episode too."""
    g = torch.Generator().manual_seed(seed)
    action, _, turn_ids = random_episodes(groups * group_size, width, g)
    turns = turn_ids.max(dim=1).values + 1
    k = max(int(turns.max()), 1)
    states = torch.randint(0, 3, (action.shape[0], k), generator=g)
    states[:, 0] = 0
    states = torch.where(torch.arange(k)[None, :] < turns[:, None], states, -1)
    rewards = torch.where(action, torch.randn(action.shape, generator=g, dtype=torch.double), 0.0)
    return rewards, action, turn_ids, states


def gigpo_ref(rewards, turn_ids, states, group_size, gamma, w, mode, statistics, eps=1e-6):
    """A transcription of the authors' computation (langfengQ/verl-agent, gigpo/core_gigpo.py: episode_norm_reward,
    build_step_group, step_norm_reward, compute_step_discounted_returns) on their layout, one row per step: each
    step row carries its episode's return and its own discounted step return; then back to our tokens."""
    rows = []  # (prompt, episode, turn, episode return, step return, state)
    for i in range(rewards.shape[0]):
        n = int((states[i] >= 0).sum())
        r = [float(rewards[i][turn_ids[i] == k].sum()) for k in range(n)]
        for k in range(n):
            step_return = sum(gamma ** (j - k) * r[j] for j in range(k, n))
            rows.append((i // group_size, i, k, sum(r), step_return, int(states[i, k])))

    def normalize(values_by_key, key, value, single_mean_zero):
        out = []
        for row in rows:
            scores = values_by_key[key(row)]
            if len(scores) == 1:
                mean, std = (0.0 if single_mean_zero else scores[0]), 1.0
            else:
                as_tensor = torch.tensor(scores, dtype=torch.double)
                mean, std = float(as_tensor.mean()), float(as_tensor.std())
            out.append(value(row) - mean if mode == "mean_norm" else (value(row) - mean) / (std + eps))
        return out

    by_prompt, seen, by_state = {}, set(), {}
    for row in rows:
        if statistics == "steps" or (row[0], row[1]) not in seen:
            by_prompt.setdefault(row[0], []).append(row[3])
            seen.add((row[0], row[1]))
        by_state.setdefault((row[0], row[5]), []).append(row[4])
    episode = normalize(by_prompt, lambda row: row[0], lambda row: row[3], True)
    step = normalize(by_state, lambda row: (row[0], row[5]), lambda row: row[4], False)
    out = torch.zeros_like(rewards)
    for row, a_episode, a_step in zip(rows, episode, step):
        out[row[1]][turn_ids[row[1]] == row[2]] = a_episode + w * a_step
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("mode,statistics", [("mean_norm", "steps"), ("mean_std_norm", "steps"),
                                             ("mean_std_norm", "episodes"), ("mean_norm", "episodes")])
def test_gigpo_matches_the_authors_computation(seed, group_size, mode, statistics):
    from marlhf.advantages import gigpo

    rewards, action, turn_ids, states = _gigpo_batch(seed, group_size)
    for gamma, w in ((0.95, 1.0), (1.0, 0.5)):
        advantages = gigpo(rewards, action, turn_ids, states, group_size, gamma, w, mode, statistics)
        torch.testing.assert_close(advantages, gigpo_ref(rewards, turn_ids, states, group_size, gamma, w, mode,
                                                         statistics), rtol=1e-9, atol=1e-9)
        assert (advantages[~action] == 0).all()


def test_gigpo_groups_steps_by_anchor_state():
    """Two episodes of one prompt; turn 1 of both starts from state 7, their other turns from states of their own:
    only the shared state compares their step returns."""
    from marlhf.advantages import gigpo

    action = torch.tensor([[True, False, True, False], [True, False, True, True]])
    turn_ids = torch.tensor([[0, -1, 1, -1], [0, -1, 1, 2]])
    states = torch.tensor([[0, 7, -1], [1, 7, 9]])
    rewards = torch.tensor([[0.0, 0, 1, 0], [0.0, 0, 0, 3]], dtype=torch.double)
    advantages = gigpo(rewards, action, turn_ids, states, 2, gamma=0.5, step_advantage_w=1.0)
    # episode returns 1 and 3 over 2 + 3 steps: mean (2 * 1 + 3 * 3) / 5 = 2.2; step returns at state 7: 1 and 1.5
    assert advantages[0].tolist() == pytest.approx([1 - 2.2, 0, 1 - 2.2 - 0.25, 0])
    assert advantages[1].tolist() == pytest.approx([3 - 2.2, 0, 3 - 2.2 + 0.25, 3 - 2.2])
    episodes = gigpo(rewards, action, turn_ids, states, 2, 0.5, 1.0, episode_statistics="episodes")
    assert episodes[0, 0] == pytest.approx(-1.0)


def test_gigpo_estimator_and_its_errors():
    from marlhf.advantages import gigpo
    from marlhf.estimators import AdvantageBatch, GiGPOOptions, get_estimator

    rewards, action, turn_ids, states = _gigpo_batch(0, 2)
    options = GiGPOOptions()
    batch = AdvantageBatch(rewards, None, action, turn_ids, options, 2, "first", turn_ids=turn_ids,
                           turn_state_ids=states)
    advantages, returns = get_estimator("gigpo").obj(batch)
    assert returns is None and get_estimator("gigpo").needs_critic is False
    assert torch.equal(advantages, gigpo(rewards, action, turn_ids, states, 2, 0.95, 1.0, "mean_norm", "steps"))
    moved = dataclasses.replace(batch, rewards=torch.where(action, rewards, 5.0))  # rewards on observations: ignored
    assert torch.equal(get_estimator("gigpo").obj(moved)[0], advantages)
    with pytest.raises(ValueError, match=r"^advantage 'gigpo' needs multi-turn episodes"):
        get_estimator("gigpo").obj(dataclasses.replace(batch, turn_state_ids=None))
    with pytest.raises(ValueError, match="-1 on a turn that has action tokens"):
        gigpo(rewards, action, turn_ids, torch.where(turn_ids.new_ones(states.shape).bool(), -1, states), 2)
    with pytest.raises(ValueError, match="multiple of group_size"):
        gigpo(rewards[:3], action[:3], turn_ids[:3], states[:3], 2)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_grpo_and_rloo_over_episodes(name):
    """One episode a row: its outcome is its rewards summed over its action tokens (the turns' rewards and KL), its
    advantage on its action tokens only; rewards on observation tokens change nothing."""
    from marlhf.advantages import grpo, rloo
    from marlhf.estimators import GRPOOptions, get_estimator
    from marlhf.estimators import AdvantageBatch

    rewards, action, turn_ids, states = _gigpo_batch(1, 4)
    options = GRPOOptions() if name == "grpo" else None
    batch = AdvantageBatch(torch.where(action, rewards, 3.0), None, action, turn_ids, options, 4, "first",
                           turn_ids=turn_ids, turn_state_ids=states)
    advantages, _ = get_estimator(name).obj(batch)
    outcomes = torch.tensor([float(rewards[i][action[i]].sum()) for i in range(action.shape[0])], dtype=torch.double)
    expected = grpo(outcomes, 4) if name == "grpo" else rloo(outcomes, 4)
    torch.testing.assert_close(advantages, torch.where(action, expected[:, None], 0.0))


def test_nan_on_observation_tokens_is_ignored_and_on_actions_refused():
    """Observation tokens may hold anything (as padding may): NaN there changes no advantage, loss or gradient; NaN
    on an action token is a one-line error naming the argument."""
    action, _, turn_ids, (rewards, values, logprobs), _ = _batch(3)
    nan = torch.full_like(rewards, float("nan"))
    expected = macro_gae(rewards, values, action, turn_ids, 0.9, 0.8, "first", "sum", "token")
    got = macro_gae(torch.where(action, rewards, nan), torch.where(action, values, nan), action, turn_ids, 0.9, 0.8,
                    "first", "sum", "token")
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(token_gae(rewards, values, action, 0.9, 0.8),
                    token_gae(torch.where(action, rewards, nan), values, action, 0.9, 0.8)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    loss = policy_loss(logprobs, logprobs.detach(), expected[0], action, turn_ids)[0]
    torch.testing.assert_close(loss, policy_loss(torch.where(action, logprobs, nan), logprobs.detach(), expected[0],
                                                 action, turn_ids)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="`rewards` holds NaN"):
        token_gae(torch.where(action, nan, rewards), values, action)
    empty = torch.zeros(2, 0, dtype=torch.bool)
    assert not has_gaps(empty) and token_gae(torch.zeros(2, 0), torch.zeros(2, 0), empty)[0].shape == (2, 0)
