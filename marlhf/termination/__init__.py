"""Termination rules: how PPO groups a rollout's response tokens into macro actions.

A rule is a function of one :class:`SegmentationBatch` that returns ``segment_ids`` (long ``[B, T]``, the
convention of :mod:`marlhf.segments`), or ``(segment_ids, stats)`` with ``stats`` a dict of numbers that PPO logs
as ``macro/<name>``. The batch holds what a rule may look at (the responses, the reference's log-probs, the
tokenizer, a per-step seed, the rule's own options), never the run's config. This package holds the registry
(``base.py``) and the built-in rules, one file each: fixed, randomized, perplexity, parsing, word, low_prob (SPO's
cutpoints, from the sampling policy's log-probs in ``batch.logprobs``), turn (one macro action per policy turn of a
multi-turn episode, from ``batch.turn_ids``; with ``turn_ids`` every rule's segments are cut at the turns). A new
rule is
one decorated function in a file of its own (docs/plugins.md shows one that ends a macro action at every sentence
end), used as ``PPOConfig(termination="<name>")`` after the import, or by its dotted path on the command line:
``--termination my_pkg.rules:sentences`` (marlhf.plugins: the same seam as the estimators, policy losses and
rollout engines). A rule may declare its own options as a dataclass (``register_termination(name,
options=...)``); it finds them in ``batch.options``. A rule may read the reference's log-probs (``perplexity``
does); one registered with ``reads_reference=False`` lets PPO drop the reference model when its KL coefficient
is 0.
"""

from marlhf.termination.base import (REGISTRY, TERMINATION_RULES, Rule, SegmentationBatch, get_termination,
                                     reads_reference, register_termination, segment)
from marlhf.termination.fixed import FixedOptions  # noqa: E402  (importing a built-in's file registers it)
from marlhf.termination.randomized import RandomizedOptions  # noqa: E402
from marlhf.termination import perplexity  # noqa: F401,E402
from marlhf.termination.parsing import ParsingOptions  # noqa: E402
from marlhf.termination import word  # noqa: F401,E402
from marlhf.termination.low_prob import LowProbOptions  # noqa: E402
from marlhf.termination import turn  # noqa: F401,E402

__all__ = ["SegmentationBatch", "Rule", "REGISTRY", "TERMINATION_RULES", "register_termination", "get_termination",
           "reads_reference", "segment", "FixedOptions", "RandomizedOptions", "ParsingOptions", "LowProbOptions"]
