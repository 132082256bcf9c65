"""`gigpo`: GiGPO (Group-in-Group Policy Optimization, arXiv 2505.10978) for multi-turn episodes, critic-free: the
episode-level group advantage over a prompt's episodes plus, weighted by `step_advantage_w`, a step-level one over
the steps (turns) that start from the same environment state (anchor state, `AdvantageBatch.turn_state_ids`), from
discounted step returns. It follows the authors' code (langfengQ/verl-agent, gigpo/core_gigpo.py), whose defaults
differ from the paper's text: marlhf.advantages.gigpo says how, and the options give the paper's."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.advantages import EpisodeStatistics, GiGPOMode, gigpo as gigpo_advantages
from marlhf.config import option
from marlhf.estimators.base import AdvantageBatch, register_estimator


@dataclasses.dataclass(frozen=True)
class GiGPOOptions:
    step_gamma: float = option(0.95, "discount of the step returns over turns (the authors' runs: 0.95)", ge=0, le=1)
    step_advantage_w: float = option(1.0, "weight of the step-level (anchor-state) advantage (the authors': 1)", ge=0)
    gigpo_mode: GiGPOMode = option(
        "mean_norm", "mean_norm: minus the group mean (the authors' code's default); mean_std_norm: also divided by "
                     "the group's std (one of the two factors the paper's text allows)")
    episode_statistics: EpisodeStatistics = option(
        "steps", "episode-level group mean and std over the group's steps, an episode counted once per turn (the "
                 "authors' code), or over its episodes, each once (the paper's text)")


@register_estimator("gigpo", needs_critic=False, min_samples_per_prompt=2, options=GiGPOOptions)
def gigpo(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
    """GiGPO over all processes' rows (a prompt's episodes may span processes): needs the turns (`turn_ids`) and the
    anchor states (`turn_state_ids`) of multi-turn episodes."""
    if batch.turn_ids is None or batch.turn_state_ids is None:
        raise ValueError("advantage 'gigpo' needs multi-turn episodes: the turn of each token and the state before "
                         "each turn (AdvantageBatch.turn_ids, turn_state_ids)")
    o = batch.options
    # ids shifted by one, so that the rows' padding to one width across processes (zeros) reads back as -1
    turn_ids = batch.gather_rows(batch.turn_ids + 1) - 1
    states = batch.gather_rows(batch.turn_state_ids + 1) - 1
    advantages = gigpo_advantages(batch.gather_rows(batch.rewards), batch.gather_rows(batch.mask), turn_ids, states,
                                  batch.num_samples_per_prompt, o.step_gamma, o.step_advantage_w, o.gigpo_mode,
                                  o.episode_statistics)
    return batch.own_rows(advantages), None
