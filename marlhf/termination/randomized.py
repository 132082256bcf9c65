"""`randomized`: macro actions of lengths drawn from `randomized_lengths`, each repeated `repeat_times` times."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.config import option
from marlhf.segments import randomized_ngram
from marlhf.termination.base import SegmentationBatch, register_termination


@dataclasses.dataclass(frozen=True)
class RandomizedOptions:
    randomized_lengths: tuple[int, ...] = option((2, 3, 5, 10), "segment lengths to draw from", ge=1)
    repeat_times: int = option(3, "how often the list of lengths is repeated before shuffling", ge=1)


@register_termination("randomized", options=RandomizedOptions, reads_reference=False)
def randomized(batch: SegmentationBatch) -> torch.Tensor:
    # Drawn for the rows of all processes from the step's seed: a row's lengths do not depend on the
    # number of processes.
    generator = torch.Generator().manual_seed(batch.seed)
    all_ids = randomized_ngram(batch.gather_rows(batch.response_mask), batch.options.randomized_lengths,
                               batch.options.repeat_times, generator)
    return batch.own_rows(all_ids)
