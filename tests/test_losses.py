import math

import pytest
import torch
import torch.nn.functional as F

from marlhf._checks import trusted_inputs
from marlhf.advantages import macro_gae
from marlhf.losses import bradley_terry_loss, dpo_loss, policy_loss, loss_units, value_loss
from marlhf.segments import fixed_ngram, perplexity, randomized_ngram, words
from tests.reference import policy_loss_ref, random_batch, value_loss_ref
from tests.sweeps import seeds


def _rollout(seed, batch=10, width=19, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(batch, width, g)
    old = -torch.rand(batch, width, generator=g, dtype=torch.double) * 3
    new = old + spread * torch.randn(batch, width, generator=g, dtype=torch.double)
    rewards = torch.randn(batch, width, generator=g, dtype=torch.double)
    values = torch.randn(batch, width, generator=g, dtype=torch.double)
    return mask, old, new, rewards, values, g


def _segmentations(mask, g):
    return {
        "token": fixed_ngram(mask, 1),
        "fixed4": fixed_ngram(mask, 4),
        "n_larger_than_rows": fixed_ngram(mask, 100),
        "whole": fixed_ngram(mask, None),
        "randomized": randomized_ngram(mask, generator=g),
        "perplexity": perplexity(mask, -torch.rand(mask.shape, generator=g)),
        "words": words(mask, torch.rand(mask.shape, generator=g) < 0.35),
    }


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize("granularity", ["macro", "token"])
def test_policy_loss_matches_reference(seed, granularity):
    mask, old, new, rewards, values, g = _rollout(seed)
    for name, ids in _segmentations(mask, g).items():
        adv, _ = macro_gae(rewards, values, mask, ids)
        loss, stats = policy_loss(new, old, adv, mask, ids, clip=0.2, ratio_granularity=granularity)
        expected, clipfrac = policy_loss_ref(new.tolist(), old.tolist(), adv.tolist(), ids.tolist(), 0.2, granularity)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12), name
        assert stats["clipfrac"].item() == pytest.approx(clipfrac, abs=1e-6), name


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("granularity,weighting", [("macro", "tokens"), ("token", "tokens"), ("macro", "uniform"),
                                                   ("macro", "geometric")])
def test_truncated_importance_sampling_matches_reference(seed, granularity, weighting):
    mask, old, new, rewards, values, g = _rollout(seed, spread=0.6)
    # the engine's log-probs: off from the trainer's by up to ~0.5 a token, so some segments hit the cap
    rollout = old + 0.5 * torch.randn(old.shape, generator=g, dtype=old.dtype)
    for name, ids in _segmentations(mask, g).items():
        adv, _ = macro_gae(rewards, values, mask, ids)
        loss, stats = policy_loss(new, old, adv, mask, ids, clip=0.2, ratio_granularity=granularity,
                                  segment_weighting=weighting, rollout_logprobs=rollout, tis_cap=1.5)
        expected, _ = policy_loss_ref(new.tolist(), old.tolist(), adv.tolist(), ids.tolist(), 0.2, granularity,
                                      weighting, rollout.tolist(), 1.5)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12), name
        assert 0 < stats["tis_weight_mean"].item() <= 1.5
        off, off_stats = policy_loss(new, old, adv, mask, ids, clip=0.2, ratio_granularity=granularity,
                                     segment_weighting=weighting)
        same, _ = policy_loss(new, old, adv, mask, ids, clip=0.2, ratio_granularity=granularity,
                              segment_weighting=weighting, rollout_logprobs=old, tis_cap=1.5)
        assert torch.equal(same, off) and "tis_weight_mean" not in off_stats  # on-policy engine: weights 1
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(new, old, adv, mask, ids, tis_cap=2.0)
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(new, old, adv, mask, ids, rollout_logprobs=rollout, tis_cap=0.0)


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("weighting", ["tokens", "uniform", "geometric"])
def test_segment_weightings_match_reference(seed, weighting):
    mask, old, new, rewards, values, g = _rollout(seed, spread=0.6)
    for name, ids in _segmentations(mask, g).items():
        adv, _ = macro_gae(rewards, values, mask, ids)
        loss, stats = policy_loss(new, old, adv, mask, ids, clip=0.2, segment_weighting=weighting)
        expected, clipfrac = policy_loss_ref(new.tolist(), old.tolist(), adv.tolist(), ids.tolist(), 0.2,
                                             weighting=weighting)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12), name
        assert stats["clipfrac"].item() == pytest.approx(clipfrac, abs=1e-6), name
        units = loss_units(mask, ids, weighting).item()
        assert units == (int(mask.sum()) if weighting != "uniform" else sum(len(set(r) - {-1}) for r in ids.tolist()))


