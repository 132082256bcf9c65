"""`perplexity`: a macro action ends where the reference's perplexity stops falling (it reads the reference)."""

from __future__ import annotations

import torch

from marlhf import segments
from marlhf.termination.base import SegmentationBatch, register_termination


@register_termination("perplexity")
def perplexity(batch: SegmentationBatch) -> torch.Tensor:
    return segments.perplexity(batch.response_mask, batch.ref_logprobs)
