"""The adaptive KL coefficient against the rule written out by hand."""

from __future__ import annotations

import math

import pytest

from marlhf.kl_control import AdaptiveKLController, AdaptiveKLOptions
from marlhf.trainers.ppo_config import PPOConfig

LR = 1e-5  # any learning rate but 0


def test_update_follows_ziegler_et_al():
    control = AdaptiveKLController(0.1, target=6.0, horizon=100, responses_per_step=10)
    assert control.update(7.2, LR) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # 7.2 / 6 - 1 = 0.2
    assert control.update(6.6, LR) == pytest.approx(0.1 * 1.02 * (1 + 0.1 * 10 / 100))
    before = control.value
    assert control.update(600.0, LR) == pytest.approx(before * 1.02)  # the error is clipped to 0.2
    before = control.value
    assert control.update(0.0, LR) == pytest.approx(before * 0.98)  # and to -0.2
    before = control.value
    assert control.update(6.0, LR) == before  # at the target nothing moves
    assert control.update(math.nan, LR) == before


def test_the_coefficient_stays_within_its_bound():
    """A KL that stays above the target (a policy that does not move) raises the coefficient by the same factor
    every step, up to kl_coef_max and no further; below the target it comes down from the bound as before."""
    control = AdaptiveKLController(0.24, target=4.0, horizon=160, responses_per_step=64, max_value=10.0)
    values = [control.update(50.0, LR) for _ in range(200)]  # unbounded: 0.24 * 1.08^200 = 1.2e6
    assert values[0] == pytest.approx(0.24 * 1.08) and max(values) == values[-1] == 10.0
    assert values.index(10.0) == math.ceil(math.log(10.0 / 0.24) / math.log(1.08)) - 1  # the first step past it
    assert control.update(0.0, LR) == pytest.approx(10.0 * 0.92)
    at_bound = AdaptiveKLController(10.0, target=4.0, horizon=160, responses_per_step=64, max_value=10.0)
    assert at_bound.update(50.0, LR) == 10.0
    with pytest.raises(ValueError, match="kl_coef_max"):
        AdaptiveKLController(10.5, target=4.0, horizon=160, responses_per_step=64, max_value=10.0)
    with pytest.raises(ValueError, match=r"kl_coef \(20.0\) is above .* kl_coef_max \(10.0\)"):
        PPOConfig(kl_target=6.0, kl_coef=20.0)
    assert AdaptiveKLOptions().kl_coef_max == 10.0 and PPOConfig(kl_target=6.0, kl_coef_max=0.5).kl_control.kl_coef_max == 0.5


def test_no_update_while_the_learning_rate_is_0():
    """A policy with a learning rate of 0 cannot move towards the target: the coefficient stays where it is
    (a tuning run whose policy was frozen took it from 0.24 to 7.8e7), and moves again once the rate is back."""
    control = AdaptiveKLController(0.24, target=4.0, horizon=160, responses_per_step=64)
    assert [control.update(kl, 0.0) for kl in (50.0, 0.0, 4.5)] == [0.24, 0.24, 0.24]
    assert control.update(50.0, LR) == pytest.approx(0.24 * 1.08)


def test_state_round_trip_and_checks():
    control = AdaptiveKLController(0.05, target=2.0, horizon=50, responses_per_step=8)
    for kl in (3.0, 0.5, 4.0):
        control.update(kl, LR)
    restored = AdaptiveKLController(0.05, target=2.0, horizon=50, responses_per_step=8)
    restored.load_state_dict(control.state_dict())
    assert restored.value == control.value and restored.update(1.0, LR) == control.update(1.0, LR)
    with pytest.raises(ValueError, match="kl_horizon"):
        AdaptiveKLController(0.05, target=2.0, horizon=1, responses_per_step=8)  # 1 - 0.2 * 8 < 0
    with pytest.raises(ValueError, match="kl_target"):
        AdaptiveKLController(0.05, target=0.0, horizon=50, responses_per_step=8)
    with pytest.raises(ValueError, match="start finite and > 0"):
        AdaptiveKLController(0.0, target=2.0, horizon=50, responses_per_step=8)


def test_in_ppo_the_coefficient_waits_for_the_policy_to_train(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    """PPO passes the policy's learning rate: during the critic's warmup the policy's schedule stays at its start,
    0 under a learning-rate warmup, so the coefficient stays (the critic, which trains, has a rate above 0); once
    the policy trains it moves (a KL of 0, the policy being the reference until then: down by 0.2 x 4 / 10)."""
    from marlhf.logging_utils import read_metrics
    from marlhf.trainers.ppo import train_ppo
    from tests.trainers.test_ppo import RECORDS, _config, count_e

    config = _config(tmp_path, max_steps=4, kl_coef=0.1, kl_target=0.5, kl_horizon=10, critic_warmup_steps=2,
                     warmup_steps=1)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["objective/kl"] for m in metrics[:3]] == [0.0, 0.0, 0.0]
    assert [m["objective/kl_coef"] for m in metrics] == [0.1, 0.1, 0.1, pytest.approx(0.1 * (1 - 0.2 * 4 / 10))]


def test_in_ppo_the_coefficient_waits_for_the_critic_warmup_without_a_learning_rate_warmup(
        tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    """No learning-rate warmup: the policy's rate is above 0 from step 1, but the policy does not train before step
    3 (critic_warmup_steps 2), so the coefficient moves first after step 2, for step 3's update."""
    from marlhf.logging_utils import read_metrics
    from marlhf.trainers.ppo import train_ppo
    from tests.trainers.test_ppo import RECORDS, _config, count_e

    config = _config(tmp_path, max_steps=4, kl_coef=0.1, kl_target=0.5, kl_horizon=10, critic_warmup_steps=2,
                     warmup_steps=0)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["objective/kl_coef"] for m in metrics[:3]] == [0.1, 0.1, pytest.approx(0.1 * (1 - 0.2 * 4 / 10))]