def test_segment_weighting_gradients_on_the_issue_example():
    """One row of 6 tokens, advantage 1, ratio 1. Token-count weighting: a token's gradient is |tau| times the
    token-level one (-1/6 at n = 1, -1/2 at n = 3, -1 at n = 6; segments [1, 5]: -1/6 and -5/6). "uniform" and
    "geometric" give every token the same gradient whatever the segment lengths."""
    mask = torch.ones(1, 6, dtype=torch.bool)
    old = torch.zeros(1, 6, dtype=torch.double)
    adv = torch.ones(1, 6, dtype=torch.double)
    layouts = {"n1": fixed_ngram(mask, 1), "n3": fixed_ngram(mask, 3), "n6": fixed_ngram(mask, 6),
               "1+5": torch.tensor([[0, 1, 1, 1, 1, 1]])}

    def grad(ids, weighting):
        new = old.clone().requires_grad_(True)
        loss, _ = policy_loss(new, old, adv, mask, ids, segment_weighting=weighting)
        return torch.autograd.grad(loss, new)[0][0].tolist()

    expected_tokens = {"n1": [-1 / 6] * 6, "n3": [-1 / 2] * 6, "n6": [-1.0] * 6, "1+5": [-1 / 6] + [-5 / 6] * 5}
    for name, ids in layouts.items():
        assert grad(ids, "tokens") == pytest.approx(expected_tokens[name])
        assert grad(ids, "geometric") == pytest.approx([-1 / 6] * 6)  # the token-level gradient
        segments = int(ids.max()) + 1  # uniform: each segment weighs 1/segments, shared by its tokens' log-probs
        assert grad(ids, "uniform") == pytest.approx([-1 / segments] * 6)
    with pytest.raises(ValueError, match="segment_weighting"):
        policy_loss(old, old, adv, mask, layouts["n3"], segment_weighting="uniform", ratio_granularity="token")
    with pytest.raises(ValueError, match="segment_weighting"):
        policy_loss(old, old, adv, mask, layouts["n3"], segment_weighting="mean")


def test_one_token_segments_are_token_ppo_exactly():
    mask, old, new, rewards, values, _ = _rollout(11, batch=16, width=32)
    adv, _ = macro_gae(rewards, values, mask, fixed_ngram(mask, 1))
    new.requires_grad_(True)
    macro, macro_stats = policy_loss(new, old, adv, mask, fixed_ngram(mask, 1))
    (macro_grad,) = torch.autograd.grad(macro, new)
    token, token_stats = policy_loss(new, old, adv, mask, None)
    (token_grad,) = torch.autograd.grad(token, new)
    torch.testing.assert_close(macro, token, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(macro_grad, token_grad, rtol=1e-12, atol=1e-12)
    for key in macro_stats:
        torch.testing.assert_close(macro_stats[key], token_stats[key])
    # And token-mean PPO written out in full, as in CleanRL.
    ratio = torch.exp(new.detach() - old)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert token.item() == pytest.approx(per_token[mask].mean().item(), rel=1e-12)


def test_joint_ratio_is_clipped_per_segment():
    # Two tokens whose log-ratios cancel: the segment's joint ratio is 1 (no clipping), whereas
    # each token alone would be clipped.
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.5, -0.5]])
    adv = torch.ones(1, 2)
    _, macro = policy_loss(new, old, adv, mask, fixed_ngram(mask, None))
    _, token = policy_loss(new, old, adv, mask, fixed_ngram(mask, None), ratio_granularity="token")
    assert macro["clipfrac"].item() == 0.0 and macro["ratio_mean"].item() == pytest.approx(1.0)
    assert token["clipfrac"].item() == 0.5


