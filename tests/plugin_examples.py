"""A user's plug-ins, one of each kind with options of its own, named by dotted path in tests/test_plugins.py
(importing this module registers them). Each reads only its batch (or context): the facts it declares, never the
run's config."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.engines import HFEngine, register_engine
from marlhf.estimators import register_estimator
from marlhf.losses import policy_loss
from marlhf.policy_losses import register_policy_loss
from marlhf.segments import fixed_ngram
from marlhf.termination import register_termination

CALLS: dict[str, list] = {"rule": [], "estimator": [], "loss": [], "engine": []}


@dataclasses.dataclass(frozen=True)
class EveryK:
    k: int = 2  # tokens per macro action


@register_termination("every_k", options=EveryK, reads_reference=False)
def every_k(batch):
    CALLS["rule"].append(batch.options)
    return fixed_ngram(batch.response_mask, batch.options.k)


@dataclasses.dataclass(frozen=True)
class Shifted:
    shift: float = 0.0  # subtracted from every response's summed reward


@register_estimator("shifted_reinforce", needs_critic=False, options=Shifted)
def shifted_reinforce(batch):
    CALLS["estimator"].append((batch.options, batch.num_samples_per_prompt))
    totals = batch.gather_rows(batch.rewards.sum(dim=1)) - batch.options.shift
    return torch.where(batch.mask, batch.own_rows(totals)[:, None], 0.0), None


@dataclasses.dataclass(frozen=True)
class Scaled:
    scale: float = 1.0
    clip: float = 0.2


@register_policy_loss("scaled_clip", options=Scaled)
def scaled_clip(batch):
    CALLS["loss"].append(batch.options)
    loss, stats = policy_loss(batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask, batch.segment_ids,
                              batch.options.clip, loss_agg_mode=batch.loss_agg_mode, num_slots=batch.num_slots)
    return batch.options.scale * loss, stats


@dataclasses.dataclass(frozen=True)
class Tagged:
    tag: str = "none"


@register_engine("tagged", options=Tagged)
class TaggedEngine(HFEngine):
    """The hf sampler, recording the options it was made with."""

    def __init__(self, context) -> None:
        super().__init__(None)
        CALLS["engine"].append((context.options, context.max_length))
