"""The token budget of a PPO run (`max_generated_tokens`, `min_generated_tokens`): the tokens generated so far,
counted after each step and kept in checkpoints, and whether the run takes another step."""

from __future__ import annotations

from accelerate import Accelerator

from marlhf.rollout import Experience
from marlhf.trainers.ppo_config import PPOConfig

__all__ = ["GeneratedTokens", "goes_on"]


class GeneratedTokens:
    """The tokens a run has generated so far (every sampled response token and every Monte-Carlo continuation
    token, over all processes), for the token budget; kept in checkpoints beside the learning-rate schedulers, so a
    resumed run stops where the uninterrupted one does."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, accelerator: Accelerator, experience: Experience) -> int:
        """Count a step's tokens (one read to the host) and return the total so far."""
        step = accelerator.reduce(experience.actions.sum(), reduction="sum").item()  # sampled: no observation
        self.total += int(step) + (experience.continuation_tokens or 0) * accelerator.num_processes
        return self.total

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total = int(state["total"])


def goes_on(config: PPOConfig, tokens: GeneratedTokens | None, steps_done: int, total_steps: int) -> bool:
    """Whether the run takes another step after `steps_done`: until the plan's last step (`total_steps`), ended
    earlier by max_generated_tokens and drawn out by min_generated_tokens (`tokens`: None without a budget)."""
    if tokens is not None and config.max_generated_tokens is not None and tokens.total >= config.max_generated_tokens:
        return False
    if tokens is not None and config.min_generated_tokens is not None and tokens.total < config.min_generated_tokens:
        return True
    return steps_done < total_steps
