"""Termination rules: how PPO groups a rollout's response tokens into macro actions.

A rule is a function of one :class:`SegmentationBatch` that returns ``segment_ids`` (long ``[B, T]``, the
convention of :mod:`marlhf.segments`), or ``(segment_ids, stats)`` with ``stats`` a dict of numbers that
PPO logs as ``macro/<name>``. The built-in rules are registered under their names (fixed, randomized,
perplexity, parsing, word); a new one is one decorated function (docs/plugins.md shows one that ends a macro
action at every sentence end), used as ``PPOConfig(termination="<name>")`` after the import, or by its dotted
path on the command line: ``--termination my_pkg.rules:sentences`` (marlhf.plugins: the same seam as the
estimators, policy losses and rollout engines). A rule may declare its own options as a dataclass
(``register_termination(name, options=...)``); it finds them in ``batch.options``. A rule may read the
reference's log-probs (``perplexity`` does); one registered with ``reads_reference=False`` lets PPO drop the
reference model when its KL coefficient is 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.parsing import ParsingLanguage
from marlhf.plugins import Plugin, Registry
from marlhf.segments import fixed_ngram, parsing, perplexity, randomized_ngram, word_starts, words

__all__ = ["SegmentationBatch", "REGISTRY", "TERMINATION_RULES", "register_termination", "get_termination",
           "reads_reference", "segment"]


@dataclasses.dataclass(frozen=True)
class SegmentationBatch:
    """What a rule may look at. Rows are this process's responses, right-padded.

    response_ids: long [B, T]; response_mask: bool [B, T]; ref_logprobs: float [B, T] (the frozen
    reference's log-probs of the sampled tokens; None for a rule registered with ``reads_reference=False``
    when PPO runs without a reference); tokenizer: the policy's; options: the rule's own options (an instance
    of the dataclass it registered, None if it declared none); seed: a per-step seed for random rules;
    gather_rows / own_rows: stack the rows of every process / take this process's rows back, for rules that
    must draw for all processes' rows at once (identity functions in a single process); config: the whole PPO
    config, read-only.
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    tokenizer: Any
    options: Any
    seed: int
    gather_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    own_rows: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    config: Any = None


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
    """Run the rule (a plug-in, or its name or dotted path): (segment_ids, stats)."""
    rule = get_termination(rule) if isinstance(rule, str) else rule
    out = rule.obj(batch)
    segment_ids, stats = out if isinstance(out, tuple) else (out, {})
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.shape != batch.response_mask.shape:
        raise ValueError(f"termination {rule.name!r} must return segment_ids shaped like the responses "
                         f"{tuple(batch.response_mask.shape)}")
    return segment_ids, stats


# The built-in rules' options are PPOConfig's flat options of the same names (marlhf.plugins).
@dataclasses.dataclass(frozen=True)
class FixedOptions:
    ngram: int | None = 5  # tokens per macro action (None: the whole response is one)


@dataclasses.dataclass(frozen=True)
class RandomizedOptions:
    randomized_lengths: tuple[int, ...] = (2, 3, 5, 10)
    repeat_times: int = 3


@dataclasses.dataclass(frozen=True)
class ParsingOptions:
    parsing_cutoff: int = 5
    parsing_language: ParsingLanguage = "auto"


@register_termination("fixed", options=FixedOptions, reads_reference=False)
def _fixed(batch: SegmentationBatch) -> torch.Tensor:
    return fixed_ngram(batch.response_mask, batch.options.ngram)


@register_termination("randomized", options=RandomizedOptions, reads_reference=False)
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


@register_termination("parsing", options=ParsingOptions, reads_reference=False)
def _parsing(batch: SegmentationBatch) -> tuple[torch.Tensor, dict[str, float]]:
    segment_ids, fallbacks = parsing(batch.response_ids, batch.response_mask, batch.tokenizer,
                                     batch.options.parsing_cutoff, batch.options.parsing_language)
    return segment_ids, {"parse_fallbacks": fallbacks}


@register_termination("word", reads_reference=False)
def _word(batch: SegmentationBatch) -> torch.Tensor:
    return words(batch.response_mask, word_starts(batch.response_ids, batch.tokenizer))
