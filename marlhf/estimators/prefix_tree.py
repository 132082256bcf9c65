"""`prefix_tree`: TEMPO / Prefix-to-Tree (arXiv 2509.18314), GRPO's advantage plus a TD correction on the prefix tree
of each prompt's group of responses, non-zero only at tokens where the group branches. Critic-free."""

from __future__ import annotations

import dataclasses

import torch

from marlhf.advantages import prefix_tree_advantages
from marlhf.config import option
from marlhf.estimators.base import AdvantageBatch, register_estimator


@dataclasses.dataclass(frozen=True)
class PrefixTreeOptions:
    normalize_std: bool = option(True, "divide by the group's standard deviation, as GRPO does")


@register_estimator("prefix_tree", needs_critic=False, min_samples_per_prompt=2, options=PrefixTreeOptions)
def prefix_tree(batch: AdvantageBatch) -> tuple[torch.Tensor, None]:
    """TEMPO: GRPO's advantage plus the prefix tree's TD correction where the group branches
    (marlhf.advantages.prefix_tree_advantages), over all processes' rows, so a group split over processes is one
    tree. A response's outcome is its summed reward, score minus the KL penalty, as `grpo`'s (`rewards.sum(1)`)."""
    if batch.response_ids is None:
        raise ValueError("advantage 'prefix_tree' needs the sampled tokens (AdvantageBatch.response_ids)")
    totals = batch.gather_rows(batch.rewards.sum(dim=1))
    ids, mask = batch.gather_rows(batch.response_ids), batch.gather_rows(batch.mask)
    advantages = prefix_tree_advantages(totals, ids, mask, batch.num_samples_per_prompt,
                                        normalize_std=batch.options.normalize_std)
    return batch.own_rows(advantages), None
