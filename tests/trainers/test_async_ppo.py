"""Bounded-staleness PPO (PPOConfig.max_staleness, docs/async.md): the decoupled loss against a slow reference,
the staleness schedule, and runs with a rollout worker."""

from __future__ import annotations

import math

import pytest
import torch

from marlhf.advantages import macro_gae
from marlhf.losses import behaviour_weights, policy_loss
from marlhf.segments import fixed_ngram, randomized_ngram
from tests.reference import random_batch, segments_of_row


# ------------------------------------------------------------------------------- the loss, against a reference
def decoupled_loss_ref(logprobs, prox, behav, advantages, segment_ids, clip, cap, correction, granularity):
    """Decoupled PPO from its definition, one unit at a time: the ratio pi / pi_prox clipped around 1, the unit's
    surrogate times its behaviour weight w = prod over its tokens of pi_prox / pi_behav (decoupled: w, or 0 when
    w > cap; tis: min(w, cap)), times its token count, over the batch's tokens."""
    total, tokens = 0.0, 0
    for b in range(len(logprobs)):
        for positions in segments_of_row(segment_ids[b]):
            for group in ([positions] if granularity == "macro" else [[t] for t in positions]):
                ratio = math.exp(sum(logprobs[b][t] - prox[b][t] for t in group))
                a = advantages[b][group[0]]
                surrogate = max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
                w = math.prod(math.exp(prox[b][t] - behav[b][t]) for t in group)
                if cap is not None:
                    w = (w if w <= cap else 0.0) if correction == "decoupled" else min(w, cap)
                total += w * surrogate * len(group)
            tokens += len(positions)
    return total / max(tokens, 1)


def _stale_batch(seed: int, batch: int = 9, width: int = 13):
    g = torch.Generator().manual_seed(seed)
    mask, _ = random_batch(batch, width, g)  # ragged: lengths 0 (all padding), 1 and the full width among them
    prox = -torch.rand(batch, width, generator=g, dtype=torch.double) * 3
    behav = prox + 0.5 * torch.randn(batch, width, generator=g, dtype=torch.double)  # an older policy version
    new = prox + 0.3 * torch.randn(batch, width, generator=g, dtype=torch.double)
    rewards = torch.randn(batch, width, generator=g, dtype=torch.double)
    values = torch.randn(batch, width, generator=g, dtype=torch.double)
    return mask, prox, behav, new, rewards, values, g


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("correction", ["decoupled", "tis"])
@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("granularity", ["macro", "token"])
def test_decoupled_loss_matches_the_slow_reference(seed, correction, cap, granularity):
    mask, prox, behav, new, rewards, values, g = _stale_batch(seed)
    for ids in (fixed_ngram(mask, 1), fixed_ngram(mask, 3), randomized_ngram(mask, generator=g)):
        adv, _ = macro_gae(rewards, values, mask, ids)
        loss, stats = policy_loss(new, prox, adv, mask, ids, clip=0.2, ratio_granularity=granularity,
                                  behaviour_logprobs=behav, behaviour_cap=cap, staleness_correction=correction)
        expected = decoupled_loss_ref(new.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), ids.tolist(), 0.2,
                                      cap, correction, granularity)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert torch.isfinite(stats["behaviour_weight_mean"])


def test_decoupled_loss_on_policy_is_the_plain_loss_exactly():
    """Behaviour = proximal (max_staleness 0's rollout) gives weights 1: the plain loss and gradient, bit for bit;
    all-padding rows add nothing and make no NaN."""
    mask, prox, _, new, rewards, values, g = _stale_batch(0)
    mask[2:4] = False  # two more rows of padding only
    ids = fixed_ngram(mask, 3)
    adv, _ = macro_gae(rewards, values, mask, ids)
    for correction in ("decoupled", "tis"):
        plain_new = new.clone().requires_grad_()
        plain, _ = policy_loss(plain_new, prox, adv, mask, ids)
        plain.backward()
        stale_new = new.clone().requires_grad_()
        stale, stats = policy_loss(stale_new, prox, adv, mask, ids, behaviour_logprobs=prox.clone(),
                                   behaviour_cap=2.0, staleness_correction=correction)
        stale.backward()
        assert torch.equal(plain, stale) and torch.equal(plain_new.grad, stale_new.grad)
        assert stats["behaviour_weight_mean"].item() == 1.0 and stats["behaviour_dropped"].item() == 0.0
    empty = torch.zeros_like(mask)
    loss, _ = policy_loss(new, prox, adv, empty, fixed_ngram(empty, 3), behaviour_logprobs=prox - 1.0,
                          behaviour_cap=2.0)
    assert loss.item() == 0.0


def test_behaviour_weights_drop_or_truncate_above_the_cap():
    log_ratio = torch.tensor([[math.log(0.5), math.log(2.0), math.log(4.0), 0.0]])
    units = torch.tensor([[True, True, True, False]])
    assert behaviour_weights(log_ratio, units, 3.0, "decoupled")[0].tolist() == pytest.approx([0.5, 2.0, 0.0, 0.0])
    assert behaviour_weights(log_ratio, units, 3.0, "tis")[0].tolist() == pytest.approx([0.5, 2.0, 3.0, 0.0])
    assert behaviour_weights(log_ratio, units, None, "decoupled")[0].tolist() == pytest.approx([0.5, 2.0, 4.0, 0.0])
    with pytest.raises(ValueError, match="behaviour_cap"):
        behaviour_weights(log_ratio, units, 0.0)
    with pytest.raises(ValueError, match="staleness_correction"):
        behaviour_weights(log_ratio, units, 1.0, "clip")
    with pytest.raises(ValueError, match="two corrections"):
        policy_loss(log_ratio, log_ratio, log_ratio, units, behaviour_logprobs=log_ratio, rollout_logprobs=log_ratio,
                    tis_cap=2.0)