def test_policy_loss_is_overflow_safe_for_long_segments():
    mask = torch.ones(2, 512, dtype=torch.bool)
    old = torch.zeros(2, 512)
    new = torch.full((2, 512), 0.5, requires_grad=True)  # summed log-ratio 256: exp overflows float32
    adv = torch.tensor([[1.0] * 512, [-1.0] * 512])
    loss, stats = policy_loss(new, old, adv, mask, fixed_ngram(mask, None))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert math.isfinite(stats["ratio_max"].item()) and math.isfinite(stats["approxkl"].item())


def test_policy_loss_gradcheck():
    mask, old, new, rewards, values, g = _rollout(3, batch=4, width=7, spread=0.05)
    for ids in (fixed_ngram(mask, 3), fixed_ngram(mask, None), None):
        adv, _ = macro_gae(rewards, values, mask, fixed_ngram(mask, 3) if ids is None else ids)
        new_leaf = new.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda lp: policy_loss(lp, old, adv, mask, ids)[0], (new_leaf,))


def test_policy_loss_edge_cases():
    empty = torch.zeros(3, 5, dtype=torch.bool)
    x = torch.zeros(3, 5)
    loss, stats = policy_loss(x, x, x, empty, fixed_ngram(empty, 2))
    assert loss.item() == 0.0 and stats["clipfrac"].item() == 0.0
    zero_width = torch.zeros(2, 0, dtype=torch.bool)
    loss, _ = policy_loss(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), zero_width, None)
    assert loss.item() == 0.0


def test_policy_loss_rejects_bad_input():
    mask, old, new, rewards, values, _ = _rollout(0, batch=3, width=5)
    adv = torch.zeros_like(new)
    bad = adv.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="`advantages`"):
        policy_loss(new, old, bad, mask)
    with pytest.raises(ValueError, match="`old_logprobs`"):
        policy_loss(new, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="`clip`"):
        policy_loss(new, old, adv, mask, clip=0.0)
    with pytest.raises(ValueError, match="`ratio_granularity`"):
        policy_loss(new, old, adv, mask, fixed_ngram(mask, 2), ratio_granularity="seq")
    with pytest.raises(ValueError, match="`segment_ids`"):
        policy_loss(new, old, adv, mask, torch.zeros(3, 5, dtype=torch.long))


@pytest.mark.parametrize("seed", seeds(3))
def test_num_slots_from_the_host_gives_the_same_losses(seed):
    """The trainer passes each piece's segment count from the host; the losses are then bit-identical, and a
    wrong count is an error naming it (with the value checks on)."""
    mask, old, new, rewards, values, g = _rollout(seed)
    for name, ids in _segmentations(mask, g).items():
        adv, returns = macro_gae(rewards, values, mask, ids)
        slots = int(ids.max()) + 1
        for weighting in ("tokens", "uniform", "geometric"):
            assert torch.equal(policy_loss(new, old, adv, mask, ids, segment_weighting=weighting)[0],
                               policy_loss(new, old, adv, mask, ids, segment_weighting=weighting, num_slots=slots)[0])
        for value_weighting in ("equal", "unit", "position", "first"):
            assert torch.equal(value_loss(new, old, returns, mask, ids, 0.2, value_weighting)[0],
                               value_loss(new, old, returns, mask, ids, 0.2, value_weighting, num_slots=slots)[0]), name
        with pytest.raises(ValueError, match="`num_slots` is"):
            policy_loss(new, old, adv, mask, ids, num_slots=slots + 1)
        with pytest.raises(ValueError, match="`num_slots` is"):
            value_loss(new, old, returns, mask, ids, num_slots=slots - 1)


