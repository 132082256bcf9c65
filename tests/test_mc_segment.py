"""The `mc_segment` estimator: Monte-Carlo values at macro-action boundaries (VinePPO / SPO-chain).

The pure parts (boundary selection, the advantages) against slow per-row references; the value estimate against
the analytic values of a toy Markov chain (unbiased within 4 standard errors over 1000 seeds, and an off-by-one
prefix mutant is caught); in PPO, one engine call per step for all continuations, seeded per row, reproducible."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from marlhf.advantages import macro_gae, mc_segment_advantages
from marlhf.cli import build_parser
from marlhf.trainers.continuations import PrefixContinuations, join_continuations, prefixed_prompts
from marlhf.engines import Generation
from marlhf.engines.hf import HFEngine
from marlhf.estimators import AdvantageBatch, get_estimator
from marlhf.estimators.mc_segment import MCSegmentOptions, mc_boundary_values
from marlhf.logging_utils import read_metrics
from marlhf.segments import (broadcast_segments, fixed_ngram, keep_boundaries, num_segments, segment_first_token,
                             words)
from marlhf.trainers.ppo import PPOConfig, train_ppo
from marlhf.trainers.ppo_setup import mixed_seed
from tests.reference import random_batch, segments_of_row
from tests.sweeps import seeds
from tests.trainers.test_ppo import RECORDS, _config, count_e


def _random_segments(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged batch (lengths 0, 1 and the full width included) with random segment starts."""
    g = torch.Generator().manual_seed(seed)
    mask, _ = random_batch(batch, width, g)
    starts = torch.rand(mask.shape, generator=g) < 0.4
    return mask, words(mask, starts)


# ---------------------------------------------------------------------------------------------- pure functions
def keep_boundaries_ref(segment_ids: torch.Tensor, max_boundaries: int) -> torch.Tensor:
    out = torch.full_like(segment_ids, -1)
    for b, row in enumerate(segment_ids.tolist()):
        segments = segments_of_row(row)
        m = len(segments)
        kept = [i * m // max_boundaries for i in range(max_boundaries)] if m > max_boundaries else list(range(m))
        for s, positions in enumerate(segments):
            new_id = max(i for i, k in enumerate(kept) if k <= s)
            for t in positions:
                out[b, t] = new_id
    return out


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize("max_boundaries", [1, 2, 3, 5, 20])
def test_keep_boundaries_matches_reference(seed, max_boundaries):
    mask, segment_ids = _random_segments(9, 13, seed)
    kept = keep_boundaries(segment_ids, max_boundaries)
    assert torch.equal(kept, keep_boundaries_ref(segment_ids, max_boundaries))
    assert (kept.max(dim=1).values < max_boundaries).all() and torch.equal(kept >= 0, mask)
    assert torch.equal(kept[:, 0], segment_ids[:, 0])  # the first token's boundary is always kept
    with pytest.raises(ValueError, match="max_boundaries"):
        keep_boundaries(segment_ids, 0)


def test_keep_boundaries_spacing():
    segment_ids = torch.arange(10)[None, :]  # ten one-token segments
    assert keep_boundaries(segment_ids, 3).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2]]  # kept: 0, 3, 6
    assert keep_boundaries(segment_ids, 4).tolist() == [[0, 0, 1, 1, 1, 2, 2, 3, 3, 3]]  # kept: 0, 2, 5, 7


def mc_segment_advantages_ref(boundary_values, rewards, segment_ids):
    out = torch.zeros_like(rewards)
    for b, row in enumerate(segment_ids.tolist()):
        segments = segments_of_row(row)
        for s, positions in enumerate(segments):
            next_value = boundary_values[b, s + 1].item() if s + 1 < len(segments) else 0.0
            advantage = sum(rewards[b, t].item() for t in positions) + next_value - boundary_values[b, s].item()
            for t in positions:
                out[b, t] = advantage
    return out


