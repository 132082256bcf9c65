"""Rewards computed without a reward model: the sandboxed unit-test reward of the APPS task, and reward
functions in TRL's convention (several at once, with weights)."""

from marlhf.rewards.code import SandboxLimits, code_reward, code_reward_fn, code_rewards
from marlhf.rewards.functions import RewardFunctions

__all__ = ["RewardFunctions", "SandboxLimits", "code_reward", "code_reward_fn", "code_rewards"]
