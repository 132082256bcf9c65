"""Evaluation over an environment's episodes (marlhf.envs): success rate and mean return with intervals, and pass@k
for verifiable tasks.

    summary = evaluate_episodes("reasoning_gym:chain_sum", policy, tokenizer, seeds=range(100),
                                tasks=records, samples_per_task=4, ks=(1, 4))

Each task (a record of the environment's dataset, or without records the task an environment draws from its seed)
is played `samples_per_task` times (several need records), each episode from its own seed, through the multi-turn rollout (marlhf.multiturn) on the hf engine. An episode succeeds
when its return (the sum of its turns' rewards) reaches `success_at` (1: a verified answer, a won game). The
summary has the episodes' mean return with its t-interval, the success rate with its Wilson interval, pass@k over
the tasks (the unbiased estimator of marlhf.evaluation.passk, from each task's samples) and the rollout's counts.
Not wired into `marlhf evaluate` yet (docs/envs.md).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from marlhf.engines import HFEngine, HFOptions, model_positions
from marlhf.envs import make_env
from marlhf.evaluation.passk import aggregate_pass_at_k
from marlhf.evaluation.stats import paired_t
from marlhf.multiturn import EngineSampler, MultiTurnOptions, rollout_episodes

__all__ = ["wilson_interval", "episode_summary", "evaluate_episodes"]


def wilson_interval(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a success rate (nan, nan without trials)."""
    if trials == 0:
        return math.nan, math.nan
    z = NormalDist().inv_cdf(0.5 + level / 2)
    rate = successes / trials
    centre = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def episode_summary(returns: Sequence[float], task_ids: Sequence[int], *, success_at: float = 1.0,
                    ks: Sequence[int] = (1,), level: float = 0.95) -> dict[str, Any]:
    """Mean return (t-interval), success rate (Wilson interval) and pass@k of episodes: `returns[i]` of an episode of
    task `task_ids[i]`; a k above a task's number of samples is left out."""
    returns = np.asarray(returns, dtype=float)
    successes = returns >= success_at
    mean = paired_t(returns, level)
    summary: dict[str, Any] = {"episodes": int(len(returns)), "mean_return": mean["mean"],
                               "mean_return_ci": list(mean["ci"]), "success_rate": float(successes.mean()),
                               "success_rate_ci": list(wilson_interval(int(successes.sum()), len(returns), level))}
    tasks = sorted(set(task_ids))
    samples = [sum(1 for t in task_ids if t == task) for task in tasks]
    correct = [int(sum(s for s, t in zip(successes, task_ids) if t == task)) for task in tasks]
    usable = [k for k in ks if k <= min(samples, default=0)]
    if usable:
        summary["pass_at_k"] = aggregate_pass_at_k(["task"] * len(tasks), samples, correct, usable)["all"]
    return summary


def evaluate_episodes(env: str, policy: torch.nn.Module, tokenizer: Any, *, seeds: Sequence[int],
                      tasks: Sequence[Any] | None = None, env_options: dict[str, Any] | None = None,
                      samples_per_task: int = 1, ks: Sequence[int] = (1,), success_at: float = 1.0,
                      temperature: float = 1.0, options: MultiTurnOptions | None = None) -> dict[str, Any]:
    """Play `samples_per_task` episodes of each task (seed `seeds[i]`, task `tasks[i]` or None) of environment `env`
    with `policy` and summarize them (`episode_summary`, plus the rollout's metrics)."""
    if tasks is not None and len(tasks) != len(seeds):
        raise ValueError(f"evaluate_episodes: {len(seeds)} seeds and {len(tasks)} tasks: give one task per seed")
    if tasks is None and samples_per_task > 1:
        raise ValueError("evaluate_episodes: several samples of a task need its record (tasks=...): without one, an "
                         "environment draws its task from the episode's seed, so each seed is one task")
    engine = HFEngine()
    engine.options = HFOptions()
    engine.sync_weights(policy)
    generate = EngineSampler(engine, temperature=temperature, top_k=0, top_p=1.0,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    task_ids = [i for i in range(len(seeds)) for _ in range(samples_per_task)]
    episode_seeds = [int(seeds[i]) + j * 1_000_003 for i in range(len(seeds)) for j in range(samples_per_task)]
    rollout = rollout_episodes([make_env(env, env_options) for _ in task_ids], generate, tokenizer,
                               seeds=episode_seeds, tasks=None if tasks is None else [tasks[i] for i in task_ids],
                               options=options, max_length=model_positions(policy), env_name=env)
    summary = episode_summary(rollout.turn_rewards.sum(1).tolist(), task_ids, success_at=success_at, ks=ks)
    return {**summary, "env": env, "metrics": dict(rollout.metrics)}
