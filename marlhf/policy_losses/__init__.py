"""Policy losses behind one interface (marlhf.plugins: the same seam as the termination rules, advantage
estimators and rollout engines).

A policy loss maps one piece of a PPO update to ``(loss, stats)``:

    loss.obj(batch: PolicyLossBatch) -> (0-dim loss, {name: 0-dim tensor})

The batch carries the piece's tensors, the loss aggregation, the largest segment count of a row and the loss's own
options; never the run's config. PPO logs `loss/policy` and, when the stats have them, `policy/clipfrac` and
`policy/approxkl`. Its `units` trait says what the loss is a mean over, `units(mask, segment_ids, options,
loss_agg_mode) -> 0-dim tensor`, so that pieces of one mini-batch add up to one mean (default: tokens, or
responses with a seq-mean `loss_agg_mode`). This package holds the registry (`base.py`) and the built-in `ppo`
(`ppo.py`), the clipped surrogate of :func:`marlhf.losses.policy_loss` (one joint ratio per macro action; its
options are PPOConfig's clip_range, ratio_granularity, segment_weighting and tis_cap). A new loss is one file that
registers itself with `register_policy_loss`.
"""

from marlhf.policy_losses.base import POLICY_LOSSES, REGISTRY, PolicyLossBatch, register_policy_loss
from marlhf.policy_losses.ppo import ClippedOptions  # noqa: E402  (importing a built-in's file registers it)

__all__ = ["PolicyLossBatch", "REGISTRY", "POLICY_LOSSES", "register_policy_loss", "ClippedOptions"]
