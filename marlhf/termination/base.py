"""The termination-rule seam: what a rule sees (`SegmentationBatch`), its registry, and how PPO runs one
(`segment`); the package docstring says how to write one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.plugins import Plugin, Registry
from marlhf.segments import split_by_turns

__all__ = ["SegmentationBatch", "Rule", "REGISTRY", "TERMINATION_RULES", "register_termination", "get_termination",
           "reads_reference", "segment"]


@dataclasses.dataclass(frozen=True)
class SegmentationBatch:
    """What a rule may look at. Rows are this process's responses, right-padded.

    response_ids: long [B, T]; response_mask: bool [B, T]; ref_logprobs: float [B, T] (the frozen
    reference's log-probs of the sampled tokens; None for a rule registered with ``reads_reference=False``
    when PPO runs without a reference); tokenizer: the policy's; options: the rule's own options (an instance
    of the dataclass it registered, None if it declared none); seed: a per-step seed for random rules;
    gather_rows / own_rows: stack the rows of every process / take this process's rows back, for rules that
    must draw for all processes' rows at once (identity functions in a single process); logprobs: float [B, T],
    the sampling policy's log-probs of the sampled tokens at rollout time (the PPO ratio's denominator; None
    when the caller has none); turn_ids: long [B, T], for multi-turn rows (one episode a row: its turns' action
    tokens and the observations between them), the 0-based policy turn of each action token, -1 on observation
    tokens and padding (None for single-turn rows).

    Multi-turn rows: ``response_mask`` is True on every real token, actions and observations (right-padded), so
    every rule runs on them as on one response; :func:`segment` then cuts the rule's segments at every turn start
    and drops the observation tokens (marlhf.segments.split_by_turns), so no macro action spans two turns.
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    tokenizer: Any
    options: Any
    seed: int
    gather_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    own_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    logprobs: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None


Rule = Callable[[SegmentationBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"]
REGISTRY = Registry("termination rule", "termination", reads_reference=True)
TERMINATION_RULES: dict[str, Plugin] = REGISTRY.plugins


def register_termination(name: str, *, options: type | None = None,
                         reads_reference: bool = True) -> Callable[[Rule], Rule]:
    """Decorator: register `rule` under `name` (an error if the name is taken), with its options dataclass.
    `reads_reference=False` declares that the rule never reads `batch.ref_logprobs`."""
    return REGISTRY.register(name, options=options, reads_reference=reads_reference)


def get_termination(spec: str) -> Plugin:
    """The rule registered as `spec`, or the one at the dotted path `package.module:function`."""
    return REGISTRY.get(spec)


def reads_reference(spec: str) -> bool:
    """Whether the rule named by `spec` may read the reference's log-probs: True unless it was registered
    with ``reads_reference=False`` (an unregistered dotted-path rule may read them)."""
    return get_termination(spec).reads_reference


def segment(rule: Plugin | str, batch: SegmentationBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the rule (a plug-in, or its name or dotted path): (segment_ids, stats). With ``batch.turn_ids``
    (multi-turn rows), the rule's segments are cut at every turn start and kept on the action tokens only
    (marlhf.segments.split_by_turns): -1 on observations."""
    rule = get_termination(rule) if isinstance(rule, str) else rule
    out = rule.obj(batch)
    segment_ids, stats = out if isinstance(out, tuple) else (out, {})
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.shape != batch.response_mask.shape:
        raise ValueError(f"termination {rule.name!r} must return segment_ids shaped like the responses "
                         f"{tuple(batch.response_mask.shape)}")
    if batch.turn_ids is not None:
        segment_ids = split_by_turns(segment_ids, batch.turn_ids)
    return segment_ids, stats

