"""`low_prob`: SPO's cutpoints (arXiv 2505.23564): a macro action starts at each sampled token whose probability under
the sampling policy is below `threshold`; reads the policy's rollout log-probs, not the reference's."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.config import option
from marlhf.segments import low_prob_cutpoints
from marlhf.termination.base import SegmentationBatch, register_termination


@dataclasses.dataclass(frozen=True)
class LowProbOptions:
    threshold: float = option(0.9, "a token sampled with probability below it starts a macro action (SPO: 0.9)",
                              ge=0, le=1)
    interval: int = option(1, "keep every interval-th cutpoint of a response (SPO's cutpoint_interval)", ge=1)
    min_tokens: int | None = option(None, "drop a cutpoint less than this many tokens into a macro action", ge=1)
    max_tokens: int | None = option(None, "end a macro action that reaches this many tokens", ge=1)

    def __post_init__(self) -> None:
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"termination 'low_prob' option 'min_tokens' ({self.min_tokens}) must be <= "
                             f"'max_tokens' ({self.max_tokens})")


@register_termination("low_prob", options=LowProbOptions, reads_reference=False)
def low_prob(batch: SegmentationBatch) -> torch.Tensor:
    """SPO's cutpoints: a macro action starts at each token sampled with probability below `threshold`
    (marlhf.segments.low_prob_cutpoints of batch.logprobs, the rollout's log-probs that the PPO ratio divides by)."""
    if batch.logprobs is None:
        raise ValueError("termination 'low_prob' needs the sampling policy's log-probs (SegmentationBatch.logprobs)")
    o = batch.options
    return low_prob_cutpoints(batch.response_mask, batch.logprobs, o.threshold, o.interval, o.min_tokens,
                              o.max_tokens)
