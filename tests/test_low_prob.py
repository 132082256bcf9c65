"""SPO's low-probability cutpoints and probability mask (arXiv 2505.23564; code AIFrameResearch/SPO)."""

import math

import numpy as np
import pytest
import torch

from marlhf._checks import check_segment_ids
from marlhf.advantages import low_prob_advantage_mask
from marlhf.segments import low_prob_cutpoints, low_prob_tokens
from tests.reference import random_batch, segments_of_row
from tests.sweeps import seeds


def _batch(seed, batch=10, width=25):
    """A ragged batch whose log-probs put about half the tokens below 0.9, some exactly at 0.9."""
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(batch, width, g)
    uniform = torch.rand(3, batch, width, generator=g, dtype=torch.double)
    probs = torch.where(uniform[0] < 0.5, uniform[1] * 0.9, 0.9 + 0.1 * uniform[1])
    probs[uniform[2] < 0.1] = 0.9  # on the threshold: not below it
    logprobs = probs.log()
    assert (logprobs.exp() == 0.9).any()
    logprobs[~mask] = float("nan")  # padding may hold anything
    return mask, lengths, logprobs


def low_prob_cutpoints_ref(lengths, width, logprobs, threshold, interval, min_tokens, max_tokens):
    """Per row, straight from the rule: low-probability positions, every interval-th kept, then left to right a
    kept cut starts a segment once the current one has min_tokens tokens, and any token once it has max_tokens."""
    rows = []
    for length, lp in zip(lengths, logprobs):
        lows = [t for t in range(length) if math.exp(lp[t]) < threshold]
        kept = set(lows[::interval])
        row, seg, current = [], -1, 0
        for t in range(length):
            if t == 0 or (t in kept and current >= (min_tokens or 1)) or (max_tokens and current >= max_tokens):
                seg, current = seg + 1, 0
            row.append(seg)
            current += 1
        rows.append(row + [-1] * (width - length))
    return rows


def spo_segments(logprobs_row: list[float], interval: int) -> list[list[int]]:
    """SPO's macro actions of one response, transcribed from AIFrameResearch/SPO at commit b9fc6a2,
    src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py:
    `_create_value_estimation_requests` takes cutpoints = np.where(exp(logprobs) < 0.9)[0] - 1, then
    cutpoints[::cutpoint_interval]; `_compute_token_advantages` puts a value at each cutpoint (a cutpoint -1 is the
    prompt's value, the base) and the score at the last token, then fills each token's advantage back from the next
    token that holds a value. The tokens that share one source are one macro action."""
    probs = np.exp(np.array(logprobs_row))
    cutpoints = (np.where(probs < 0.9)[0] - 1)[::interval]
    holds_value = [False] * len(logprobs_row)
    holds_value[-1] = True
    for cut in cutpoints:
        if cut >= 0:
            holds_value[cut] = True
    source = [None] * len(logprobs_row)
    for i in range(len(logprobs_row) - 1, -1, -1):
        source[i] = i if holds_value[i] else source[i + 1]
    pieces: dict[int, list[int]] = {}
    for i, s in enumerate(source):
        pieces.setdefault(s, []).append(i)
    return [pieces[s] for s in sorted(pieces)]


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize("interval", [1, 2, 3, 10])
def test_cutpoints_match_spo(seed, interval):
    """Against SPO's own cutpoints and segments (`spo_segments`, a transcription of AIFrameResearch/SPO at commit
    b9fc6a263dec54e28137fd488a9b9c0e0d026025)."""
    mask, lengths, logprobs = _batch(seed)
    ids = low_prob_cutpoints(mask, logprobs, 0.9, interval)
    check_segment_ids(ids, mask)
    for row, length, lp in zip(ids.tolist(), lengths, logprobs.tolist()):
        if length:
            assert segments_of_row(row) == spo_segments(lp[:length], interval)


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("interval,min_tokens,max_tokens",
                         [(1, None, None), (2, None, None), (1, None, 3), (3, None, 1), (1, 3, None), (2, 2, 5),
                          (1, 4, 4), (1, 1, None)])
def test_cutpoints_match_reference(seed, threshold, interval, min_tokens, max_tokens):
    mask, lengths, logprobs = _batch(seed)
    ids = low_prob_cutpoints(mask, logprobs, threshold, interval, min_tokens, max_tokens)
    check_segment_ids(ids, mask)
    assert ids.tolist() == low_prob_cutpoints_ref(lengths, mask.shape[1], logprobs.tolist(), threshold, interval,
                                                  min_tokens, max_tokens)
    lengths_of = [len(p) for row in ids.tolist() for p in segments_of_row(row)]
    if max_tokens:
        assert max(lengths_of, default=0) <= max_tokens