@pytest.mark.parametrize("seed", seeds(4))
@pytest.mark.parametrize("one_segment", [False, True])
def test_mc_segment_advantages_matches_reference(seed, one_segment):
    mask, segment_ids = _random_segments(10, 9, seed)
    if one_segment:
        segment_ids = fixed_ngram(mask, None)
    g = torch.Generator().manual_seed(100 + seed)
    rewards = torch.where(mask, torch.randn(mask.shape, generator=g, dtype=torch.float64), 0.0)
    slots = int(segment_ids.max()) + 2  # a spare slot: ignored
    values = torch.randn(mask.shape[0], slots, generator=g, dtype=torch.float64)
    advantages = mc_segment_advantages(values, rewards, mask, segment_ids)
    torch.testing.assert_close(advantages, mc_segment_advantages_ref(values, rewards, segment_ids))
    assert (advantages[~mask] == 0).all() and (advantages[mask.sum(1) == 0] == 0).all()
    # macro GAE's TD error: gamma 1, lambda 0, the segment's value read at its first token
    gae = macro_gae(rewards, broadcast_segments(values, segment_ids), mask, segment_ids, 1.0, 0.0, "first")[0]
    torch.testing.assert_close(advantages, gae)
    if not one_segment:
        with pytest.raises(ValueError, match="more segments"):
            mc_segment_advantages(values[:, :1], rewards, mask, segment_ids)


def mc_segment_ref(segment_ids, rewards, max_boundaries, value, value_prompt):
    """Per row, from the definitions: the row's segments (without the first when not value_prompt: SPO-chain),
    the kept ones of them (`keep_boundaries_ref`'s rule) each absorbing those up to the next kept one; a macro
    action's tokens get its summed rewards + V(next action's first token) - V(its first token), V = 0 past the
    last; the tokens of no action get 0."""
    out = torch.zeros_like(rewards)
    for b, row in enumerate(segment_ids.tolist()):
        segments = segments_of_row(row)[0 if value_prompt else 1:]
        m = len(segments)
        kept = [i * m // max_boundaries for i in range(max_boundaries)] if m > max_boundaries else list(range(m))
        actions = [sum(segments[k : (kept[j + 1] if j + 1 < len(kept) else m)], []) for j, k in enumerate(kept)]
        for j, positions in enumerate(actions):
            next_value = value(b, actions[j + 1][0]) if j + 1 < len(actions) else 0.0
            advantage = sum(rewards[b, t].item() for t in positions) + next_value - value(b, positions[0])
            for t in positions:
                out[b, t] = advantage
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_boundaries", [1, 2, 5])
@pytest.mark.parametrize("value_prompt", [True, False])
def test_the_estimator_matches_reference(seed, max_boundaries, value_prompt):
    """The whole estimator against `mc_segment_ref` on random ragged batches, with a stand-in for the engine whose
    k-th continuation of row r's prefix of t tokens scores 10 r + t + k / 10 (V = 10 r + t + (K - 1) / 20): one
    call, at the kept boundaries only (never at token 0 without value_prompt); no call when nothing is valued."""
    mask, segment_ids = _random_segments(10, 9, seed)
    g = torch.Generator().manual_seed(200 + seed)
    rewards = torch.where(mask, torch.randn(mask.shape, generator=g, dtype=torch.float64), 0.0)
    calls = []

    def continue_and_score(rows, starts, k):
        calls.append(sorted(zip(rows.tolist(), starts.tolist())))
        return (10.0 * rows + starts).double()[:, None] + torch.arange(k, dtype=torch.float64) / 10

    options = MCSegmentOptions(mc_samples=3, max_boundaries=max_boundaries, value_prompt=value_prompt)
    batch = AdvantageBatch(rewards, None, mask, segment_ids, options, 1, "first", continue_and_score=continue_and_score)
    advantages, returns = get_estimator("mc_segment").obj(batch)
    expected = mc_segment_ref(segment_ids, rewards, max_boundaries, lambda b, t: 10.0 * b + t + 0.1, value_prompt)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    assert returns is None and len(calls) == 1 and (advantages[~mask] == 0).all()
    starts = {(b, t) for b, t in calls[0]}
    assert all(t > 0 for _, t in starts) != value_prompt or not mask.any()
    assert len(starts) == int(torch.minimum(num_segments(segment_ids) - (0 if value_prompt else 1),
                                            torch.tensor(max_boundaries)).clamp(min=0).sum())
    if not value_prompt:  # a row of one segment has nothing to value: all its tokens get 0, and no call is made
        whole = fixed_ngram(mask, None)
        calls.clear()
        nothing = get_estimator("mc_segment").obj(dataclasses.replace(batch, segment_ids=whole))[0]
        assert (nothing == 0).all() and calls == []


def test_prefixes_and_full_responses():
    prompt_ids, prompt_mask = torch.tensor([[0, 7, 8], [6, 7, 8]]), torch.tensor([[0, 1, 1], [1, 1, 1]]).bool()
    response_ids = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 9]])
    rows, lengths = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 3])
    ids, mask = prefixed_prompts(prompt_ids, prompt_mask, response_ids, rows, lengths, pad_token_id=0)
    assert ids.tolist() == [[0, 0, 7, 8, 1, 2], [0, 0, 0, 6, 7, 8], [6, 7, 8, 4, 5, 6]]
    assert mask.tolist() == [[False, False, True, True, True, True], [False, False, False, True, True, True],
                             [True] * 6]
    continuation = Generation(torch.tensor([[11, 12, 0], [13, 14, 15], [16, 0, 0]]),
                              torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).bool())
    ids, mask = join_continuations(response_ids, rows, lengths, continuation, width=4, pad_token_id=0)
    assert ids.tolist() == [[1, 2, 11, 12], [13, 14, 15, 0], [4, 5, 6, 16]]
    assert mask.sum(1).tolist() == [4, 3, 4]


