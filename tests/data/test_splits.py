"""The seeded stage split: DeepSpeed-Chat's rule exactly (against a transcription of it), deterministic,
disjoint, covering."""

from __future__ import annotations

import numpy as np
import pytest

from marlhf.data import TASKS, split_indices
from marlhf.data.loading import stage_rows


def ds_chat_split_index(seed: int, data_split: str, split_index: int, data_size: int) -> list[int]:
    """DeepSpeed-Chat's get_raw_dataset_split_index and get_shuffle_idx (dschat/utils/data/data_utils.py),
    transcribed without the index files."""
    splits = [float(s) for s in data_split.split(",")]
    splits_sum = sum(splits)
    splits = [split / splits_sum for split in splits]
    splits_index = [0]
    for index, split in enumerate(splits):
        splits_index.append(splits_index[index] + int(round(split * float(data_size))))
    diff = splits_index[-1] - data_size
    for index in range(1, len(splits_index)):
        splits_index[index] -= diff
    assert splits_index[-1] == data_size
    np_rng = np.random.RandomState(seed=seed)
    shuffle_idx = np.arange(start=0, stop=data_size, step=1, dtype=np.uint32)
    np_rng.shuffle(shuffle_idx)
    return shuffle_idx[splits_index[split_index]:splits_index[split_index + 1]].tolist()


@pytest.mark.parametrize("num_rows", [0, 1, 7, 10, 15, 1000, 1001, 19578, 92858])
@pytest.mark.parametrize("split", [("2,4,4", (0.2, 0.4, 0.4)), ("2,8", (0.2, 0.8)), ("95,5", (0.95, 0.05))])
def test_parts_are_deepspeed_chats(num_rows, split):
    data_split, fractions = split
    parts = split_indices(num_rows, fractions, seed=1234)
    assert parts == [ds_chat_split_index(1234, data_split, i, num_rows) for i in range(len(fractions))]
    assert sorted(i for part in parts for i in part) == list(range(num_rows))


def test_webgpt_stages_are_deepspeed_chats_subset_of_a_subset():
    """WebGPT: the stages split the 95 % training part in its shuffled order. Of 19,578 rows, 18,599 train;
    sizes round to 3,720 + 7,440 + 7,440 = 18,600, so every boundary moves back one: 3,719 SFT rows."""
    task, rows = TASKS["webgpt"], list(range(19578))
    train = ds_chat_split_index(1234, "95,5", 0, len(rows))
    for index, stage in enumerate(("sft", "rm", "rl")):
        expected = sorted(train[i] for i in ds_chat_split_index(1234, "2,4,4", index, len(train)))
        assert stage_rows(task, stage, rows, seed=1234) == expected
    assert len(stage_rows(task, "sft", rows, seed=1234)) == 3719
    assert stage_rows(task, "eval", rows, seed=1234) == sorted(ds_chat_split_index(1234, "95,5", 1, len(rows)))


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
