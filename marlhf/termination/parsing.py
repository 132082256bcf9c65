"""`parsing`: macro actions from a parse tree of the response (subtrees of at most `parsing_cutoff` leaves)."""

from __future__ import annotations

import dataclasses

import torch

from marlhf import segments
from marlhf.config import option
from marlhf.parsing import ParsingLanguage
from marlhf.termination.base import SegmentationBatch, register_termination


@dataclasses.dataclass(frozen=True)
class ParsingOptions:
    parsing_cutoff: int = option(5, "a subtree with at most this many parser leaves is one action", ge=1)
    parsing_language: ParsingLanguage = option("auto", "parser to use (auto: Python if the response parses as "
                                                        "code)")


@register_termination("parsing", options=ParsingOptions, reads_reference=False)
def parsing(batch: SegmentationBatch) -> tuple[torch.Tensor, dict[str, float]]:
    segment_ids, fallbacks = segments.parsing(batch.response_ids, batch.response_mask, batch.tokenizer,
                                              batch.options.parsing_cutoff, batch.options.parsing_language)
    return segment_ids, {"parse_fallbacks": fallbacks}
