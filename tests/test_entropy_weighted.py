"""GTPO / GRPO-S, Dynamic Entropy Weighting (Tan et al., arXiv 2508.04349). Its authors released no code, so the
tests compare with a per-group transcription of the paper's equations (3), (5), (6), (8), (9) and (1)/(46)."""

import statistics

import pytest
import torch

from marlhf.advantages import entropy_shaped_rewards, entropy_weighted, grpo
from tests.reference import random_batch
from tests.sweeps import seeds


def _batch(seed, groups=3, group_size=4, width=12, binary=True):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(groups * group_size, width, g)
    entropy = torch.rand(mask.shape, generator=g, dtype=torch.double) * 3
    entropy[torch.rand(mask.shape, generator=g) < 0.05] = 0.0  # a fully confident token
    entropy[~mask] = float("nan")  # padding may hold anything
    n = groups * group_size
    scores = (torch.rand(n, generator=g) < 0.5).double() if binary else torch.randn(n, generator=g, dtype=torch.double)
    return scores, entropy, mask, lengths


def shaped_ref(scores, entropy, lengths, group_size, level, a1, a2, threshold, eps):
    """Eq. (3) and (5) per token, or (8) and (9) per response, one group at a time with plain loops."""
    scores, entropy = scores.tolist(), entropy.tolist()
    width = len(entropy[0])
    out = [[0.0] * width for _ in scores] if level == "token" else [0.0] * len(scores)
    for start in range(0, len(scores), group_size):
        members = list(range(start, start + group_size))
        success = {k: scores[k] > threshold for k in members}
        if level == "token":
            for t in range(width):
                pos_h = [entropy[k][t] for k in members if success[k] and lengths[k] > t]
                pos = [k for k in members if success[k] and lengths[k] > t]  # d_t = len(pos)
                neg = [k for k in members if not success[k] and lengths[k] > t]  # h_t = len(neg)
                for i in pos:
                    out[i][t] = a1 * scores[i] + a2 * entropy[i][t] / max(sum(pos_h), eps) * len(pos)
                for j in neg:
                    share = (1 / (entropy[j][t] + eps)) / sum(1 / (entropy[k][t] + eps) for k in neg)
                    out[j][t] = -a1 - a2 * share * len(neg)
        else:
            mean_h = {k: sum(entropy[k][:lengths[k]]) / lengths[k] for k in members if lengths[k]}
            pos = [k for k in mean_h if success[k]]
            neg = [k for k in mean_h if not success[k]]
            for k in members:
                if success[k]:
                    bonus = mean_h[k] / max(sum(mean_h[p] for p in pos), eps) * len(pos) if k in mean_h else 0.0
                    out[k] = a1 * scores[k] + a2 * bonus
                else:
                    share = (1 / (mean_h[k] + eps)) / sum(1 / (mean_h[p] + eps) for p in neg) if k in mean_h else 0.0
                    out[k] = -a1 - a2 * share * len(neg)
    return out


def _standardized(values, eps):
    if len(values) < 2:
        return [0.0] * len(values)
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / (std + eps) for v in values]


def advantages_ref(scores, entropy, lengths, group_size, level, a1, a2, threshold, eps):
    """Eq. (6): successes' and failures' token rewards standardised apart, per group; GRPO-S: Eq. (1) over the
    group's shaped rewards, each response's advantage on all its tokens."""
    shaped = shaped_ref(scores, entropy, lengths, group_size, level, a1, a2, threshold, eps)
    width = entropy.shape[1]
    out = [[0.0] * width for _ in range(len(scores))]
    for start in range(0, len(scores), group_size):
        members = range(start, start + group_size)
        if level == "sequence":
            for k, a in zip(members, _standardized([shaped[k] for k in members], eps)):
                out[k][:lengths[k]] = [a] * lengths[k]
            continue
        for want in (True, False):
            cells = [(k, t) for k in members if (scores[k].item() > threshold) == want for t in range(lengths[k])]
            for (k, t), a in zip(cells, _standardized([shaped[k][t] for k, t in cells], eps)):
                out[k][t] = a
    return out


@pytest.mark.parametrize("seed", seeds(5))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("group_size", [1, 2, 4, 12])
@pytest.mark.parametrize("binary", [True, False])
def test_matches_the_papers_equations(seed, level, group_size, binary):
    scores, entropy, mask, lengths = _batch(seed, binary=binary)
    a1, a2, threshold, eps = (1.0, 0.1, 0.5, 1e-6) if binary else (0.9, 0.3, 0.2, 1e-4)
    shaped = entropy_shaped_rewards(scores, entropy, mask, group_size, level, a1, a2, threshold, eps)
    expected = shaped_ref(scores, entropy, lengths, group_size, level, a1, a2, threshold, eps)
    torch.testing.assert_close(shaped, torch.tensor(expected, dtype=shaped.dtype), rtol=1e-9, atol=1e-9)
    out = entropy_weighted(scores, entropy, mask, group_size, level, a1, a2, threshold, eps)
    expected = advantages_ref(scores, entropy, lengths, group_size, level, a1, a2, threshold, eps)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=out.dtype), rtol=1e-9, atol=1e-9)
    assert (out[~mask] == 0).all()


