"""Stages 1 and 2 of a PPO step on episodes of an environment (`PPOConfig.env`, docs/multiturn.md): one episode a
row, run by marlhf.multiturn.run_episodes on the trainer's engine or in the rollout workers
(marlhf.trainers.staleness), then scored like single-turn responses over the whole transcript (actions and
observations attend; only the action tokens are read downstream, through `Experience.actions`). The score of an
episode is the environment's: its turn rewards (summed in `scores`, each on its turn's last action token in the
per-token rewards)."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.multiturn import run_episodes
from marlhf.rollout import Experience, score_responses
from marlhf.trainers.common import device_clock
from marlhf.trainers.ppo_setup import PPORun
from marlhf.trainers.staleness import RolloutRequest

__all__ = ["sample_and_score_episodes"]


def sample_and_score_episodes(run: PPORun, step: int, rows: list[int], request: RolloutRequest,
                              clock: dict[str, float]) -> Experience:
    """The step's episodes, one per row: environment b reset with its group's seed (`request.env_seeds`) and the
    row's dataset record as its task, its turns sampled from the row's seed (`request.row_seeds`, so a resumed run
    samples what the uninterrupted one did), run with the policy of
    this step (eval mode, no gradients) or, from the rollout workers, of version max(start, step - max_staleness);
    then the forwards of `score` (policy and reference log-probs, critic values) over each transcript, and the
    engine's log-probs kept beside the trainer's when something compares them. Stamps clock["generation"] when
    the episodes end."""
    config, accelerator = run.config, run.accelerator
    run.train(False)  # generate with the KV cache
    run.engine.sync_weights(accelerator.unwrap_model(run.policy))
    with accelerator.autocast(), torch.no_grad():
        if run.rollouts is None:
            rollout = run_episodes(run.engine, run.episodes, request.row_seeds, request.env_seeds, request.tasks,
                                   accelerator.device)
        else:
            rollout = run.rollouts.generation(step, accelerator.unwrap_model(run.policy))
    clock["generation"] = device_clock(accelerator.device)
    returns = rollout.turn_rewards.sum(1).tolist()
    with accelerator.autocast():
        scored = score_responses(
            rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask, ref=run.ref,
            temperature=config.scoring_temperature, reward_fn=lambda prompts, responses: returns,
            prompts=[run.prompt_records[i]["prompt"] for i in rows], tokenizer=run.tokenizer,
            with_entropy=run.plugins.estimator.reads_entropy, piece_size=config.forward_batch_size or run.piece_size,
            policy=run.policy, critic=run.critic)
    kept = config.compares_rollout_logprobs  # the engine's log-probs beside the trainer's, not instead of them
    return dataclasses.replace(scored, step=step, prompt_rows=rows, action_mask=rollout.action_mask,
                               rollout_logprobs=rollout.logprobs if kept else None,
                               turn_ids=rollout.turn_ids, turn_rewards=rollout.turn_rewards,
                               turn_state_ids=rollout.turn_state_ids, env_metrics=dict(rollout.metrics),
                               env_seeds=list(request.env_seeds))
