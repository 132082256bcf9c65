"""`turn`: one macro action per policy turn of a multi-turn episode (Turn-PPO, arXiv 2512.17008): the segments are the
turns (`SegmentationBatch.turn_ids`), -1 on observation tokens. Any other rule splits turns further, since the
runner cuts every rule's segments at the turns (marlhf.termination.base.segment)."""

from __future__ import annotations

import torch

from marlhf._checks import check_turn_ids
from marlhf.segments import split_by_turns
from marlhf.termination.base import SegmentationBatch, register_termination


@register_termination("turn", reads_reference=False)
def turn(batch: SegmentationBatch) -> torch.Tensor:
    """The turns as segments, numbered 0, 1, ... over the turns that have action tokens."""
    if batch.turn_ids is None:
        raise ValueError("termination 'turn' needs the policy turn of each token (SegmentationBatch.turn_ids): it is "
                         "for multi-turn episodes (an environment)")
    check_turn_ids(batch.turn_ids, batch.turn_ids >= 0)
    if bool(((batch.turn_ids >= 0) & ~batch.response_mask).any()):
        raise ValueError("termination 'turn': `turn_ids` marks an action token outside `response_mask`")
    return split_by_turns(batch.turn_ids, batch.turn_ids)
