"""TEMPO / Prefix-to-Tree advantages (arXiv 2509.18314; code fatebreaker/tempo)."""

from collections import defaultdict

import pytest
import torch

from marlhf.advantages import grpo, prefix_tree_advantages
from tests.reference import random_batch
from tests.sweeps import seeds

PAD = -7  # not a token id: padding never matches a real token


def _group_batch(seed, groups=4, group_size=4, width=9, vocab=2):
    """Consecutive groups of responses over a tiny vocabulary, so that they share prefixes and branch; ragged
    (empty, length-1 and full rows), padded with PAD."""
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(groups * group_size, width, g)
    ids = torch.randint(0, vocab, mask.shape, generator=g)
    for b in range(1, ids.shape[0]):  # some rows copy a prefix of the row before: deeper shared branches
        if torch.rand((), generator=g) < 0.5:
            cut = int(torch.randint(0, width + 1, (), generator=g))
            ids[b, :cut] = ids[b - 1, :cut]
    scores = torch.randint(0, 3, (mask.shape[0],), generator=g).double() + torch.rand(mask.shape[0], generator=g)
    return scores, ids.masked_fill(~mask, PAD), mask, lengths


def tempo_authors(scores, responses, mask, group_size, norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    """A transcription of `compute_tempo_outcome_advantage` in fatebreaker/tempo at commit
    0a1c273d184a6ea31a384c8a665ad979db087810, verl/trainer/ppo/core_algos.py (token_level_rewards summed to `scores`,
    `index` = the group of each row): per row, walk its tokens while the mask is on; the branch is the rows of the
    previous branch (at first the whole group) with the same token id at this position (padding compared as it is);
    the token gets (R_i - group mean + branch mean - previous-branch mean) / (group std + epsilon); once the previous
    branch is the row alone, the rest of the row gets that value. Multiplied by the mask at the end."""
    index = [b // group_size for b in range(len(scores))]
    id2index = defaultdict(list)
    for i, uid in enumerate(index):
        id2index[uid].append(i)
    out = torch.zeros(responses.shape, dtype=scores.dtype)
    for i in range(len(scores)):
        group = [scores[k] for k in id2index[index[i]]]
        group_mean, group_std = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
        previous_branch = id2index[index[i]]
        for j in range(responses.shape[1]):
            if mask[i, j].item() == 0:
                break
            branch = [k for k in previous_branch if responses[i, j] == responses[k, j]]
            ancestor_mean = torch.mean(torch.stack([scores[k] for k in previous_branch]))
            branch_mean = torch.mean(torch.stack([scores[k] for k in branch]))
            value = scores[i] - group_mean + branch_mean - ancestor_mean
            out[i, j] = value / (group_std + epsilon) if norm_adv_by_std_in_grpo else value
            if len(previous_branch) == 1:
                out[i, j:] = out[i, j]
                break
            previous_branch = branch
    return out * mask


def prefix_tree_ref(scores, ids, lengths, group_size, normalize_std=True, eps=1e-6):
    """Straight from the definition: V(node) = mean score of the group's responses that begin with that prefix
    (the root: the whole group); token t of response i gets R_i - mean + V(y_{<=t}) - V(y_{<t}), over std + eps."""
    scores, rows = scores.tolist(), ids.tolist()
    out = [[0.0] * len(rows[0]) for _ in rows]
    for start in range(0, len(rows), group_size):
        members = range(start, start + group_size)
        group = torch.tensor([scores[k] for k in members], dtype=torch.double)
        mean, std = group.mean().item(), group.std().item() if group_size > 1 else 0.0

        def value(prefix):
            through = [scores[k] for k in members if lengths[k] >= len(prefix) and rows[k][:len(prefix)] == prefix]
            return sum(through) / len(through)

        for i in members:
            for t in range(lengths[i]):
                a = scores[i] - mean + value(rows[i][:t + 1]) - value(rows[i][:t])
                out[i][t] = a / (std + eps) if normalize_std else a
    return out


@pytest.mark.parametrize("seed", seeds(6))
@pytest.mark.parametrize("group_size", [2, 3, 5])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_the_authors_code(seed, group_size, normalize_std):
    """Against `tempo_authors`, the transcription of fatebreaker/tempo @ 0a1c273d184a6ea31a384c8a665ad979db087810,
    verl/trainer/ppo/core_algos.py::compute_tempo_outcome_advantage: the root, branches, responses that end at an
    inner node (prefixes of others), empty and length-1 responses included."""
    scores, ids, mask, _ = _group_batch(seed, groups=3, group_size=group_size)
    out = prefix_tree_advantages(scores, ids, mask, group_size, normalize_std)
    torch.testing.assert_close(out, tempo_authors(scores, ids, mask, group_size, normalize_std), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", seeds(6))
@pytest.mark.parametrize("group_size,vocab", [(2, 2), (4, 2), (4, 3), (8, 2), (16, 4)])
def test_matches_reference(seed, group_size, vocab):
    scores, ids, mask, lengths = _group_batch(seed, groups=2, group_size=group_size, width=11, vocab=vocab)
    for normalize_std in (True, False):
        out = prefix_tree_advantages(scores, ids, mask, group_size, normalize_std)
        expected = torch.tensor(prefix_tree_ref(scores, ids, lengths, group_size, normalize_std), dtype=out.dtype)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
        assert (out[~mask] == 0).all()


def test_a_response_that_ends_at_an_inner_node():
    """Response 1 is a prefix of response 0: it counts in the nodes it reaches, and the step past its end is a
    branch (0 continues, 1 stops)."""
    ids = torch.tensor([[5, 6, 7], [5, 6, PAD], [8, PAD, PAD]])
    mask = ids != PAD
    scores = torch.tensor([1.0, 0.0, 0.5], dtype=torch.double)
    out = prefix_tree_advantages(scores, ids, mask, 3, normalize_std=False)
    # V(root) = 0.5, V([5]) = V([5, 6]) = 0.5, V([5, 6, 7]) = 1, V([8]) = 0.5
    assert out.tolist() == [[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(out, tempo_authors(scores, ids, mask, 3, False))


@pytest.mark.parametrize("seed", seeds(4))
def test_identical_responses_give_grpo(seed):
    scores, ids, mask, _ = _group_batch(seed, groups=3, group_size=4)
    ids = ids.view(3, 4, -1)[:, :1].expand(-1, 4, -1).reshape(12, -1)  # every group: one response repeated
    mask = mask.view(3, 4, -1)[:, :1].expand(-1, 4, -1).reshape(12, -1)
    out = prefix_tree_advantages(scores, ids, mask, 4)
    expected = torch.where(mask, grpo(scores, 4)[:, None], 0.0)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", seeds(4))
def test_different_first_tokens_give_grpo_after_the_first(seed):
    """The first token moves from the root (the group mean) to a leaf's branch (the response's own score), so it
    gets twice GRPO's advantage, as the authors' code gives it; every later token gets GRPO's."""
    scores, ids, mask, _ = _group_batch(seed, groups=3, group_size=4, width=8)
    mask[:, 0] = True
    ids[:, 0] = torch.arange(12) % 4 + 10  # distinct first tokens within each group
    ids = ids.masked_fill(~mask, PAD)
    out = prefix_tree_advantages(scores, ids, mask, 4)
    g = grpo(scores, 4)
    torch.testing.assert_close(out[:, 0], 2 * g, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out[:, 1:], torch.where(mask[:, 1:], g[:, None], 0.0), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out, tempo_authors(scores, ids, mask, 4), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", seeds(4))
def test_correction_only_where_the_group_branches(seed):
    """The TD term (the advantage minus GRPO's) is 0 at every token whose parent node has one child."""
    scores, ids, mask, lengths = _group_batch(seed, groups=2, group_size=6, width=10)
    correction = prefix_tree_advantages(scores, ids, mask, 6, normalize_std=False) - torch.where(
        mask, grpo(scores, 6, normalize_std=False)[:, None], 0.0)
    rows = ids.tolist()
    for i, length in enumerate(lengths):
        members = range(i // 6 * 6, i // 6 * 6 + 6)
        for t in range(length):
            through_parent = [k for k in members if lengths[k] >= t and rows[k][:t] == rows[i][:t]]
            children = {tuple(rows[k][:t + 1]) if lengths[k] > t else None for k in through_parent}
            if len(children) == 1:
                assert correction[i, t].item() == pytest.approx(0.0, abs=1e-12)
    assert correction.abs().max() > 0.1  # the batch does branch


def test_group_of_one_and_edge_cases():
    ids = torch.tensor([[1, 2, PAD], [3, PAD, PAD]])
    mask = ids != PAD
    scores = torch.tensor([0.7, 0.2])
    # the authors' code divides by the std of one score (NaN); like grpo, marlhf refuses a group of one there
    assert torch.isnan(tempo_authors(scores, ids, mask, 1)).all()
    with pytest.raises(ValueError, match="`group_size`"):
        prefix_tree_advantages(scores, ids, mask, 1)
    out = prefix_tree_advantages(scores, ids, mask, 1, normalize_std=False)
    assert (out == 0).all() and torch.equal(out, tempo_authors(scores, ids, mask, 1, False))
    padding = torch.zeros(4, 3, dtype=torch.bool)
    assert (prefix_tree_advantages(torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.zeros(4, 3, dtype=torch.long),
                                   padding, 2) == 0).all()
    assert prefix_tree_advantages(scores, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool),
                                  2).shape == (2, 0)
    with pytest.raises(ValueError, match="`scores`"):
        prefix_tree_advantages(torch.tensor([float("nan"), 1.0]), ids, mask, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        prefix_tree_advantages(torch.tensor([1.0, 0.0]), ids, mask, 3)
    with pytest.raises(ValueError, match="`response_ids`"):
        prefix_tree_advantages(scores, ids[:, :2], mask, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_scores_get_the_float64_values_rounded_once(dtype):
    """The group statistics and node values are computed in float64: each advantage is the float64 reference's
    value of the scores rounded once to their dtype, and a group of equal scores (eight copies of 0.1, which
    float32 statistics turned into -0.0074) gets exactly 0 on every token, branches or not."""
    scores, ids, mask, lengths = _group_batch(3, groups=4, group_size=8, width=30, vocab=3)
    scores = scores.to(dtype)
    out = prefix_tree_advantages(scores, ids, mask, 8)
    expected = torch.tensor(prefix_tree_ref(scores.double(), ids, lengths, 8), dtype=torch.float64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=torch.finfo(dtype).eps / 2 * (1 + 1e-9),
                               atol=1e-12)
    equal = torch.full((32,), 0.1, dtype=dtype)
    assert (prefix_tree_advantages(equal, ids, mask, 8) == 0).all()
