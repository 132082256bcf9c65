"""Bounded-staleness rollouts: which policy version samples each PPO step's batch, and the pipeline that keeps
the rollout workers (marlhf.engines.worker) that many steps ahead of the trainer (docs/async.md).

The schedule. Policy version v is the policy after v PPO steps of this run segment (version `start_step` is the
one a run starts or resumes with). With `max_staleness` k, the batch of step t is sampled by version

    behaviour_version(t) = max(start_step, t - k)

so at the start of step t (the trainer holds version t) the workers are sent version t and asked for the batch
of step t + k, and the trainer then trains on step t's batch, asked for k steps earlier. Every batch's prompts,
per-row seeds and policy version are fixed by the step number alone: a run is reproducible whatever the timing,
and the trainer waits only when a worker is slower than k steps of training. k = 0 samples each step with its own
policy (the synchronous step, here in a worker process). A resumed run regenerates the batches that were in
flight when it stopped (none is saved, none is lost, none used twice), sampled by the checkpoint's policy, version
start_step: after a resume the first k steps are less stale than the uninterrupted run's were.

With several workers each step's rows are split into contiguous shares, one per worker; a row's response depends
only on its prompt, its seed and the weights, so the split changes which process samples it, not what it is.

With an environment (`episodes`, PPOConfig.env) a worker runs its share's episodes itself: it makes the
environments from the spec, runs them on its engine (marlhf.multiturn.run_episodes) and sends back a
MultiTurnRollout; an episode depends only on its seed, its task and the weights, so the same holds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from marlhf.engines.base import Generation, RolloutEngine
from marlhf.engines.worker import RolloutWorker, WorkerSpec
from marlhf.multiturn import EpisodeSpec, MultiTurnRollout, concat_rollouts, run_episodes
from marlhf.trainers.ppo_config import PPOConfig

__all__ = ["behaviour_version", "RolloutRequest", "StaleRollouts"]


def behaviour_version(step: int, max_staleness: int, start_step: int = 0) -> int:
    """The policy version (PPO steps done) that samples step `step`'s batch (module docstring)."""
    if max_staleness < 0:
        raise ValueError(f"`max_staleness` must be >= 0, got {max_staleness}")
    return max(start_step, step - max_staleness)


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """One step's prompts and seeds: prompt_ids long [B, P] left-padded, prompt_mask bool [B, P], row_seeds [B];
    with an environment, tasks [B] (the rows' dataset records, an episode's task) and env_seeds [B] (each episode's
    reset seed)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    row_seeds: Sequence[int]
    tasks: Sequence[Any] = ()
    env_seeds: Sequence[int] = ()


class StaleRollouts:
    """The trainer's side of the pipeline: `generation(step, policy)` at the start of each step returns the step's
    Generation, or with `episodes` its MultiTurnRollout (on the prompts' device), after asking the workers for the
    batches up to step + max_staleness."""

    def __init__(self, workers: list[RolloutWorker], max_staleness: int, start_step: int, total_steps: int | None,
                 request: Callable[[int], RolloutRequest], sampling: dict[str, Any],
                 episodes: EpisodeSpec | None = None) -> None:
        self.workers, self.max_staleness, self.start_step = workers, max_staleness, start_step
        self.total_steps, self.request, self.sampling, self.episodes = total_steps, request, sampling, episodes
        self.versions: dict[int, int] = {}  # step -> the policy version that samples its batch (submitted ones)
        self.asked: dict[int, tuple[torch.device, int]] = {}  # step -> (its prompts' device, workers asked)
        self.metrics: dict[str, float] = {}  # the last step's rollout/staleness and its timings (time/)

    @classmethod
    def start(cls, *, engine: str, engine_options: Any, max_length: int | None, workers: int, threads: int,
              timeout: float, output_dir: str, first_index: int = 0, **schedule: Any) -> StaleRollouts:
        """Start `workers` processes of the engine, each logging to OUTPUT_DIR/rollout_worker_<i>.log."""
        started: list[RolloutWorker] = []
        try:
            for i in range(first_index, first_index + workers):
                log = Path(output_dir) / f"rollout_worker_{i}.log"
                started.append(RolloutWorker(WorkerSpec(engine, engine_options, max_length, threads, str(log), i,
                                                        timeout)))
        except BaseException:
            for worker in started:
                worker.close()
            raise
        return cls(started, **schedule)

    @classmethod
    def for_run(cls, config: PPOConfig, engine_options: Any, process_index: int, start_step: int, total_steps: int,
                request: Callable[[int], RolloutRequest], sampling: dict[str, Any],
                episodes: EpisodeSpec | None = None) -> StaleRollouts:
        """A PPO run's workers for training process `process_index` (config.async_rollout), sampling the rollout's
        responses with the engine's `sampling` settings, or running the `episodes`. A run that min_generated_tokens
        may draw out past the plan's last step (`total_steps`) has no last step for the workers."""
        options = config.async_rollout
        return cls.start(
            engine=config.rollout_engine, engine_options=engine_options, max_length=config.max_length,
            workers=options.rollout_workers, threads=options.rollout_worker_threads,
            timeout=options.rollout_worker_timeout, output_dir=config.output_dir,
            first_index=process_index * options.rollout_workers, max_staleness=options.max_staleness,
            start_step=start_step, total_steps=None if config.min_generated_tokens is not None else total_steps,
            request=request, sampling=dict(max_new_tokens=config.max_response_length, return_logprobs=True, **sampling),
            episodes=episodes)

    def generation(self, step: int, policy: nn.Module) -> Generation | MultiTurnRollout:
        """Step `step`'s batch. `policy` is version `step`: the workers get it for the batch of step + k."""
        began = time.perf_counter()
        last = step + self.max_staleness
        if self.total_steps is not None:  # None: no last step (a token budget may draw the run out)
            last = min(last, self.total_steps - 1)
        first = max(self.versions, default=step - 1) + 1
        if first <= last:
            for worker in self.workers:
                worker.send_weights(policy)
            for later in range(first, last + 1):
                self.versions[later] = step
                self._submit(later)
        if step not in self.versions:
            raise RuntimeError(f"step {step}'s batch was never asked for (steps run out of order?)")
        generation, seconds, tokens = self._collect(step)
        self.metrics = {"rollout/staleness": float(step - self.versions.pop(step)),
                        "time/rollout_worker_tokens_per_s": tokens / max(seconds, 1e-9),
                        "time/rollout_wait": time.perf_counter() - began}
        return generation

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    # ---------------------------------------------------------------------------------------------- helpers
    def _shares(self, rows: int) -> list[slice]:
        """Contiguous shares of a step's rows, one per worker (the first ones one row larger)."""
        n = min(len(self.workers), rows)
        sizes = [rows // n + (i < rows % n) for i in range(n)]
        bounds = [sum(sizes[:i]) for i in range(n + 1)]
        return [slice(bounds[i], bounds[i + 1]) for i in range(n)]

    def _submit(self, step: int) -> None:
        request = self.request(step)
        shares = self._shares(len(request.row_seeds))
        self.asked[step] = (request.prompt_ids.device, len(shares))
        for worker, share in zip(self.workers, shares):
            if self.episodes is None:
                worker.submit(step, request.prompt_ids[share], request.prompt_mask[share],
                              row_seeds=list(request.row_seeds[share]), **self.sampling)
            else:
                worker.submit_call(step, _episodes_in_worker, spec=self.episodes,
                                   seeds=list(request.row_seeds[share]), env_seeds=list(request.env_seeds[share]),
                                   tasks=list(request.tasks[share]))

    def _collect(self, step: int) -> tuple[Generation | MultiTurnRollout, float, int]:
        """The workers' shares of step `step`, right-padded to one width (episodes: `concat_rollouts`); the slowest
        share's seconds; tokens."""
        device, asked = self.asked.pop(step)
        parts = [worker.result(step) for worker in self.workers[:asked]]
        seconds, tokens = max(part[1] for part in parts), sum(part[2] for part in parts)
        if self.episodes is not None:
            return concat_rollouts([part[0] for part in parts], self.sampling["pad_token_id"]).to(device), seconds, \
                tokens
        generations = [part[0] for part in parts]
        if len(generations) == 1:
            generation = generations[0]
        else:
            width = max(g.response_ids.shape[1] for g in generations)
            pad = self.sampling["pad_token_id"]
            generation = Generation(
                torch.cat([_right_pad(g.response_ids, width, pad) for g in generations]),
                torch.cat([_right_pad(g.response_mask, width, False) for g in generations]),
                None if generations[0].logprobs is None else
                torch.cat([_right_pad(g.logprobs, width, 0.0) for g in generations]))
        return Generation(generation.response_ids.to(device), generation.response_mask.to(device),
                          None if generation.logprobs is None else generation.logprobs.to(device)), seconds, tokens


def _episodes_in_worker(engine: RolloutEngine, spec: EpisodeSpec, seeds: list[int], env_seeds: list[int],
                        tasks: list[Any]) -> tuple[MultiTurnRollout, int, int]:
    """A share of a step's episodes, run in a rollout worker (RolloutWorker.submit_call): its rollout on the CPU,
    its rows and its action tokens."""
    rollout = run_episodes(engine, spec, seeds, env_seeds, tasks)
    return rollout, len(seeds), int(rollout.action_mask.sum())


def _right_pad(tensor: torch.Tensor, width: int, value: Any) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)
