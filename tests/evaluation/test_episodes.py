"""Evaluation over environment episodes: the summary's statistics against direct computations, and episodes of a
reasoning-gym task and a TextArena game played by a tiny model."""

from __future__ import annotations

import math

import pytest

from marlhf.evaluation.episodes import episode_summary, evaluate_episodes, wilson_interval
from marlhf.evaluation.passk import pass_at_k


def test_wilson_interval_against_known_values():
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)  # the textbook 95% interval of 8/10
    assert wilson_interval(0, 5)[0] == pytest.approx(0.0, abs=1e-12) and wilson_interval(5, 5)[1] == pytest.approx(1.0)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_episode_summary_per_task_pass_at_k():
    """Two tasks of three samples: task 0 solved once, task 1 never; pass@k is the mean over the tasks."""
    returns = [1.0, 0.0, 0.5, 0.0, -1.0, 0.0]
    summary = episode_summary(returns, [0, 0, 0, 1, 1, 1], ks=(1, 2, 4))
    assert summary["episodes"] == 6 and summary["success_rate"] == pytest.approx(1 / 6)
    assert summary["mean_return"] == pytest.approx(0.5 / 6)
    low, high = summary["mean_return_ci"]
    assert low < summary["mean_return"] < high
    assert summary["pass_at_k"]["pass@1"] == pytest.approx((pass_at_k(3, 1, 1) + 0.0) / 2)
    assert summary["pass_at_k"]["pass@2"] == pytest.approx(pass_at_k(3, 1, 2) / 2) and "pass@4" not in \
        summary["pass_at_k"]


def test_episodes_of_a_verifiable_task_and_a_game_with_a_tiny_model(make_tiny_causal_lm, tiny_tokenizer):
    pytest.importorskip("reasoning_gym", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    pytest.importorskip("textarena", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    from marlhf.envs.reasoning_gym import records

    policy = make_tiny_causal_lm().eval()
    tasks = records("chain_sum{size: 2, system_prompt: none}", "eval", 0)
    summary = evaluate_episodes("reasoning_gym:chain_sum", policy, tiny_tokenizer, seeds=[0, 1], tasks=tasks,
                                env_options={"system_prompt": "none"}, samples_per_task=2, ks=(1, 2))
    assert summary["episodes"] == 4 and summary["pass_at_k"]["num_problems"] == 2
    assert 0.0 <= summary["success_rate"] <= summary["success_rate_ci"][1] <= 1.0
    with pytest.raises(ValueError, match="several samples of a task need its record"):
        evaluate_episodes("textarena:GuessTheNumber-v0", policy, tiny_tokenizer, seeds=[0], samples_per_task=2)
