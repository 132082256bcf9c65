"""Playing one episode of an environment with a policy (a tiny model, or a scripted one)."""

from __future__ import annotations


def play(env, policy, seed: int, task=None, max_turns: int = 20) -> tuple[list, list[float], bool, dict]:
    """One episode of `env` with `policy(observation) -> action`: (observations, rewards, terminated, last info)."""
    observation, info = env.reset(seed, task)
    observations, rewards = [observation], []
    for _ in range(max_turns):
        observation, reward, terminated, truncated, info = env.step(policy(observation))
        observations.append(observation)
        rewards.append(reward)
        if terminated or truncated:
            return observations, rewards, terminated, info
    raise AssertionError(f"the episode did not end in {max_turns} turns")
