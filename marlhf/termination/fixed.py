"""`fixed`: a macro action every `ngram` tokens (1: token-level PPO; None: the whole response is one)."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.config import option
from marlhf.segments import fixed_ngram
from marlhf.termination.base import SegmentationBatch, register_termination


@dataclasses.dataclass(frozen=True)
class FixedOptions:
    ngram: int | None = option(5, "tokens per macro action (1: token-level PPO; none: the whole response is one "
                                  "action)", ge=1)


@register_termination("fixed", options=FixedOptions, reads_reference=False)
def fixed(batch: SegmentationBatch) -> torch.Tensor:
    return fixed_ngram(batch.response_mask, batch.options.ngram)
