"""Evaluation over environment episodes: the summary's statistics against direct computations, episodes of a
reasoning-gym task and a TextArena game played by a tiny model, and `marlhf evaluate --env` on the 20-line example
environment (no library needed): its files, pass@k over a dataset's tasks, its one-line refusals."""

from __future__ import annotations

import json
import math

import pytest

from marlhf import cli
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


GUESS_ENV = "tests/fixtures/guess_env.py:GuessNumber"


def test_the_evaluate_command_plays_an_environment(tmp_path, tiny_model_dir, capsys):
    """`marlhf evaluate --env`: 5 episodes in batches of 2 (seeds 7 to 11), the summary printed and in summary.json,
    each episode in episodes.jsonl; the rollouts' counts summed over the batches."""
    argv = ["evaluate", "--model_name_or_path", str(tiny_model_dir), "--env", GUESS_ENV, "--num_samples", "5",
            "--seed", "7", "--batch_size", "2", "--multi_turn_options", "{max_turns: 3, max_turn_tokens: 4}",
            "--output_dir", str(tmp_path / "eval")]
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary and "pass_at_k" not in summary
    assert summary["episodes"] == summary["metrics"]["env/episodes"] == 5 and summary["env"] == GUESS_ENV
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "episodes.jsonl").read_text().splitlines()]
    assert [e["seed"] for e in episodes] == [7, 8, 9, 10, 11] and [e["task"] for e in episodes] == list(range(5))
    assert summary["mean_return"] == pytest.approx(sum(e["return"] for e in episodes) / 5)
    assert summary["metrics"]["env/turns"] == pytest.approx(sum(e["turns"] for e in episodes) / 5)
    assert summary["success_rate_ci"] == pytest.approx(list(wilson_interval(sum(e["return"] >= 1 for e in episodes), 5)))
    assert all(1 <= e["turns"] <= 3 for e in episodes)


def test_pass_at_k_of_a_dataset_of_tasks(tmp_path, tiny_model_dir):
    """Each of 2 tasks (records of a dataset file) played 3 times; pass@k from each task's successes."""
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"prompt": f"game {i}"}) + "\n" for i in range(2)))
    assert cli.main(["evaluate", "--model_name_or_path", str(tiny_model_dir), "--env", GUESS_ENV, "--dataset",
                     str(tmp_path / "tasks.jsonl"), "--pass_at_k", "1", "3", "--samples_per_prompt", "3",
                     "--multi_turn_options", "{max_turn_tokens: 4}", "--output_dir", str(tmp_path / "eval")]) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "episodes.jsonl").read_text().splitlines()]
    assert [e["task"] for e in episodes] == [0, 0, 0, 1, 1, 1] and len({e["seed"] for e in episodes}) == 6
    correct = [sum(e["return"] >= 1 for e in episodes if e["task"] == t) for t in (0, 1)]
    assert summary["pass_at_k"] == {"num_problems": 2, "pass@1": pytest.approx(sum(c / 3 for c in correct) / 2),
                                    "pass@3": pytest.approx(sum(c > 0 for c in correct) / 2)}


@pytest.mark.parametrize("flags, message", [
    (["--reward_model", "rm"], f"env='{GUESS_ENV}' with reward_model: an environment scores its episodes itself"),
    ([], f"env='{GUESS_ENV}' without a dataset: give num_samples"),
    (["--num_samples", "2", "--pass_at_k", "2"], "pass_at_k with env: every k <= samples_per_prompt"),
    (["--num_samples", "2", "--multi_turn_options", "{max_turn: 3}"],
     "block 'multi_turn_options' has no option 'max_turn' (did you mean 'max_turns'?)"),
])
def test_what_evaluate_env_refuses_is_one_line(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # a config the command refuses: a usage error
        cli.main(["evaluate", "--env", GUESS_ENV, *flags, "--output_dir", str(tmp_path / "eval")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "eval").exists()
