"""Evaluation over an environment's episodes (marlhf.envs): success rate and mean return with intervals, and pass@k
for verifiable tasks.

    summary = evaluate_episodes("reasoning_gym:chain_sum", policy, tokenizer, seeds=range(100),
                                tasks=records, samples_per_task=4, ks=(1, 4))

Each task (a record of the environment's dataset, or without records the task an environment draws from its seed)
is played `samples_per_task` times (several need records), each episode from its own seed, through the multi-turn
rollout (marlhf.multiturn) on the hf engine, in batches of episodes. An episode succeeds
when its return (the sum of its turns' rewards) reaches `success_at` (1: a verified answer, a won game). The
summary has the episodes' mean return with its t-interval, the success rate with its Wilson interval, pass@k over
the tasks (the unbiased estimator of marlhf.evaluation.passk, from each task's samples) and the rollouts' counts.
`marlhf evaluate --env ...` runs it (marlhf.evaluation.evaluate, docs/envs.md).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

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


def _combined(metrics: Sequence[dict[str, float]]) -> dict[str, float]:
    """The rollouts' counts and times summed over the batches; env/turns, a mean per episode, weighted by them."""
    total = {name: sum(m[name] for m in metrics) for name in metrics[0]}
    total["env/turns"] = sum(m["env/turns"] * m["env/episodes"] for m in metrics) / total["env/episodes"]
    return total


def evaluate_episodes(env: str, policy: torch.nn.Module, tokenizer: Any, *, seeds: Sequence[int],
                      tasks: Sequence[Any] | None = None, env_options: dict[str, Any] | None = None,
                      samples_per_task: int = 1, ks: Sequence[int] = (1,), success_at: float = 1.0,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, batch_size: int = 64,
                      options: MultiTurnOptions | None = None) -> dict[str, Any]:
    """Play `samples_per_task` episodes of each task (seed `seeds[i]`, task `tasks[i]` or None) of environment `env`
    with `policy`, `batch_size` episodes a rollout, and summarize them (`episode_summary`, the rollouts' metrics,
    and "per_episode": each episode's task index, seed, return, turns and ending)."""
    if tasks is not None and len(tasks) != len(seeds):
        raise ValueError(f"evaluate_episodes: {len(seeds)} seeds and {len(tasks)} tasks: give one task per seed")
    if tasks is None and samples_per_task > 1:
        raise ValueError("evaluate_episodes: several samples of a task need its record (tasks=...): without one, an "
                         "environment draws its task from the episode's seed, so each seed is one task")
    engine = HFEngine()
    engine.options = HFOptions()
    engine.sync_weights(policy)
    generate = EngineSampler(engine, temperature=temperature, top_k=top_k, top_p=top_p,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    task_ids = [i for i in range(len(seeds)) for _ in range(samples_per_task)]
    # a task's samples differ by their seeds, which set both the sampling and an environment's own draws
    episode_seeds = [int(seeds[i]) + j * 1_000_003 for i in range(len(seeds)) for j in range(samples_per_task)]
    rows, metrics = [], []
    for start in tqdm(range(0, len(task_ids), batch_size), desc="episodes", disable=None, leave=False):
        ids, batch_seeds = task_ids[start:start + batch_size], episode_seeds[start:start + batch_size]
        rollout = rollout_episodes([make_env(env, env_options) for _ in ids], generate, tokenizer, seeds=batch_seeds,
                                   tasks=None if tasks is None else [tasks[i] for i in ids], options=options,
                                   max_length=model_positions(policy), env_name=env,
                                   device=next(policy.parameters()).device)
        rows += [{"task": task, "seed": seed, "return": float(total), "turns": int(turns), "terminated": bool(done)}
                 for task, seed, total, turns, done in zip(ids, batch_seeds, rollout.turn_rewards.sum(1).tolist(),
                                                          rollout.num_turns, rollout.terminated)]
        metrics.append(dict(rollout.metrics))
    summary = episode_summary([r["return"] for r in rows], task_ids, success_at=success_at, ks=ks)
    return {**summary, "env": env, "metrics": _combined(metrics), "per_episode": rows}
