"""SkyRL-Gym: chat-message observations, per-turn rewards, the task from a dataset record (SkyRL's `extras`), a full
episode with a tiny model and with a scripted policy, and an environment that needs a server refused offline."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("skyrl_gym", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")

from marlhf.envs import check_observation, make_env  # noqa: E402
from marlhf.envs.skyrl_gym import read_tasks  # noqa: E402
from marlhf.errors import MarlhfError  # noqa: E402
from tests.envs.episodes import GSM8K_RECORD as RECORD, play  # noqa: E402


def test_a_tiny_model_plays_a_multi_turn_episode_of_chat_messages(tiny_policy):
    """gsm8k_multi_turn asks again after each wrong turn until its max_turns (3, from the record's extra_info)."""
    observations, rewards, terminated, _ = play(make_env("skyrl_gym:gsm8k_multi_turn"), tiny_policy, 0, RECORD)
    assert terminated and len(rewards) == 3 and all(check_observation(o) is None for o in observations)
    assert observations[0] == RECORD["prompt"] and observations[1][0]["role"] == "user"
    assert observations[-1] == [] and all(r in (0.0, 0.2 / 3) for r in rewards)


def test_per_turn_rewards_of_a_scripted_policy(tmp_path):
    """Per turn: 0 without the '#### N' format, the format share when formatted but wrong, 1 when right (which ends
    the episode). The record comes from a SkyRL dataset file: its chat prompt kept as "messages", which the episode
    starts from."""
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps(RECORD) + "\n")
    [task] = read_tasks(path)
    assert task["messages"] == RECORD["prompt"] and task["prompt"] == RECORD["prompt"][0]["content"]  # text: trainers'
    answers = iter(["Let me think.", "#### 70", "#### 72"])
    _, rewards, terminated, _ = play(make_env("skyrl_gym:gsm8k_multi_turn"), lambda _: next(answers), 0, task)
    assert terminated and rewards == [0.0, pytest.approx(0.2 / 3), 1.0]
    _, rewards, terminated, _ = play(make_env("skyrl_gym:gsm8k"), lambda _: "#### 72", 0, task)
    assert terminated and rewards == [1.0]


def test_bad_tasks_and_offline_refusals_are_one_line_errors():
    with pytest.raises(ValueError, match="a record of a SkyRL dataset with a 'prompt'"):
        make_env("skyrl_gym:gsm8k").reset(0, None)
    with pytest.raises(ValueError, match="the task record is refused"):
        make_env("skyrl_gym:gsm8k").reset(0, {"prompt": "2 + 2?"})
    with pytest.raises(MarlhfError, match="skyrl_gym:search cannot run offline: needs a network") as error:
        make_env("skyrl_gym:search")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="no environment 'gsm9k'"):
        make_env("skyrl_gym:gsm9k")