def test_cutpoints_hand_example():
    probs = torch.tensor([[0.95, 0.5, 0.99, 0.9, 0.3, 0.99, 0.2, 0.99]], dtype=torch.double)
    mask = torch.ones(1, 8, dtype=torch.bool)
    lp = probs.log()
    assert low_prob_cutpoints(mask, lp).tolist() == [[0, 1, 1, 1, 2, 2, 3, 3]]  # 0.9 is not below 0.9
    assert low_prob_cutpoints(mask, lp, interval=2).tolist() == [[0, 1, 1, 1, 1, 1, 2, 2]]
    assert low_prob_cutpoints(mask, lp, min_tokens=3).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert low_prob_cutpoints(mask, lp, max_tokens=2).tolist() == [[0, 1, 1, 2, 3, 3, 4, 4]]


def test_cutpoints_edge_cases_and_bad_input():
    empty = torch.zeros(2, 0, dtype=torch.bool)
    assert low_prob_cutpoints(empty, torch.zeros(2, 0)).shape == (2, 0)
    padding = torch.zeros(3, 4, dtype=torch.bool)
    assert (low_prob_cutpoints(padding, torch.full((3, 4), float("nan")), min_tokens=2) == -1).all()
    one = torch.tensor([[True, False]])
    assert low_prob_cutpoints(one, torch.tensor([[-5.0, 0.0]])).tolist() == [[0, -1]]
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="`logprobs`"):
        low_prob_cutpoints(mask, torch.tensor([[0.0, float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="`threshold`"):
        low_prob_cutpoints(mask, torch.zeros(1, 3), threshold=1.5)
    for kwargs, name in (({"interval": 0}, "interval"), ({"min_tokens": 0}, "min_tokens"),
                         ({"max_tokens": 2.0}, "max_tokens"), ({"min_tokens": 3, "max_tokens": 2}, "min_tokens")):
        with pytest.raises(ValueError, match=f"`{name}`"):
            low_prob_cutpoints(mask, torch.zeros(1, 3), **kwargs)


def spo_masked_advantages(advantages_row: list[float], logprobs_row: list[float]) -> list[float]:
    """What SPO's loss sees of one response's advantages, transcribed from AIFrameResearch/SPO at commit b9fc6a2:
    `_compute_token_advantages` (src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py) sets
    the advantage of every token with probability > 0.9 to 0, and the trainer (src/treetune/trainers/ppo_trainer.py,
    `use_prob_mask`) keeps only tokens with exp(old_logprobs) < 0.9 in the loss; a token out of the loss is 0 here."""
    probs = np.exp(np.array(logprobs_row))
    out = [0.0 if p > 0.9 else a for a, p in zip(advantages_row, probs)]
    return [a if p < 0.9 else 0.0 for a, p in zip(out, probs)]


@pytest.mark.parametrize("seed", seeds(4))
def test_advantage_mask_matches_spo(seed):
    """Against SPO's probability mask (`spo_masked_advantages`, a transcription of AIFrameResearch/SPO at commit
    b9fc6a263dec54e28137fd488a9b9c0e0d026025); probabilities exactly 0.9 included."""
    mask, lengths, logprobs = _batch(seed)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.double)
    out = low_prob_advantage_mask(advantages, logprobs, mask)
    for b, length in enumerate(lengths):
        expected = spo_masked_advantages(advantages[b, :length].tolist(), logprobs[b, :length].tolist())
        assert out[b, :length].tolist() == expected
        assert (out[b, length:] == 0).all()


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.9, 1.0])
def test_advantage_mask_per_segment(threshold):
    """A macro action's advantage stays only on its tokens below the threshold; one without such a token gives 0."""
    mask, _, logprobs = _batch(7)
    ids = low_prob_cutpoints(mask, logprobs, 0.5, max_tokens=4)
    seg_adv = torch.randn(mask.shape[0], mask.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.double)
    advantages = torch.where(mask, seg_adv.gather(1, ids.clamp(min=0)), 0.0)  # one advantage per segment
    out = low_prob_advantage_mask(advantages, logprobs, mask, threshold)
    for b, row in enumerate(ids.tolist()):
        for positions in segments_of_row(row):
            for t in positions:
                low = math.exp(logprobs[b, t].item()) < threshold
                assert out[b, t].item() == (advantages[b, t].item() if low else 0.0)
    assert torch.equal(low_prob_tokens(mask, logprobs, threshold), mask & (out != 0))


def test_advantage_mask_bad_input():
    mask = torch.tensor([[True, True, False]])
    lp = torch.tensor([[-1.0, -0.01, float("nan")]])
    assert low_prob_advantage_mask(torch.tensor([[2.0, 3.0, float("nan")]]), lp, mask).tolist() == [[2.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="`advantages`"):
        low_prob_advantage_mask(torch.tensor([[float("nan"), 3.0, 0.0]]), lp, mask)
    with pytest.raises(ValueError, match="`logprobs`"):
        low_prob_advantage_mask(torch.zeros(1, 3), torch.tensor([[float("nan"), 0.0, 0.0]]), mask)
    all_padding = torch.zeros(2, 3, dtype=torch.bool)
    assert (low_prob_advantage_mask(torch.ones(2, 3), torch.zeros(2, 3), all_padding) == 0).all()
