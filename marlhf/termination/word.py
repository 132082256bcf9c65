"""`word`: one macro action per word, read off the tokenizer's vocabulary."""

from __future__ import annotations

import torch

from marlhf.segments import word_starts, words
from marlhf.termination.base import SegmentationBatch, register_termination


@register_termination("word", reads_reference=False)
def word(batch: SegmentationBatch) -> torch.Tensor:
    return words(batch.response_mask, word_starts(batch.response_ids, batch.tokenizer))
