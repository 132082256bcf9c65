"""`marlhf ppo --env`: PPO on episodes of an environment (docs/multiturn.md), the 20-line example environment
tests/fixtures/guess_env.py trained through the command line with a tiny model, for each estimator combination."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from marlhf import cli
from marlhf._checks import trusted_inputs
from marlhf.checkpoint import list_checkpoints
from marlhf.errors import MarlhfError
from marlhf.logging_utils import read_metrics
from marlhf.segments import num_segments
from marlhf.trainers import ppo
from marlhf.trainers.ppo import PPOConfig
from tests.fixtures.guess_env import GuessNumber
from tests.trainers.killed_run import run_until_killed

GUESS_ENV = "tests/fixtures/guess_env.py:GuessNumber"

COMBINATIONS = {
    "turn_ppo": ["--termination", "turn", "--advantage", "gae", "--value_weighting", "first"],
    "token_ppo": ["--termination", "fixed", "--ngram", "1", "--advantage", "gae"],
    "grpo": ["--advantage", "grpo", "--termination", "turn"],
    "gigpo": ["--advantage", "gigpo", "--termination", "turn"],
    "mc_segment": ["--advantage", "mc_segment", "--termination", "turn", "--mc_samples", "2"],
}


def _argv(tmp_path, model_dir, output_dir, *extra: str) -> list[str]:
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"game {i}"}) + "\n" for i in range(4)))
    return ["ppo", "--env", GUESS_ENV, "--model_name_or_path", str(model_dir), "--dataset", str(dataset),
            "--output_dir", str(output_dir), "--per_device_batch_size", "2", "--num_samples_per_prompt", "2",
            "--mini_batch_size", "4", "--max_prompt_length", "32", "--max_response_length", "8", "--max_length", "128",
            "--max_turns", "3", "--max_turn_tokens", "4", "--max_response_tokens", "48", "--max_steps", "2",
            "--save_steps", "0", "--learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--warmup_ratio", "0",
            "--lr_scheduler", "constant", "--seed", "3", *extra]


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_the_example_environment_trains_two_steps(tmp_path, tiny_model_dir, combination):
    output_dir = tmp_path / combination
    assert cli.main(_argv(tmp_path, tiny_model_dir, output_dir, *COMBINATIONS[combination])) == 0
    metrics = read_metrics(output_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["env/episodes"] == 4 and m["env/observation_tokens"] > 0 for m in metrics)
    assert metrics[0]["objective/kl"] == 0 != metrics[1]["objective/kl"]  # step 1's update moved the policy
    assert (output_dir / "model.safetensors").exists()
    assert all((m.get("rollout/mc_tokens", 0) > 0) == (combination == "mc_segment") for m in metrics)


def test_observation_tokens_carry_no_advantage_and_no_loss(tmp_path, tiny_model_dir, monkeypatch):
    """The step's experience as the update gets it: no reward, advantage or return on an observation token, and
    the update's gradients (policy and critic, through `_update_piece`) do not move when an observation token's
    old log-prob, advantage, value and return change."""
    captured = {}
    update = ppo.ppo_update

    def keep_first(run, experience):
        captured.setdefault("run", run)
        captured.setdefault("experience", experience)
        return update(run, experience)

    monkeypatch.setattr(ppo, "ppo_update", keep_first)
    assert cli.main(_argv(tmp_path, tiny_model_dir, tmp_path / "run", *COMBINATIONS["turn_ppo"],
                          "--max_steps", "1")) == 0
    run, experience = captured["run"], captured["experience"]
    observations = experience.response_mask & ~experience.action_mask
    assert observations.any() and experience.action_mask.any()
    for name in ("rewards", "advantages", "returns"):
        assert not getattr(experience, name)[observations].any(), name
    assert (experience.segment_ids[observations] == -1).all() and (experience.turn_ids[observations] == -1).all()
    perturbed = dataclasses.replace(experience, **{
        name: getattr(experience, name).masked_fill(observations, value)
        for name, value in (("logprobs", -7.0), ("advantages", 5.0), ("values", 3.0), ("returns", -2.0))})
    assert torch.equal(_update_gradients(run, experience), _update_gradients(run, perturbed))


def _update_gradients(run, experience) -> torch.Tensor:
    """The gradients of one update of all rows in one piece, policy's and critic's parameters flattened."""
    rows = list(range(experience.response_ids.shape[0]))
    for model in (run.policy, run.critic):
        model.zero_grad(set_to_none=True)
    num_slots = int(num_segments(experience.segment_ids).max())
    with trusted_inputs():
        ppo._update_piece(run, experience, ppo._mini_batch_loss_units(run, experience, rows), num_slots, True, True)
    grads = [p.grad.flatten() for model in (run.policy, run.critic) for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    return torch.cat(grads)


def test_resume_latest_continues_an_episode_run(tmp_path, tiny_model_dir):
    """Killed after step 2 with a checkpoint at step 1, `--resume latest` redoes step 2 as the uninterrupted run
    did: each episode's seed is the row's (seed, step, row), not a draw of the process."""
    argv = _argv(tmp_path, tiny_model_dir, tmp_path / "straight", *COMBINATIONS["turn_ppo"], "--save_steps", "1",
                 "--save_total_limit", "1")
    assert cli.main(argv) == 0
    crashed = PPOConfig.from_arguments(cli.build_parser("ppo").parse_args(argv))
    crashed = dataclasses.replace(crashed, output_dir=str(tmp_path / "crashed"))
    run_until_killed("marlhf.trainers.ppo", "PPOConfig", "train_ppo", crashed,
                     [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()],
                     kill_after=2, work_dir=tmp_path)
    assert list_checkpoints(tmp_path / "crashed") == [tmp_path / "crashed" / "checkpoint-1"]
    assert cli.main([*argv, "--output_dir", str(tmp_path / "crashed"), "--resume", "latest"]) == 0
    resumed, straight = (_without_timings(tmp_path / name) for name in ("crashed", "straight"))
    assert [m["step"] for m in resumed] == [1, 2] and resumed == straight


def _without_timings(output_dir) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "env/step_seconds", "env/generate_seconds"))}
            for m in read_metrics(output_dir)]


@pytest.mark.parametrize(("options", "refused"), [
    ({"reward_fns": ("tests.rewards.test_functions:count_e",)}, "reward_fns"),
    ({"advantage": "mc_segment", "termination": "fixed"},
     "advantage='mc_segment' with termination='fixed' (its continuations start at turn starts only)"),
    ({"old_logprobs_from": "sampling", "ppo_epochs": 2}, "old_logprobs_from='sampling'")])
def test_what_env_does_not_run_yet_is_refused_in_one_line(options, refused):
    with pytest.raises(ValueError, match=rf"^env='{GUESS_ENV}' with {re.escape(refused)}: not yet \(multi-turn "
                                         "training runs"):
        PPOConfig(env=GUESS_ENV, **options)
    with pytest.raises(ValueError, match="^env_options needs env"):
        PPOConfig(env_options={"turns": 2})


# ------------------------------------------------------------------------------- in rollout workers
def _metrics(output_dir, *also_without: str) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if k not in ("rollout/staleness", *also_without)}
            for m in _without_timings(output_dir)]


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: the slow suite
def test_rollout_workers_at_staleness_0_train_like_the_engine_in_process(tmp_path, tiny_model_dir, workers):
    """The workers make the environments and run the episodes themselves: every metric of the in-process run, bit
    for bit (with two workers each counts its own generate calls)."""
    here = tmp_path / "in_process"
    assert cli.main(_argv(tmp_path, tiny_model_dir, here, *COMBINATIONS["turn_ppo"])) == 0
    there = tmp_path / f"workers_{workers}"
    assert cli.main(_argv(tmp_path, tiny_model_dir, there, *COMBINATIONS["turn_ppo"], "--rollout_workers",
                          str(workers))) == 0
    calls = ("env/generate_calls",) if workers > 1 else ()
    assert _metrics(there, *calls) == _metrics(here, *calls)
    assert {m["rollout/staleness"] for m in read_metrics(there)} == {0.0}
    assert f"request 1: {4 // workers} rows" in (there / f"rollout_worker_{workers - 1}.log").read_text()


@pytest.mark.slow  # the default suite keeps staleness 0; staleness itself is tested in tests/trainers/test_async_ppo.py
def test_a_rollout_worker_runs_episodes_one_step_stale(tmp_path, tiny_model_dir):
    """max_staleness 1: step 2's episodes come from the policy before step 1's update, corrected by the decoupled
    loss on the engine's log-probs of the action tokens."""
    output_dir = tmp_path / "stale"
    assert cli.main(_argv(tmp_path, tiny_model_dir, output_dir, *COMBINATIONS["turn_ppo"], "--rollout_workers", "1",
                          "--max_staleness", "1", "--max_steps", "3")) == 0
    metrics = read_metrics(output_dir)
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(0 < m["policy/behaviour_weight_mean"] < 10 and m["env/episodes"] == 4 for m in metrics)
    assert metrics[1]["rollout/logprob_diff_max"] > 0  # a stale batch: behaviour and proximal policies differ