# ---------------------------------------------------------------------------------------------- the toy problem
HIT, MISS, PROMPT = 1, 2, 3
STAY, JUMP = 0.7, 0.2  # P(hit | the previous token was a hit), P(hit | otherwise)


class MarkovEngine:
    """A fake engine: each continuation is a Markov chain over {hit, miss} that starts from the prefix's last token,
    drawn from its row's seed; never an EOS, so it runs to max_new_tokens. Counts its calls."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def generate(self, prompt_ids, prompt_mask, *, row_seeds, max_new_tokens, **sampling) -> Generation:
        self.calls.append(list(row_seeds))
        previous = prompt_ids[:, -1]
        uniforms = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64) for seed in row_seeds])
        tokens = []
        for u in uniforms.T:
            previous = torch.where(u < torch.where(previous == HIT, STAY, JUMP), HIT, MISS)
            tokens.append(previous)
        ids = torch.stack(tokens, dim=1)
        return Generation(ids, torch.ones_like(ids, dtype=torch.bool))


def analytic_value(prefix: list[int], length: int) -> float:
    """E[hits of the full response | prefix], responses of `length` tokens: the prefix's hits and the chain's."""
    hit = STAY if prefix and prefix[-1] == HIT else JUMP  # the prompt ends in PROMPT: not a hit
    expected = 0.0
    for _ in range(length - len(prefix)):
        expected += hit
        hit = hit * STAY + (1 - hit) * JUMP
    return prefix.count(HIT) + expected


LENGTH = 6
RESPONSES = torch.tensor([[HIT, HIT, MISS, HIT, MISS, MISS], [MISS, HIT, HIT, HIT, 0, 0], [HIT, 0, 0, 0, 0, 0]])


def _continuations(engine: MarkovEngine, run_seed: int, max_length: int = 64) -> PrefixContinuations:
    prompt_ids = torch.full((3, 2), PROMPT)

    def score(rows, prompt_ids, prompt_mask, response_ids, response_mask):
        return ((response_ids == HIT) & response_mask).sum(1).double()

    def generate(ids, mask, seeds, max_new_tokens):
        return engine.generate(ids, mask, row_seeds=seeds, max_new_tokens=max_new_tokens)

    return PrefixContinuations(prompt_ids, torch.ones_like(prompt_ids, dtype=torch.bool), RESPONSES, generate, score,
                               lambda row, length, sample: mixed_seed(run_seed, row, length + 1, sample), LENGTH, 0,
                               max_length)


def _toy_batch(continue_and_score, max_boundaries: int = 2, k: int = 4) -> AdvantageBatch:
    mask = RESPONSES > 0
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    rewards[torch.arange(3), mask.sum(1) - 1] = ((RESPONSES == HIT) & mask).sum(1).double()  # score, no KL
    return AdvantageBatch(rewards, None, mask, fixed_ngram(mask, 2), MCSegmentOptions(k, max_boundaries), 1, "first",
                          continue_and_score=continue_and_score)


def test_values_are_unbiased_on_a_markov_chain():
    """V(boundary) = E[score | prefix] analytically (the score counts hits of the full response, a 6-token Markov
    chain from the prefix's last token). The mean over 1000 seeds of the estimates of V, and of the estimator's
    advantages, is within 4 standard errors of the analytic value (0.08 to 0.09 for V at K = 4; at 3000 seeds the
    errors were within 1.6 standard errors, 0.025); an estimate that continues one token too late is not."""
    segment_ids = keep_boundaries(fixed_ngram(RESPONSES > 0, 2), 2)  # rows of 3, 2, 1 segments -> 2, 2, 1
    boundaries = [tuple(ix) for ix in segment_first_token(segment_ids).nonzero().tolist()]
    assert boundaries == [(0, 0), (0, 2), (1, 0), (1, 2), (2, 0)]  # row 0's boundary at 4 merged away
    expected = {(b, t): analytic_value(RESPONSES[b, :t].tolist(), LENGTH) for b, t in boundaries}
    expected_advantages = torch.zeros(RESPONSES.shape, dtype=torch.float64)
    for b, t in boundaries:
        next_t = [s for r, s in boundaries if r == b and s > t]
        score = float((RESPONSES[b] == HIT).sum())
        expected_advantages[b, segment_ids[b] == segment_ids[b, t]] = (
            (expected[(b, next_t[0])] if next_t else score) - expected[(b, t)])

    def estimates(shift: int) -> tuple[np.ndarray, np.ndarray]:
        values, advantages = [], []
        for run_seed in range(1000):
            engine = MarkovEngine()
            continuer = _continuations(engine, run_seed)
            shifted = (lambda r, t, k: continuer(r, t + shift, k)) if shift else continuer
            v = mc_boundary_values(shifted, segment_ids, 4)
            values.append([v[b, segment_ids[b, t]].item() for b, t in boundaries])
            advantages.append(get_estimator("mc_segment").obj(_toy_batch(shifted))[0].numpy())
            assert len(engine.calls) == 2  # one call per estimate: all rows and boundaries at once
        return np.array(values), np.array(advantages)

    def within_tolerance(samples: np.ndarray, target: np.ndarray) -> bool:
        error = np.abs(samples.mean(0) - target)
        tolerance = 4 * samples.std(0, ddof=1) / np.sqrt(len(samples)) + 1e-12
        return bool((error <= tolerance).all())

    target = np.array([expected[boundary] for boundary in boundaries])
    values, advantages = estimates(shift=0)
    assert within_tolerance(values, target), (values.mean(0), target)
    assert within_tolerance(advantages, expected_advantages.numpy()), (advantages.mean(0), expected_advantages)
    mutant_values, _ = estimates(shift=1)  # continues one token too late: biased
    assert not within_tolerance(mutant_values, target)


def test_continuations_are_seeded_per_row_and_reproducible():
    engine = MarkovEngine()
    batch = _toy_batch(_continuations(engine, 0), max_boundaries=3, k=3)
    first = get_estimator("mc_segment").obj(batch)[0]
    again = get_estimator("mc_segment").obj(_toy_batch(_continuations(engine, 0), max_boundaries=3, k=3))[0]
    assert torch.equal(first, again) and engine.calls[0] == engine.calls[1]
    boundaries = [(0, 0), (0, 2), (0, 4), (1, 0), (1, 2), (2, 0)]
    assert engine.calls[0] == [mixed_seed(0, b, t + 1, j) for b, t in boundaries for j in range(3)]
    other = get_estimator("mc_segment").obj(_toy_batch(_continuations(engine, 1), max_boundaries=3, k=3))[0]
    assert not torch.equal(first, other)


@pytest.mark.parametrize("max_length", [2 + LENGTH, 2 + LENGTH + 1, 2 + LENGTH + 3])
def test_continuations_split_into_calls_that_fit_max_length(max_length):
    """One call generates LENGTH - (shortest prefix) tokens for every row: when a longer prefix would take its row
    past max_length positions, the rows are split by prefix length into calls that each fit, and every score is
    the one the single call gives (a continuation depends on its prefix and seed only)."""
    rows, prefix_lengths = torch.tensor([0, 0, 1, 1, 2, 0]), torch.tensor([0, 2, 0, 3, 1, 5])
    one_call = _continuations(MarkovEngine(), 0)(rows, prefix_lengths, 2)

    class FittingEngine(MarkovEngine):
        def generate(self, prompt_ids, prompt_mask, *, row_seeds, max_new_tokens, **sampling):
            assert int(prompt_mask.sum(1).max()) + max_new_tokens <= max_length
            assert prompt_mask[:, -1].all()  # left-padded: every row's last column is real
            return super().generate(prompt_ids, prompt_mask, row_seeds=row_seeds, max_new_tokens=max_new_tokens)

    engine = FittingEngine()
    continuer = _continuations(engine, 0, max_length)
    torch.testing.assert_close(continuer(rows, prefix_lengths, 2), one_call, rtol=0, atol=0)
    distinct = len(set(prefix_lengths.tolist()))
    assert 1 < continuer.calls == len(engine.calls) <= distinct  # a call per prefix length at most
    assert sorted(seed for call in engine.calls for seed in call) == sorted(
        mixed_seed(0, r, t + 1, j) for r, t in zip(rows.tolist(), prefix_lengths.tolist()) for j in range(2))
    if max_length == 2 + LENGTH:  # no slack: only equal prefixes share a call
        assert continuer.calls == distinct
    with pytest.raises(ValueError, match="a prompt of 2 tokens plus max_response_length 6 exceeds max_length 7"):
        _continuations(MarkovEngine(), 0, 7)(rows, prefix_lengths, 1)


def test_options_and_errors():
    with pytest.raises(ValueError, match="option 'mc_samples' must be >= 1, got 0"):
        PPOConfig(advantage="mc_segment", advantage_options={"mc_samples": 0})
    with pytest.raises(ValueError, match="option 'max_boundaries' must be >= 1"):
        PPOConfig(advantage="mc_segment", advantage_options={"max_boundaries": 0})
    with pytest.raises(ValueError, match="needs the trainer's continue_and_score"):
        get_estimator("mc_segment").obj(_toy_batch(None))
    assert not get_estimator("mc_segment").needs_critic
    help_text = build_parser("ppo")._subparsers._group_actions[0].choices["ppo"].format_help()
    section = " ".join(help_text.split()).split("advantage estimator mc_segment (--advantage mc_segment", 1)[1]
    assert "--mc_samples MC_SAMPLES continuations sampled per kept boundary (K) (default: 4)" in section
    assert "always kept (default: 4) --value_prompt" in section.split("--max_boundaries MAX_BOUNDARIES", 1)[1]
    assert "(default: True) advantage estimator" in section.split("--value_prompt [true|false] value the", 1)[1]


# ---------------------------------------------------------------------------------------------- in PPO
def test_two_ppo_steps_one_engine_call_each_reproducible(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    """`--advantage mc_segment --advantage_options '{mc_samples: 2, max_boundaries: 3}'`: two steps log
    rollout/mc_tokens > 0; each step makes one engine call for the rollout and one for all its continuations,
    whose seeds are distinct and none a rollout seed; the same seed gives the same run."""
    calls = []
    real_generate = HFEngine.generate

    def counting_generate(self, prompt_ids, prompt_mask, **sampling):
        calls.append(list(sampling["row_seeds"]))
        return real_generate(self, prompt_ids, prompt_mask, **sampling)

    monkeypatch.setattr(HFEngine, "generate", counting_generate)
    args = build_parser("ppo").parse_args(["ppo", "--advantage", "mc_segment", "--advantage_options",
                                           "{mc_samples: 2, max_boundaries: 3}", "--ngram", "2"])
    options = PPOConfig.from_arguments(args).plugin_options("advantage")
    assert options == MCSegmentOptions(mc_samples=2, max_boundaries=3)
    runs = []
    for name in ("a", "b"):
        config = _config(tmp_path / name, advantage="mc_segment", ngram=2,
                         advantage_options={"mc_samples": 2, "max_boundaries": 3})
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        runs.append([{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(tmp_path / name
                                                                                                      / "ppo")])
    assert runs[0] == runs[1] and len(runs[0]) == 2
    for metrics in runs[0]:
        assert metrics["rollout/mc_tokens"] > 0 and metrics["rollout/tokens"] > 0
        assert "val/return_l2" not in metrics  # critic-free
    assert len(calls) == 8 and calls[:4] == calls[4:]  # per run: rollout, continuations, rollout, continuations
    rollout_seeds, mc_seeds = calls[0] + calls[2], calls[1] + calls[3]
    assert len(calls[0]) == 4 and 8 <= len(calls[1]) <= 4 * 3 * 2  # 4 rows, 1 to 3 boundaries each, 2 samples
    assert len(set(mc_seeds)) == len(mc_seeds) and not set(mc_seeds) & set(rollout_seeds)
