"""`mc_segment`: critic-free advantages from Monte-Carlo values at macro-action boundaries (VinePPO, arXiv
2410.01679, at every step; SPO-chain, arXiv 2505.23564, at segment cutpoints).

At each kept boundary (a segment's first token, from any termination rule, at most `max_boundaries` per row:
marlhf.segments.keep_boundaries), `mc_samples` continuations of the prefix (prompt + the response tokens before
the boundary) are sampled by the run's rollout engine, for all rows and boundaries in one call
(`AdvantageBatch.continue_and_score`, which the trainer supplies), and V(boundary) is the mean of their final
scores. On episodes of an environment (`--env`, termination `turn`: boundaries at turn starts) a continuation
restores the environment and plays the rest of the episode, and its score is the return to go from the boundary's
turn (marlhf.trainers.continuations.EpisodeContinuations). The values estimate the score only: the KL penalty
enters each macro action's advantage as the sum of its tokens' KL rewards (marlhf.advantages.mc_segment_advantages).

A segment always starts at token 0, so by default the prompt's state is valued and the first macro action gets
V(next boundary) - V(prompt). SPO-chain values only its cutpoints: the tokens before the first cutpoint get no
advantage. `value_prompt=False` takes that convention: the first segment leaves the chain (its tokens get 0, KL
rewards included, and no continuations are drawn from the prompt), and the boundaries are kept among the others.
"""

from __future__ import annotations

import dataclasses

import torch

from marlhf.advantages import mc_segment_advantages
from marlhf.config import option
from marlhf.estimators.base import AdvantageBatch, ContinueAndScore, register_estimator
from marlhf.segments import keep_boundaries, num_segments, segment_first_token


@dataclasses.dataclass(frozen=True)
class MCSegmentOptions:
    mc_samples: int = option(4, "continuations sampled per kept boundary (K)", ge=1)
    max_boundaries: int = option(4, "kept boundaries per response, evenly spaced, the first always kept", ge=1)
    value_prompt: bool = option(
        True, "value the prompt's state (token 0) and give the first macro action V(next) - V(prompt); false: "
              "SPO-chain's convention, the tokens before the first boundary after token 0 get no advantage")

    def __post_init__(self) -> None:
        for name, value in (("mc_samples", self.mc_samples), ("max_boundaries", self.max_boundaries)):
            if value < 1:
                raise ValueError(f"advantage estimator 'mc_segment' option {name!r} must be >= 1, got {value}")


def mc_boundary_values(continue_and_score: ContinueAndScore, segment_ids: torch.Tensor, k: int) -> torch.Tensor:
    """V at every segment's start: the mean score of `k` continuations of its prefix, all drawn in one call.

    segment_ids: long [B, T]; returns float [B, S] (S the most segments of a row; 0 past a row's last)."""
    rows, starts = segment_first_token(segment_ids).nonzero(as_tuple=True)  # one per boundary, N in all
    if rows.numel() == 0:  # nothing to value (no row has a segment): no engine call
        return torch.zeros(segment_ids.shape[0], 0)
    scores = continue_and_score(rows, starts, k)  # [N, k]
    if scores.shape != (rows.shape[0], k):
        raise ValueError(f"continue_and_score returned shape {tuple(scores.shape)}, expected ({rows.shape[0]}, {k})")
    slots = int(num_segments(segment_ids).max()) if segment_ids.shape[0] else 0
    values = scores.new_zeros(segment_ids.shape[0], slots)
    values[rows, segment_ids[rows, starts]] = scores.mean(dim=1)
    return values


@register_estimator("mc_segment", needs_critic=False, options=MCSegmentOptions)
def mc_segment(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
    """Every token of a kept macro action gets V(next kept boundary) - V(its boundary) + its summed KL rewards (the
    last one: final score - V(its boundary) + its KL rewards); without `value_prompt`, the tokens of each row's
    first segment get 0."""
    if batch.continue_and_score is None:
        raise ValueError("advantage 'mc_segment' needs the trainer's continue_and_score (AdvantageBatch)")
    segment_ids, mask = batch.segment_ids, batch.mask
    if not batch.options.value_prompt:  # SPO-chain: the first segment leaves the chain, the next one is number 0
        segment_ids = torch.where(segment_ids > 0, segment_ids - 1, -1)
        mask = mask & (segment_ids >= 0)
    segment_ids = keep_boundaries(segment_ids, batch.options.max_boundaries)
    values = mc_boundary_values(batch.continue_and_score, segment_ids, batch.options.mc_samples)
    return mc_segment_advantages(values, batch.rewards, mask, segment_ids), None
