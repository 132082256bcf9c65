"""reasoning-gym's tasks: records, the library's scorer (a raising scorer is 0 and counted), one-turn episodes with a
tiny model, and two PPO / GRPO / RLOO steps through train_ppo on `--dataset reasoning_gym:NAME`."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("reasoning_gym", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")

from marlhf.envs import make_env  # noqa: E402
from marlhf.envs import reasoning_gym as rg  # noqa: E402
from marlhf.envs.reasoning_gym import load_generated  # noqa: E402
from marlhf.logging_utils import read_metrics  # noqa: E402
from marlhf.trainers.ppo import train_ppo  # noqa: E402
from tests.envs.episodes import play  # noqa: E402
from tests.trainers.test_ppo import _config  # noqa: E402

TASKS = ("chain_sum", "basic_arithmetic", "prime_factorization", "spell_backward", "letter_counting")
REWARDS = ("marlhf.envs.reasoning_gym:score", "marlhf.envs.reasoning_gym:scorer_errors")


@pytest.mark.parametrize("name", TASKS)
def test_an_episode_of_one_turn_with_a_tiny_model_and_the_oracle_answer(name, tiny_policy):
    """Each task is one turn: the tiny model's answer gets the library's score (a number in [0, 1]); the entry's own
    answer in <answer> tags scores 1."""
    env = make_env(f"reasoning_gym:{name}", {"size": 8, "system_prompt": "direct"})
    observations, rewards, terminated, info = play(env, tiny_policy, seed=3)
    assert terminated and len(rewards) == 1 and 0.0 <= rewards[0] <= 1.0
    assert "<answer>" in observations[0] and isinstance(info["scorer_error"], bool)
    _, info = env.reset(3)
    assert env.step(f"<answer>{info['answer']}</answer>")[1] == 1.0


def test_a_raising_scorer_is_a_reward_of_0_counted_never_a_crash():
    """prime_factorization's scorer raises on a malformed product: the reward is 0, scorer_errors says 1, and the
    environment's step reports it in info."""
    record = rg.records("prime_factorization{size: 4}", "rl", 0)[0]
    entry, data = rg._entry_of(record["reasoning_gym"])
    with pytest.raises(Exception):  # the library's own scorer raises: what the adapter must absorb
        data.score_answer("x * y", entry)
    completions = ["<answer>x * y</answer>", f"<answer>{record['answer']}</answer>", "no tags at all"]
    fields = {"reasoning_gym": [record["reasoning_gym"]] * 3}
    assert rg.score([record["prompt"]] * 3, completions, **fields) == [0.0, 1.0, 0.0]
    assert rg.scorer_errors([record["prompt"]] * 3, completions, **fields) == [1.0, 0.0, 0.0]
    env = make_env("reasoning_gym:prime_factorization", {"size": 4})
    env.reset(0, record)
    assert env.step("<answer>x * y</answer>")[1:3] == (0.0, True) and env.step("")[4]["scorer_error"] is False


def test_records_are_deterministic_by_seed_with_a_held_out_eval_stream():
    first = load_generated("reasoning_gym:chain_sum{size: 6}", "rl", seed=1)
    assert first == load_generated("reasoning_gym:chain_sum{size: 6}", "rl", seed=1)
    assert [r["prompt"] for r in first] != [r["prompt"] for r in load_generated("reasoning_gym:chain_sum{size: 6}",
                                                                               "rl", seed=2)]
    held_out = load_generated("reasoning_gym:chain_sum{size: 6}", "eval", seed=1)
    assert not {r["prompt"] for r in first} & {r["prompt"] for r in held_out}
    assert len(load_generated("reasoning_gym:chain_sum{size: 6}", "rl", seed=1, max_samples=4)) == 4
    env = make_env("reasoning_gym:chain_sum", {"size": 6})
    assert env.reset(0, first[2])[0] == first[2]["prompt"]


def test_the_generator_options_reach_the_library():
    records = load_generated("reasoning_gym:chain_sum{size: 5, config: {min_terms: 2, max_terms: 2}, system_prompt: "
                           "none}", "rl", seed=0)
    assert all(r["prompt"].count("+") + r["prompt"].count("-") == 1 for r in records), records[0]["prompt"]


@pytest.mark.parametrize("spec, message", [
    ("reasoning_gym:chain_sums", "no task 'chain_sums' (did you mean 'chain_sum'?)"),
    ("reasoning_gym:chain_sum{config: {min_terms: 9, max_terms: 2}}", "options are refused"),
    ("reasoning_gym:chain_sum{config: {colour: 2}}", "options are refused"),
    ("reasoning_gym:chain_sum{size: 0}", "size"),
    ("reasoning_gym:chain_sum{size: [}", "not a YAML mapping"),
    ("reasoning_gym:chain_sum{sizes: 3}", "has no option 'sizes'"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=None) as error:
        load_generated(spec, "rl", seed=0)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_no_records_for_the_stages_that_need_responses():
    with pytest.raises(ValueError, match="rl and eval records only"):
        load_generated("reasoning_gym:chain_sum", "sft", seed=0)


@pytest.mark.parametrize("advantage", ["gae", "grpo", "rloo"])
def test_two_steps_through_the_trainer(tmp_path, advantage, make_tiny_causal_lm, tiny_tokenizer):
    """`--dataset reasoning_gym:chain_sum --reward_fns ...:score ...:scorer_errors --reward_weights 1 0`: two steps
    of PPO, GRPO and RLOO, each logging the scorer's mean and the share of raising scorers."""
    config = _config(tmp_path, dataset="reasoning_gym:chain_sum{size: 16, system_prompt: none}",
                     reward_fns=REWARDS, reward_weights=(1.0, 0.0), advantage=advantage, num_samples_per_prompt=2,
                     per_device_batch_size=2, mini_batch_size=4, max_prompt_length=128, max_length=144, kl_coef=0.0)
    train_ppo(config, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["rewards/score"] <= 1.0 and m["rewards/scorer_errors"] == 0.0 for m in metrics)
    assert all(math.isfinite(m["loss/policy"]) for m in metrics)