def test_trusted_inputs_skip_only_the_value_checks():
    """Inside trusted_inputs() the checks that read values to the host are off (the caller checked once at
    its boundary); type and shape checks still run, and outside the block everything is checked again."""
    mask, old, new, rewards, values, _ = _rollout(0, batch=3, width=5)
    bad = torch.zeros_like(new)
    bad[2, 1] = float("nan")
    ids = fixed_ngram(mask, 2)
    with trusted_inputs():
        loss, _ = policy_loss(new, old, bad, mask, ids)
        assert torch.isnan(loss)
        value_loss(new, old, bad, mask, ids)
        with pytest.raises(ValueError, match="`old_logprobs`"):
            policy_loss(new, old[:, :3], bad, mask)
        with pytest.raises(ValueError, match="bool tensor"):
            policy_loss(new, old, bad, mask.long())
    with pytest.raises(ValueError, match="`advantages`"):
        policy_loss(new, old, bad, mask, ids)
    with pytest.raises(ValueError, match="`returns`"):
        value_loss(new, old, bad, mask, ids)


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("weighting", ["equal", "unit", "position", "first"])
def test_value_loss_matches_reference(seed, clip, weighting):
    mask, _, _, rewards, values, g = _rollout(seed)
    old_values = values + 0.3 * torch.randn(values.shape, generator=g, dtype=torch.double)
    for name, ids in _segmentations(mask, g).items():
        _, returns = macro_gae(rewards, old_values, mask, ids, value_weighting=weighting)
        loss, _ = value_loss(values, old_values, returns, mask, ids, clip, weighting)
        expected = value_loss_ref(values.tolist(), old_values.tolist(), returns.tolist(), ids.tolist(), clip, weighting)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12), name


def test_value_loss_token_path_equals_one_token_segments():
    mask, _, _, rewards, values, g = _rollout(5)
    old_values = values + 0.3 * torch.randn(values.shape, generator=g, dtype=torch.double)
    _, returns = macro_gae(rewards, old_values, mask, fixed_ngram(mask, 1))
    for clip in (None, 0.2):
        a, sa = value_loss(values, old_values, returns, mask, None, clip)
        b, sb = value_loss(values, old_values, returns, mask, fixed_ngram(mask, 1), clip)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(sa["vf_clipfrac"], sb["vf_clipfrac"])


def test_value_loss_gradcheck():
    mask, _, _, rewards, values, _ = _rollout(2, batch=4, width=6)
    ids = fixed_ngram(mask, 2)
    old_values = values.detach() + 0.01
    _, returns = macro_gae(rewards, old_values, mask, ids, value_weighting="position")
    leaf = values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v: value_loss(v, old_values, returns, mask, ids, None, "position")[0], (leaf,)
    )


def test_value_loss_rejects_bad_input():
    mask, _, _, _, values, _ = _rollout(0, batch=3, width=5)
    with pytest.raises(ValueError, match="`returns`"):
        value_loss(values, values, values[:, :2], mask)
    with pytest.raises(ValueError, match="`clip`"):
        value_loss(values, values, values, mask, clip=-0.1)


def test_bradley_terry_loss():
    chosen = torch.tensor([2.0, 0.0, -1.0, 3.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5, -1.0, 0.0])
    loss, stats = bradley_terry_loss(chosen, rejected)
    expected = sum(math.log1p(math.exp(-(c - r))) for c, r in zip([2.0, 0.0, -1.0, 3.0], rejected.tolist())) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["accuracy"].item() == 0.5  # a tie is not a win
    loss.backward()
    assert (chosen.grad < 0).all()  # raising a chosen score lowers the loss
    with pytest.raises(ValueError, match="`rejected_scores`"):
        bradley_terry_loss(chosen, rejected[:3])
    with pytest.raises(ValueError, match="`chosen_scores`"):
        bradley_terry_loss(torch.tensor([float("nan")]), torch.tensor([0.0]))


def test_dpo_loss():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=g, dtype=torch.double) for _ in range(4))
    for beta, smoothing in [(0.1, 0.0), (0.5, 0.2)]:
        loss, stats = dpo_loss(pc, pr, rc, rr, beta, smoothing)
        expected = 0.0
        for i in range(8):
            z = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
            expected += -(1 - smoothing) * math.log(1 / (1 + math.exp(-z))) - smoothing * math.log(1 / (1 + math.exp(z)))
        assert loss.item() == pytest.approx(expected / 8, rel=1e-9)
        assert stats["chosen_reward"].item() == pytest.approx((beta * (pc - rc)).mean().item())
    # At the reference the loss is log 2 whatever beta.
    same = torch.zeros(4)
    assert dpo_loss(same, same, same, same, beta=3.0)[0].item() == pytest.approx(math.log(2))
    leaf = pc.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: dpo_loss(x, pr, rc, rr, 0.3)[0], (leaf,))
    with pytest.raises(ValueError, match="`beta`"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="`ref_rejected_logps`"):
        dpo_loss(pc, pr, rc, rr[:3])
    with pytest.raises(ValueError, match="`label_smoothing`"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)


