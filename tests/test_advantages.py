import math

import pytest
import torch

from marlhf.advantages import (
    discounted_reverse_cumsum,
    grpo,
    kl_penalized_rewards,
    length_adaptive_lam,
    macro_gae,
    reinforce,
    rloo,
    token_gae,
    whiten,
)
from marlhf.segments import (fixed_ngram, num_segments, perplexity, randomized_ngram, segment_values,
                             split_last_token, words)
from tests.reference import macro_gae_ref, random_batch, segments_of_row, token_gae_ref, token_gae_schedule_ref
from tests.sweeps import seeds


def _ragged(seed, batch=9, width=21):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(batch, width, g)
    rewards = torch.randn(batch, width, generator=g, dtype=torch.double)
    values = torch.randn(batch, width, generator=g, dtype=torch.double)
    return mask, lengths, rewards, values, g


def _assert_close(actual: torch.Tensor, expected, mask):
    expected = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)
    assert (actual[~mask] == 0).all()


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_token_gae_matches_reference(seed, gamma, lam):
    mask, lengths, rewards, values, _ = _ragged(seed)
    adv, ret = token_gae(rewards, values, mask, gamma, lam)
    adv_ref, ret_ref = token_gae_ref(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    _assert_close(adv, adv_ref, mask)
    _assert_close(ret, ret_ref, mask)


def _segmentations(mask, g):
    yield "fixed1", fixed_ngram(mask, 1)
    yield "fixed3", fixed_ngram(mask, 3)
    yield "fixed50", fixed_ngram(mask, 50)  # n larger than every row
    yield "whole", fixed_ngram(mask, None)
    yield "randomized", randomized_ngram(mask, generator=g)
    yield "perplexity", perplexity(mask, -torch.rand(mask.shape, generator=g))
    yield "last_own", split_last_token(fixed_ngram(mask, 4), mask)
    yield "words", words(mask, torch.rand(mask.shape, generator=g) < 0.35)


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("weighting", ["equal", "unit", "position", "first"])
@pytest.mark.parametrize("segment_reward", ["sum", "mean"])
def test_macro_gae_matches_reference(seed, weighting, segment_reward):
    mask, _, rewards, values, g = _ragged(seed)
    for name, ids in _segmentations(mask, g):
        for gamma, lam in [(1.0, 0.95), (0.9, 0.7)]:
            adv, ret = macro_gae(rewards, values, mask, ids, gamma, lam, weighting, segment_reward)
            adv_ref, ret_ref = macro_gae_ref(
                rewards.tolist(), values.tolist(), ids.tolist(), gamma, lam, weighting, segment_reward
            )
            _assert_close(adv, adv_ref, mask)
            _assert_close(ret, ret_ref, mask)


@pytest.mark.parametrize("weighting", ["equal", "unit", "position", "first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.double])
def test_macro_gae_with_one_token_segments_is_token_gae(weighting, dtype):
    mask, _, rewards, values, _ = _ragged(7, batch=16, width=40)
    rewards, values = rewards.to(dtype), values.to(dtype)
    expected = token_gae(rewards, values, mask, 1.0, 0.95)
    actual = macro_gae(rewards, values, mask, fixed_ngram(mask, 1), 1.0, 0.95, weighting)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def _boundary_lams(ids_row: list[int], lam: float, shift: int = 0) -> list[float]:
    """Per-token lambda of the identity: the step from t to t + 1 is discounted by lam where a segment starts at
    t + 1, by 1 inside a segment (`shift` moves the boundaries: the wrong schedules the test must reject)."""
    starts = {positions[0] + shift for positions in segments_of_row(ids_row)}
    return [lam if t + 1 in starts else 1.0 for t in range(len(ids_row))]


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("lam", [0.95, 0.5, 0.0])
def test_macro_gae_with_first_is_token_gae_with_a_boundary_lambda_schedule(seed, lam):
    """At gamma 1 with `first`, a segment's TD error telescopes into its tokens' TD errors, so its advantage is
    token GAE at its first token under lambda 1 inside segments and `lam` at boundaries (advantages module)."""
    mask, lengths, rewards, values, g = _ragged(seed, batch=12, width=23)
    compared = 0
    for name, ids in _segmentations(mask, g):
        adv, ret = macro_gae(rewards, values, mask, ids, 1.0, lam, "first")
        for shift in (0, 1, -1):
            lams = [_boundary_lams(row, lam, shift) for row in ids.tolist()]
            adv_ref, ret_ref = token_gae_schedule_ref(rewards.tolist(), values.tolist(), lengths, 1.0, lams)
            firsts = [(b, positions[0]) for b, row in enumerate(ids.tolist()) for positions in segments_of_row(row)]
            got = torch.stack([adv[b, t] for b, t in firsts] + [ret[b, t] for b, t in firsts])
            expected = torch.tensor([adv_ref[b][t] for b, t in firsts] + [ret_ref[b][t] for b, t in firsts],
                                    dtype=got.dtype)
            if shift == 0:
                torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=name)
                compared += len(firsts)
            elif lam < 1 and any(len(segments_of_row(row)) > 1 for row in ids.tolist()) and name != "fixed1":
                # boundaries off by one: the identity must not hold (at ngram 1 every step is a boundary)
                assert not torch.allclose(got, expected, rtol=1e-6, atol=1e-6), (name, shift)
    assert compared > 100


def test_length_adaptive_lam():
    lam = length_adaptive_lam(torch.tensor([0, 1, 10, 20, 40, 100, 1000]), alpha=0.05)
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.8, 0.98]))
    torch.testing.assert_close(length_adaptive_lam(torch.tensor([50.0]), alpha=0.1), torch.tensor([0.8]))
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lam(torch.tensor([5]), alpha=0.0)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_per_row_lambda_equals_one_call_per_row(gamma):
    mask, _, rewards, values, g = _ragged(5, batch=10, width=17)
    lams = torch.rand(10, generator=g, dtype=torch.double)
    lams[0], lams[1] = 1.0, 0.0
    ids = randomized_ngram(mask, generator=g)
    for gae, extra in ((token_gae, ()), (macro_gae, (ids,))):
        adv, ret = gae(rewards, values, mask, *extra, gamma, lams)
        for b in range(10):
            row = slice(b, b + 1)
            adv_b, ret_b = gae(rewards[row], values[row], mask[row], *(x[row] for x in extra), gamma, float(lams[b]))
            torch.testing.assert_close(adv[row], adv_b, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(ret[row], ret_b, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="per-row `lam` must have shape"):
        token_gae(rewards, values, mask, lam=lams[:3])
    with pytest.raises(ValueError, match="per-row `lam`"):
        token_gae(rewards, values, mask, lam=torch.full((10,), float("nan")))


def test_one_segment_gives_one_advantage_per_row():
    mask, lengths, rewards, values, _ = _ragged(2)
    adv, ret = macro_gae(rewards, values, mask, fixed_ngram(mask, None), 1.0, 0.95)
    for b, n in enumerate(lengths):
        if n:
            assert torch.unique(adv[b, :n]).numel() == 1
            # One segment, gamma = 1, V_next = 0: A = sum of rewards - mean value.
            expected = rewards[b, :n].sum() - values[b, :n].mean()
            assert adv[b, 0].item() == pytest.approx(expected.item(), abs=1e-9)
            assert ret[b, 0].item() == pytest.approx(rewards[b, :n].sum().item(), abs=1e-9)


def test_segment_value_weightings_on_hand_example():
    ids = torch.tensor([[0, 0, 0, 1, -1]])
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0]])
    torch.testing.assert_close(segment_values(values, ids, "equal"), torch.tensor([[2.0, 4.0]]))
    torch.testing.assert_close(segment_values(values, ids, "unit"), torch.tensor([[3.0, 4.0]]))
    # Weights 1/3, 1/2, 1 normalised by H = 11/6.
    expected = (1 / 3 * 1 + 1 / 2 * 2 + 1 * 3) / (11 / 6)
    torch.testing.assert_close(segment_values(values, ids, "position"), torch.tensor([[expected, 4.0]]))
    torch.testing.assert_close(segment_values(values, ids, "first"), torch.tensor([[1.0, 4.0]]))