def test_the_engines_log_probs_of_the_actions_match_the_trainers(tmp_path, tiny_model_dir):
    """log_rollout_logprob_diff on episodes: the engine's log-probs (KV cache continued across turns) against the
    trainer's forward over the whole transcript, on the action tokens."""
    output_dir = tmp_path / "diff"
    assert cli.main(_argv(tmp_path, tiny_model_dir, output_dir, *COMBINATIONS["turn_ppo"],
                          "--log_rollout_logprob_diff", "true")) == 0
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in read_metrics(output_dir))


class BrokenGuess(GuessNumber):
    """GuessNumber whose second step raises."""

    def step(self, action_text):
        if self.tries == 1:
            raise KeyError("lost the number")
        return super().step(action_text)


def test_an_environment_failing_in_a_rollout_worker_stops_the_run_in_one_line(tmp_path, tiny_model_dir):
    argv = _argv(tmp_path, tiny_model_dir, tmp_path / "broken", *COMBINATIONS["turn_ppo"], "--rollout_workers", "1",
                 "--env", f"{__name__}:BrokenGuess", "--env_errors", "raise", "--max_turn_tokens", "1")
    config = PPOConfig.from_arguments(cli.build_parser("ppo").parse_args(argv))
    with pytest.raises(MarlhfError) as caught:
        ppo.train_ppo(config)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("rollout worker 0 (pid ")
    assert f"failed: environment '{__name__}:BrokenGuess' at turn 1 of episode " in message
    assert "step failed: KeyError: 'lost the number'" in message


class SeedLog(GuessNumber):
    """GuessNumber that logs its reset seeds (the trainer's process makes the environments)."""

    seeds: list[int] = []

    def reset(self, seed, task=None):
        SeedLog.seeds.append(seed)
        return super().reset(seed, task)


def test_a_prompts_episodes_share_their_environment_seed(tmp_path, tiny_model_dir):
    """num_samples_per_prompt 2: each step's 4 episodes reset in pairs of one seed (a prompt's group starts from one
    state, as verl-agent's groups do), the two prompts' seeds differ, and so do the steps'."""
    SeedLog.seeds = []
    argv = _argv(tmp_path, tiny_model_dir, tmp_path / "grpo", *COMBINATIONS["grpo"])
    argv[argv.index(GUESS_ENV)] = f"{__name__}:SeedLog"
    assert cli.main(argv) == 0
    seeds = SeedLog.seeds
    assert len(seeds) == 8 and all(seeds[i] == seeds[i + 1] for i in range(0, 8, 2))
    assert len(set(seeds[::2])) == 4