def test_logsigmoid_form_is_stable():
    big = torch.tensor([1e4])
    loss, _ = bradley_terry_loss(-big, big)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(-2e4)).item())


def test_released_per_token_critic_loss_on_the_issue_example():
    """values [0, 1, 2], segments [0, 0, 1], returns [0.5, 0.5, 2]: the released code regresses each token's value
    to its segment's return (0.0833, gradient [-1/6, 1/6, 0]); the paper's segment value (mean 0.5) is exact."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    ids = torch.tensor([[0, 0, 1]])
    returns = torch.tensor([[0.5, 0.5, 2.0]], dtype=torch.double)
    values = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.double, requires_grad=True)
    per_token, _ = value_loss(values, values.detach(), returns, mask, None)  # the trainer's "token" granularity
    released = 0.5 * ((values - returns) ** 2).mean()  # transcription: per-token squared error, token mean
    assert per_token.item() == pytest.approx(released.item()) == pytest.approx(1 / 12)
    (grad,) = torch.autograd.grad(per_token, values)
    assert grad[0].tolist() == pytest.approx([-1 / 6, 1 / 6, 0.0])
    segment, _ = value_loss(values, values.detach(), returns, mask, ids)
    assert segment.item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_aggregation_modes_match_transcriptions(mode):
    """verl's loss_agg_mode, written out per response; with one token per segment the policy loss is verl's."""
    mask, old, new, rewards, values, g = _rollout(5, spread=0.5)
    ids = fixed_ngram(mask, 1)
    adv, returns = macro_gae(rewards, values, mask, ids)
    loss, _ = policy_loss(new, old, adv, mask, ids, loss_agg_mode=mode)
    ratio = torch.exp(new - old)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    rows = [(per_token[b][mask[b]]) for b in range(mask.shape[0]) if mask[b].any()]
    expected = {"token-mean": per_token[mask].mean(),
                "seq-mean-token-mean": torch.stack([r.mean() for r in rows]).mean(),
                "seq-mean-token-sum": torch.stack([r.sum() for r in rows]).mean()}[mode]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    v_loss, _ = value_loss(values, values, returns, mask, None, loss_agg_mode=mode)
    squared = 0.5 * (values - returns) ** 2
    rows = [squared[b][mask[b]] for b in range(mask.shape[0]) if mask[b].any()]
    expected = {"token-mean": squared[mask].mean(), "seq-mean-token-mean": torch.stack([r.mean() for r in rows]).mean(),
                "seq-mean-token-sum": torch.stack([r.sum() for r in rows]).mean()}[mode]
    assert v_loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert loss_units(mask, ids, "tokens", mode).item() == (
        int(mask.sum()) if mode == "token-mean" else int(mask.any(1).sum()))


def test_released_aggregation_on_the_issue_example():
    """Responses of 1 and 3 tokens, advantages [1] and [0, 0, 0], ratio 1: released -0.5, token mean -0.25."""
    mask = torch.tensor([[True, False, False], [True, True, True]])
    zeros = torch.zeros(2, 3, dtype=torch.double)
    adv = torch.tensor([[1.0, 0, 0], [0, 0, 0]], dtype=torch.double)
    assert policy_loss(zeros, zeros, adv, mask, fixed_ngram(mask, 1))[0].item() == pytest.approx(-0.25)
    released = policy_loss(zeros, zeros, adv, mask, fixed_ngram(mask, 1), loss_agg_mode="seq-mean-token-mean")[0]
    assert released.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(zeros, zeros, adv, mask, None, loss_agg_mode="seq-mean")
    with pytest.raises(ValueError, match="segment_weighting"):
        policy_loss(zeros, zeros, adv, mask, None, segment_weighting="uniform", loss_agg_mode="seq-mean-token-sum")