def test_first_value_is_the_start_state_value():
    """With "first", delta_tau = R_tau + V(start of tau+1) - V(start of tau): the TD error of the option that
    starts at the segment's first token, an SMDP step; no state inside the segment enters it."""
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = ids >= 0
    values = torch.tensor([[1.0, 10.0, 2.0, 20.0, 30.0, 3.0]])  # 10, 20, 30: states inside a segment
    rewards = torch.tensor([[0.1, 0.2, 0.0, 0.0, 0.5, 1.0]])
    adv, ret = macro_gae(rewards, values, mask, ids, gamma=1.0, lam=0.0, value_weighting="first")
    expected = torch.tensor([0.3 + 2.0 - 1.0, 0.5 + 3.0 - 2.0, 1.0 - 3.0])
    torch.testing.assert_close(adv[0], expected.repeat_interleave(torch.tensor([2, 3, 1])))
    changed = values.clone()
    changed[0, [1, 3, 4]] = -5.0  # inner states do not matter
    torch.testing.assert_close(macro_gae(rewards, changed, mask, ids, 1.0, 0.0, "first")[0], adv)


def test_gae_gradients():
    mask, _, rewards, values, _ = _ragged(4, batch=4, width=7)
    ids = fixed_ngram(mask, 3)
    rewards.requires_grad_(True)
    values.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r, v: macro_gae(r, v, mask, ids, 0.9, 0.8, "position"), (rewards, values))
    assert torch.autograd.gradcheck(lambda r, v: token_gae(r, v, mask, 0.9, 0.8), (rewards, values))


