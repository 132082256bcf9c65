"""The token budget of a PPO run (`max_generated_tokens`, `min_generated_tokens`) and the `after_step` hook."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marlhf.logging_utils import read_metrics
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.test_ppo import RECORDS, _config, _metrics_without_timings, count_e


def _tokens_per_step(tmp_path, make_tiny_causal_lm, tiny_tokenizer, **options) -> list[int]:
    """rollout/tokens of each step of a 6-step run without a budget."""
    train_ppo(_config(tmp_path, output_dir=str(tmp_path / "free"), max_steps=6, **options), RECORDS,
              policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    return [int(m["rollout/tokens"]) for m in read_metrics(tmp_path / "free")]


def test_the_run_ends_at_the_first_step_that_reaches_the_budget(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    tokens = _tokens_per_step(tmp_path, make_tiny_causal_lm, tiny_tokenizer)
    budget = sum(tokens[:3]) - 1  # reached during step 3
    train_ppo(_config(tmp_path, max_steps=6, max_generated_tokens=budget), RECORDS, policy=make_tiny_causal_lm(),
              tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["rollout/generated_tokens"] for m in metrics] == [sum(tokens[:k]) for k in (1, 2, 3)]


def test_min_generated_tokens_draws_the_run_past_max_steps(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    tokens = _tokens_per_step(tmp_path, make_tiny_causal_lm, tiny_tokenizer)
    train_ppo(_config(tmp_path, max_steps=2, min_generated_tokens=sum(tokens[:4])), RECORDS,
              policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # step 4 reaches it exactly
    assert [int(m["rollout/tokens"]) for m in metrics] == tokens[:4]  # the same steps as the run without a budget


def test_a_resumed_run_counts_on_from_its_checkpoint(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    """Stopped at max_steps 2 and resumed with max_steps 6: the count comes back from checkpoint-2, so the budget
    ends the run at step 3 as it ends the uninterrupted one (a count from 0 would run to step 5)."""
    torch.manual_seed(0)
    start = {k: v.clone() for k, v in make_tiny_causal_lm().state_dict().items()}

    def policy():
        model = make_tiny_causal_lm()
        model.load_state_dict(start)
        return model

    tokens = _tokens_per_step(tmp_path, lambda: policy(), tiny_tokenizer)
    budget = sum(tokens[:3])
    common = dict(max_generated_tokens=budget, save_steps=1)
    train_ppo(_config(tmp_path, output_dir=str(tmp_path / "straight"), max_steps=6, **common), RECORDS,
              policy=policy(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    first = _config(tmp_path, output_dir=str(tmp_path / "resumed"), max_steps=2, **common)
    train_ppo(first, RECORDS, policy=policy(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    train_ppo(dataclasses.replace(first, max_steps=6, resume="latest"), RECORDS, policy=policy(),
              tokenizer=tiny_tokenizer, reward_fn=count_e)
    resumed, straight = _metrics_without_timings(tmp_path / "resumed"), _metrics_without_timings(tmp_path / "straight")
    assert [m["step"] for m in straight] == [1, 2, 3]
    assert resumed == straight


def test_after_step_sees_each_step_and_does_not_change_the_run(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    seen = []

    def disturb(done, policy, generated):  # draws from every random stream, as an evaluation that samples would
        seen.append((done, generated, isinstance(policy, torch.nn.Module)))
        torch.manual_seed(123)
        torch.rand(3)
        import random

        import numpy as np
        random.random(), np.random.rand()

    torch.manual_seed(0)
    model = make_tiny_causal_lm()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train_ppo(_config(tmp_path, output_dir=str(tmp_path / "plain"), max_steps=3), RECORDS, policy=model,
              tokenizer=tiny_tokenizer, reward_fn=count_e)
    model = make_tiny_causal_lm()
    model.load_state_dict(start)
    train_ppo(_config(tmp_path, output_dir=str(tmp_path / "hooked"), max_steps=3, min_generated_tokens=1), RECORDS,
              policy=model, tokenizer=tiny_tokenizer, reward_fn=count_e, after_step=disturb)
    plain = _metrics_without_timings(tmp_path / "plain")
    hooked = _metrics_without_timings(tmp_path / "hooked")
    assert [{k: v for k, v in m.items() if k != "rollout/generated_tokens"} for m in hooked] == plain
    assert seen == [(k, m["rollout/generated_tokens"], True) for k, m in zip((1, 2, 3), hooked)]


def test_min_above_max_is_refused():
    with pytest.raises(ValueError, match="min_generated_tokens"):
        PPOConfig(min_generated_tokens=10, max_generated_tokens=5)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_learning_rate_past_the_plan_is_the_schedules_last(schedule):
    """Within the plan the schedule is transformers' own; past it (a run drawn out by min_generated_tokens) the
    last value holds, where cosine's formula would rise again."""
    from transformers import get_scheduler

    from marlhf.trainers.common import make_scheduler

    def rates(scheduler, steps):
        out = []
        for _ in range(steps):
            out.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return out

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    config = PPOConfig(model_name_or_path="x", lr_scheduler=schedule, warmup_steps=2)
    held = rates(make_scheduler(optimizer(), config, 10), 16)
    name = "constant_with_warmup" if schedule == "constant" else schedule
    plain = rates(get_scheduler(name, optimizer(), num_warmup_steps=2, num_training_steps=10), 16)
    assert held[:11] == plain[:11] and held[11:] == [held[10]] * 5
    if schedule == "cosine":
        assert plain[15] > plain[10] == 0.0  # what the hold prevents
