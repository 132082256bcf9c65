"""Study III's side measurement (`benchmarks/credit_segments_side.py`): the boundary overlap and the forward counts
against hand-worked examples."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import credit_segments_side as side  # noqa: E402


def test_kept_positions_are_keep_boundaries_first_tokens():
    segment_ids = torch.tensor([
        [0, 0, 1, 1, 1, 2, 3, 3, 4, -1, -1],  # 5 segments (starts 0 2 5 6 8): the last merges into the 4th
        [0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1],  # 8 one-token segments: segments 0 2 4 6 kept
        [0, 0, 0, 1, 1, -1, -1, -1, -1, -1, -1],  # 2 segments: unchanged
    ])
    assert side.kept_positions(segment_ids, 4) == [[0, 2, 5, 6], [0, 2, 4, 6], [0, 3]]
    assert side.kept_positions(segment_ids, 1) == [[0], [0], [0]]


def test_boundaries_by_row_counts_k_copies_once():
    assert side.boundaries_by_row([0, 0, 0, 0, 1, 1], [0, 0, 5, 5, 3, 0], 3) == [[0, 5], [0, 3], []]


def test_overlap_hand_worked():
    mc5 = [[0, 5, 10, 15], [0, 5], [0, 5]]
    lp = [[0, 4, 10, 17], [0, 8], []]  # the empty row does not count
    out = side.overlap(mc5, lp)
    assert (out["positions"], out["identical"]) == (6, 3)
    assert out["share_identical"] == pytest.approx(0.5) and out["mean_row_share"] == pytest.approx(0.5)
    assert out["mean_distance"] == pytest.approx((0 + 1 + 0 + 2 + 0 + 3) / 6)
    out = side.overlap(mc5, lp, skip_first=True)  # [4, 10, 17] and [8]
    assert (out["positions"], out["identical"]) == (4, 1)
    assert out["share_identical"] == pytest.approx(0.25) and out["mean_row_share"] == pytest.approx((1 / 3 + 0) / 2)
    assert out["mean_distance"] == pytest.approx((1 + 0 + 2 + 3) / 4) and out["median_distance"] == 1.5
    assert math.isnan(side.overlap([[0]], [[0]], skip_first=True)["share_identical"])
    summary = side.boundary_summary(mc5[:2], lp[:2], [40, 5], [20, 10], 4)
    assert summary["share_rows_over_max"] == 1.0 and summary["low_prob_segments_before_keeping"]["mean"] == 22.5


class Echo(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids.float().sum()


def test_forward_counter_by_stage_model_and_kind():
    counter, model = side.ForwardCounter(), Echo()
    model.register_forward_pre_hook(counter.hook("policy"), with_kwargs=True)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    model(input_ids=torch.zeros(2, 3, dtype=torch.long))  # no stage: not counted
    counter.stage = "generation"
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=mask)  # prefill: 6 positions, 5 tokens
        model(input_ids=torch.zeros(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 4))  # decode
        model(input_ids=torch.zeros(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 5))
    counter.stage = "update"
    model(torch.zeros(2, 3, dtype=torch.long), mask)  # positional arguments, with gradients
    assert counter.counts == {
        "generation/policy/prefill": {"forwards": 1, "positions": 6, "tokens": 5},
        "generation/policy/decode": {"forwards": 2, "positions": 4, "tokens": 4},
        "update/policy/train": {"forwards": 1, "positions": 6, "tokens": 5}}


def test_cost_summary_parts_and_ratios():
    def c(positions, tokens, forwards=1):
        return {"forwards": forwards, "positions": positions, "tokens": tokens}
    counts = {"generation/policy/prefill": c(30, 20), "generation/policy/decode": c(40, 40, 10),
              "scoring/ref/forward": c(70, 60), "advantages/policy/prefill": c(100, 80),
              "advantages/policy/decode": c(200, 200, 20), "advantages/reward_model/forward": c(300, 250),
              "update/policy/train": c(70, 60), "update/critic/train": c(70, 60)}
    out = side.cost_summary(counts, rollout_tokens=40, mc_tokens=160)
    parts = out["parts"]
    assert parts["generation"] == c(70, 60, 11) and parts["scoring"] == c(70, 60)
    assert parts["mc_prefix_reencoding"] == c(100, 80) and parts["mc_decoding"] == c(200, 200, 20)
    assert parts["mc_scoring"] == c(300, 250) and parts["update_forward"] == c(140, 120, 2)
    assert out["forward"] == c(880, 770, 36) and out["backward"] == c(140, 120, 2)
    assert out["forward_tokens_per_rollout_token"] == pytest.approx(770 / 40)
    assert out["forward_positions_per_budget_token"] == pytest.approx(880 / 200)
    assert out["backward_positions_per_rollout_token"] == pytest.approx(140 / 40)