def test_discounted_reverse_cumsum_long_rows():
    x = torch.randn(3, 600, dtype=torch.double)
    expected = torch.zeros_like(x)
    running = torch.zeros(3, dtype=torch.double)
    for t in reversed(range(600)):
        running = x[:, t] + 0.95 * running
        expected[:, t] = running
    torch.testing.assert_close(discounted_reverse_cumsum(x, 0.95), expected)
    torch.testing.assert_close(discounted_reverse_cumsum(x, 1.0), x.flip(1).cumsum(1).flip(1))


def test_gae_rejects_bad_input():
    mask, _, rewards, values, _ = _ragged(0, batch=3, width=5)
    ids = fixed_ngram(mask, 2)
    nan_rewards = rewards.clone()
    nan_rewards[2, 0] = float("nan")  # row 2 has the full width, so position 0 is real
    with pytest.raises(ValueError, match="`rewards`"):
        macro_gae(nan_rewards, values, mask, ids)
    with pytest.raises(ValueError, match="`rewards`"):
        token_gae(nan_rewards, values, mask)
    with pytest.raises(ValueError, match="`values`"):
        token_gae(rewards, values[:, :4], mask)
    with pytest.raises(ValueError, match="`mask`"):
        token_gae(rewards, values, mask.long())
    with pytest.raises(ValueError, match="`segment_ids`"):
        macro_gae(rewards, values, mask, fixed_ngram(mask, 2)[:, :4])
    with pytest.raises(ValueError, match="`value_weighting`"):
        macro_gae(rewards, values, mask, ids, value_weighting="middle")
    with pytest.raises(ValueError, match="`segment_reward`"):
        macro_gae(rewards, values, mask, ids, segment_reward="max")
    with pytest.raises(ValueError, match="`lam`"):
        token_gae(rewards, values, mask, lam=1.5)


def test_kl_penalized_rewards_puts_score_on_last_real_token():
    mask, lengths = random_batch(6, 8, torch.Generator().manual_seed(9))
    logprobs, ref = -torch.rand(6, 8), -torch.rand(6, 8)
    scores = torch.arange(6, dtype=torch.float32) + 1
    rewards = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.05)
    for b, n in enumerate(lengths):
        for t in range(8):
            expected = -0.05 * (logprobs[b, t] - ref[b, t]).item() if t < n else 0.0
            if t == n - 1:
                expected += scores[b].item()
            assert rewards[b, t].item() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="`scores`"):
        kl_penalized_rewards(torch.tensor([float("nan")] * 6), logprobs, ref, mask, 0.05)
    with pytest.raises(ValueError, match="`kl_coef`"):
        kl_penalized_rewards(scores, logprobs, ref, mask, -1.0)


def test_sequence_level_estimators():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    expected_rloo = []
    for group in (scores[:3], scores[3:]):
        for i in range(3):
            others = [group[j].item() for j in range(3) if j != i]
            expected_rloo.append(group[i].item() - sum(others) / 2)
    torch.testing.assert_close(rloo(scores, 3), torch.tensor(expected_rloo))
    g = grpo(scores, 3)
    for k in range(2):
        group = scores[3 * k : 3 * k + 3]
        torch.testing.assert_close(g[3 * k : 3 * k + 3], (group - group.mean()) / (group.std() + 1e-6))
    torch.testing.assert_close(grpo(scores, 3, normalize_std=False), torch.tensor([-1.0, 0.0, 1.0, -1.0, -1.0, 2.0]))
    torch.testing.assert_close(reinforce(scores), scores - scores.mean())
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        rloo(scores, 4)
    with pytest.raises(ValueError, match="`group_size`"):
        rloo(scores, 1)
    with pytest.raises(ValueError, match="`scores`"):
        reinforce(torch.tensor([1.0, float("nan")]))