@pytest.mark.parametrize("seed", seeds(4))
def test_positive_reward_mass_is_conserved(seed):
    """Proposition 2.2: with r = 1, per group and position the successes' shaped rewards sum to (a1 + a2) d_t."""
    scores, entropy, mask, _ = _batch(seed, groups=4, group_size=5)
    shaped = entropy_shaped_rewards(scores, entropy, mask, 5, alpha1=0.9, alpha2=0.1)
    live_success = (mask & (scores > 0.5)[:, None]).view(4, 5, -1)
    sums = torch.where(live_success, shaped.view(4, 5, -1), 0.0).sum(dim=1)
    d_t = live_success.sum(dim=1).double()
    # where every live success is fully confident (sum H = 0) there is no bonus to share
    certain = torch.where(live_success, entropy.view(4, 5, -1), 0.0).sum(dim=1) == 0
    torch.testing.assert_close(sums, torch.where(certain, 0.9 * d_t, d_t), rtol=1e-9, atol=1e-9)
    assert d_t.max() >= 2


@pytest.mark.parametrize("seed", seeds(4))
def test_token_level_sets_are_standardized_apart(seed):
    scores, entropy, mask, _ = _batch(seed, groups=2, group_size=8, width=20)
    out = entropy_weighted(scores, entropy, mask, 8, eps=1e-12)
    for c in range(2):
        rows = slice(8 * c, 8 * c + 8)
        for want in (True, False):
            members = mask[rows] & ((scores[rows] > 0.5) == want)[:, None]
            if members.sum() > 1:
                values = out[rows][members]
                assert values.mean().item() == pytest.approx(0.0, abs=1e-9)
                assert values.std().item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("seed", seeds(4))
def test_grpo_s_with_equal_entropies_is_grpo(seed):
    """Equal mean entropies give every success a1 + a2 and every failure -(a1 + a2): an affine map of {0, 1}
    scores, so the standardised advantage is GRPO's."""
    scores, _, mask, _ = _batch(seed, groups=5, group_size=4)
    mask[:, 0] = True  # every response has a token
    entropy = torch.full(mask.shape, 0.7, dtype=torch.double)
    out = entropy_weighted(scores, entropy, mask, 4, "sequence")
    torch.testing.assert_close(out, torch.where(mask, grpo(scores, 4)[:, None], 0.0), rtol=1e-5, atol=1e-5)


def test_entropy_moves_credit_the_papers_way():
    """In a success the higher-entropy token gets more reward; in a failure the more confident one more penalty."""
    mask = torch.ones(4, 2, dtype=torch.bool)
    entropy = torch.tensor([[2.0, 0.5], [0.5, 0.5], [2.0, 0.5], [0.5, 0.5]])
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    shaped = entropy_shaped_rewards(scores, entropy, mask, 4)
    assert shaped[0, 0] > shaped[1, 0] and shaped[0, 1] == shaped[1, 1]
    assert shaped[2, 0] > shaped[3, 0] and shaped[2, 1] == shaped[3, 1]  # less penalty where less confident
    out = entropy_weighted(scores, entropy, mask, 4)
    assert out[0, 0] > out[1, 0] and out[2, 0] > out[3, 0]


def test_edge_cases_and_bad_input():
    mask = torch.tensor([[True, True], [True, False], [False, False], [True, True]])
    entropy = torch.tensor([[1.0, 0.5], [0.2, float("nan")], [float("nan")] * 2, [0.3, 0.3]])
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    for level in ("token", "sequence"):
        out = entropy_weighted(scores, entropy, mask, 1, level)  # a group of one has nothing to compare with
        assert (out == 0).all()
        assert (entropy_weighted(scores, entropy, mask, 2, level)[2] == 0).all()  # an empty response
    assert entropy_shaped_rewards(scores, entropy, mask, 2, "sequence")[2].item() == 1.0  # a1 r, no entropy term
    empty = torch.zeros(4, 0, dtype=torch.bool)
    assert entropy_weighted(scores, torch.zeros(4, 0), empty, 2).shape == (4, 0)
    for level in ("token", "sequence"):
        assert (entropy_weighted(scores, torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.bool), 4, level) == 0).all()
    with pytest.raises(ValueError, match="`entropy`"):
        entropy_weighted(scores, torch.full((4, 2), float("nan")), mask, 2)
    with pytest.raises(ValueError, match="`scores`"):
        entropy_weighted(torch.tensor([float("nan"), 0.0, 1.0, 0.0]), entropy, mask, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        entropy_weighted(scores, entropy, mask, 3)
    with pytest.raises(ValueError, match="`level`"):
        entropy_weighted(scores, entropy, mask, 2, "segment")
