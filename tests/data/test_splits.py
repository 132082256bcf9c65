"""The seeded stage split: deterministic, disjoint, covering, sized by the rounded fractions."""

from __future__ import annotations

import pytest

from marlhf.data import TASKS, split_indices
from marlhf.data.loading import stage_rows


@pytest.mark.parametrize("num_rows", [0, 1, 7, 10, 1000, 1001])
def test_parts_are_disjoint_sorted_and_cover_every_row(num_rows):
    parts = split_indices(num_rows, (0.2, 0.4, 0.4), seed=1234)
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(num_rows))
    assert all(part == sorted(part) for part in parts)
    bounds = [0, round(0.2 * num_rows), round(0.6 * num_rows), num_rows]
    assert [len(p) for p in parts] == [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def test_split_is_deterministic_and_depends_on_the_seed():
    assert split_indices(500, (0.2, 0.8), seed=1234) == split_indices(500, (0.2, 0.8), seed=1234)
    assert split_indices(500, (0.2, 0.8), seed=1234) != split_indices(500, (0.2, 0.8), seed=1)


def test_split_is_a_shuffle_not_a_cut():
    sft, _, _ = split_indices(1000, (0.2, 0.4, 0.4), seed=1234)
    assert sft != list(range(200)) and max(sft) > 900


@pytest.mark.parametrize("fractions", [(), (0.5, 0.4), (0.0, 1.0), (1.2, -0.2)])
def test_bad_fractions_raise(fractions):
    with pytest.raises(ValueError, match="fractions"):
        split_indices(10, fractions, seed=0)


@pytest.mark.parametrize("task_name", ["tldr", "hh", "webgpt", "apps"])
def test_stage_rows_of_a_task_are_disjoint(task_name):
    task = TASKS[task_name]
    rows = list(range(1000))
    stages = [s for s in ("sft", "rm", "rl") if s in task.stage_fractions]
    taken = {stage: stage_rows(task, stage, rows, seed=1234) for stage in stages}
    for a in stages:
        for b in stages:
            if a < b:
                assert not set(taken[a]) & set(taken[b])
    if task.eval_split is None:  # WebGPT: a held-out 5% of the only split, disjoint from every stage
        heldout = stage_rows(task, "eval", rows, seed=1234)
        assert len(heldout) == 50
        assert sorted(heldout + [i for s in stages for i in taken[s]]) == rows
        assert [len(taken[s]) for s in stages] == [190, 380, 380]
    else:
        assert stage_rows(task, "eval", rows, seed=1234) == rows  # eval reads its own split whole
        assert sorted(i for s in stages for i in taken[s]) == rows
