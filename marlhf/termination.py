"""Termination rules: how PPO groups a rollout's response tokens into macro actions.

A rule is a function of one :class:`SegmentationBatch` that returns ``segment_ids`` (long ``[B, T]``, the
convention of :mod:`marlhf.segments`), or ``(segment_ids, stats)`` with ``stats`` a dict of numbers that
PPO logs as ``macro/<name>``. The built-in rules are registered under their names (fixed, randomized,
perplexity, parsing, word); a new one is one decorated function (the README shows one that ends a macro
action at every sentence end), used as ``PPOConfig(termination="<name>")`` after the import, or, without
registering, by its dotted path on the command line: ``--termination my_pkg.rules:sentences``.
A rule may read the reference's log-probs (``perplexity`` does); one registered with
``reads_reference=False`` lets PPO drop the reference model when its KL coefficient is 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.imports import import_function
from marlhf.segments import fixed_ngram, parsing, perplexity, randomized_ngram, word_starts, words

__all__ = ["SegmentationBatch", "TERMINATION_RULES", "register_termination", "get_termination", "reads_reference",
           "segment"]


@dataclasses.dataclass(frozen=True)
class SegmentationBatch:
    """What a rule may look at. Rows are this process's responses, right-padded.

    response_ids: long [B, T]; response_mask: bool [B, T]; ref_logprobs: float [B, T] (the frozen
    reference's log-probs of the sampled tokens; None for a rule registered with ``reads_reference=False``
    when PPO runs without a reference); tokenizer: the policy's; options: the PPO config (the
    rules' own options: ngram, randomized_lengths, ...); seed: a per-step seed for random rules;
    gather_rows / own_rows: stack the rows of every process / take this process's rows back, for rules that
    must draw for all processes' rows at once (identity functions in a single process).
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    tokenizer: Any
    options: Any
    seed: int
    gather_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    own_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x


Rule = Callable[[SegmentationBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"]
TERMINATION_RULES: dict[str, Rule] = {}
_REFERENCE_FREE: set[str] = set()  # registered rules that never read batch.ref_logprobs


def register_termination(name: str, *, reads_reference: bool = True) -> Callable[[Rule], Rule]:
    """Decorator: register `rule` under `name` (an error if the name is taken). `reads_reference=False`
    declares that the rule never reads `batch.ref_logprobs`."""
    if not name or ":" in name:
        raise ValueError(f"a termination rule's name must be non-empty and without ':', got {name!r}")

    def decorate(rule: Rule) -> Rule:
        if name in TERMINATION_RULES and TERMINATION_RULES[name] is not rule:
            raise ValueError(f"a termination rule named {name!r} is already registered")
        TERMINATION_RULES[name] = rule
        if reads_reference:
            _REFERENCE_FREE.discard(name)
        else:
            _REFERENCE_FREE.add(name)
        return rule

    return decorate


def get_termination(spec: str) -> Rule:
    """The rule registered as `spec`, or the function at the dotted path `package.module:function`."""
    if spec in TERMINATION_RULES:
        return TERMINATION_RULES[spec]
    if ":" not in spec:
        raise ValueError(f"termination must be one of {sorted(TERMINATION_RULES)} or a dotted path "
                         f"'package.module:function', got {spec!r}")
    return import_function(spec, "termination")


def reads_reference(spec: str) -> bool:
    """Whether the rule named by `spec` may read the reference's log-probs: True unless it was registered
    with ``reads_reference=False`` (a dotted-path rule may read them)."""
    get_termination(spec)  # an unknown rule is an error here too
    return not (spec in TERMINATION_RULES and spec in _REFERENCE_FREE)


def segment(spec: str, batch: SegmentationBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the rule named by `spec`: (segment_ids, stats)."""
    out = get_termination(spec)(batch)
    segment_ids, stats = out if isinstance(out, tuple) else (out, {})
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.shape != batch.response_mask.shape:
        raise ValueError(f"termination {spec!r} must return segment_ids shaped like the responses "
                         f"{tuple(batch.response_mask.shape)}")
    return segment_ids, stats


@register_termination("fixed", reads_reference=False)
def _fixed(batch: SegmentationBatch) -> torch.Tensor:
    return fixed_ngram(batch.response_mask, batch.options.ngram)


@register_termination("randomized", reads_reference=False)
def _randomized(batch: SegmentationBatch) -> torch.Tensor:
    # Drawn for the rows of all processes from the step's seed: a row's lengths do not depend on the
    # number of processes.
    generator = torch.Generator().manual_seed(batch.seed)
    all_ids = randomized_ngram(batch.gather_rows(batch.response_mask), batch.options.randomized_lengths,
                               batch.options.repeat_times, generator)
    return batch.own_rows(all_ids)


@register_termination("perplexity")
def _perplexity(batch: SegmentationBatch) -> torch.Tensor:
    return perplexity(batch.response_mask, batch.ref_logprobs)


@register_termination("parsing", reads_reference=False)
def _parsing(batch: SegmentationBatch) -> tuple[torch.Tensor, dict[str, float]]:
    segment_ids, fallbacks = parsing(batch.response_ids, batch.response_mask, batch.tokenizer,
                                     batch.options.parsing_cutoff, batch.options.parsing_language)
    return segment_ids, {"parse_fallbacks": fallbacks}


@register_termination("word", reads_reference=False)
def _word(batch: SegmentationBatch) -> torch.Tensor:
    return words(batch.response_mask, word_starts(batch.response_ids, batch.tokenizer))