def _group_statistics_ref(scores: list[float], group_size: int) -> tuple[list[float], list[float]]:
    """RLOO and GRPO advantages in Python floats (float64), one group at a time, from the definitions."""
    rloo_out, grpo_out = [], []
    for start in range(0, len(scores), group_size):
        group = scores[start : start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (group_size - 1))
        rloo_out += [x - (sum(group) - x) / (group_size - 1) for x in group]
        grpo_out += [(x - mean) / (std + 1e-6) for x in group]
    return rloo_out, grpo_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_group_statistics_are_computed_in_float64(dtype):
    """A group of equal scores gets exactly 0 (eight float32 copies of 0.1 got -0.0074 when the group's mean and
    std were taken in float32), and on random groups every advantage is the float64 value of its scores rounded
    once to their dtype (relative error at most half a unit in the last place; float64 scores: the float64
    computation, to rounding)."""
    equal = torch.full((8,), 0.1, dtype=dtype)
    for out in (grpo(equal, 8), rloo(equal, 8), grpo(equal, 8, normalize_std=False)):
        assert out.dtype == dtype and (out == 0).all()
    g = torch.Generator().manual_seed(3)
    scores = (torch.randn(48, generator=g, dtype=torch.float64) * 3 + 0.7).to(dtype)
    rtol = 1e-12 if dtype == torch.float64 else torch.finfo(dtype).eps / 2 * (1 + 1e-9)
    for group_size in (2, 3, 8):
        expected_rloo, expected_grpo = _group_statistics_ref(scores.double().tolist(), group_size)
        for out, expected in ((rloo(scores, group_size), expected_rloo), (grpo(scores, group_size), expected_grpo)):
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), torch.tensor(expected, dtype=torch.float64), rtol=rtol,
                                       atol=1e-12)


def test_whiten():
    mask, lengths, x, _, _ = _ragged(5)
    out = whiten(x, mask)
    real = out[mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert real.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    assert (out[~mask] == 0).all()
    kept = whiten(x, mask, shift_mean=False)
    assert kept[mask].mean().item() == pytest.approx(x[mask].mean().item(), abs=1e-9)


def test_num_segments_of_macro_layouts():
    mask, lengths = random_batch(5, 12, torch.Generator().manual_seed(0))
    assert num_segments(fixed_ngram(mask, 5)).tolist() == [-(-n // 5) for n in lengths]


def test_weighted_segment_reward_is_the_released_modeling_macro_action():
    """The released code forms a segment's reward like its value: sum_i sigma_i r_i with the value weighting's
    sigma (its modeling_macro_action, transcribed here for equal and unit); gamma = lam = 1."""
    rewards = torch.tensor([[0.5, -1.0, 2.0, 0.25, 3.0]], dtype=torch.double)
    values = torch.tensor([[1.0, 0.5, -0.5, 2.0, 1.5]], dtype=torch.double)
    mask = torch.ones(1, 5, dtype=torch.bool)
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    pieces = [[0, 1], [2, 3, 4]]

    def released(variables, weighting):
        out = []
        for piece in pieces:
            part = variables[0, piece]
            sigma = torch.full_like(part, 1.0 / len(piece)) if weighting == "equal" else torch.zeros_like(part)
            if weighting == "unit":
                sigma[-1] = 1.0
            out.append(float((part * sigma).sum()))
        return out

    for weighting in ("equal", "unit"):
        seg_rewards, seg_values = released(rewards, weighting), released(values, weighting)
        expected = [seg_rewards[0] + seg_rewards[1] - seg_values[0], seg_rewards[1] - seg_values[1]]
        advantages, _ = macro_gae(rewards, values, mask, ids, 1.0, 1.0, weighting, "weighted")
        assert advantages[0, [0, 2]].tolist() == pytest.approx(expected)
    equal_mean, _ = macro_gae(rewards, values, mask, ids, 1.0, 0.9, "equal", "mean")
    equal_weighted, _ = macro_gae(rewards, values, mask, ids, 1.0, 0.9, "equal", "weighted")
    torch.testing.assert_close(equal_weighted, equal_mean)
