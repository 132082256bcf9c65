"""Playing one episode of an environment with a policy (a tiny model, or a scripted one)."""

from __future__ import annotations

# A record of a SkyRL dataset (gsm8k_multi_turn), the task of a SkyRL-Gym episode.
GSM8K_RECORD = {"data_source": "openai/gsm8k", "env_class": "gsm8k_multi_turn",
                "prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many "
                                                       "clips did she sell? End with '#### ANSWER'."}],
                "reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {"max_turns": 3}}


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
