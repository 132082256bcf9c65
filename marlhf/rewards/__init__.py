"""Rewards computed without a reward model: the sandboxed unit-test reward of the APPS task."""

from marlhf.rewards.code import SandboxLimits, code_reward, code_reward_fn, code_rewards

__all__ = ["SandboxLimits", "code_reward", "code_reward_fn", "code_rewards"]
