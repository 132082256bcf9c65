"""Advantage estimators behind one interface, like verl's `register_adv_est` (marlhf.plugins: the same seam as
the termination rules, policy losses and rollout engines).

An estimator turns one step's per-token rewards (KL penalty on every token, score on the last) into
per-token advantages and, when it trains a critic, returns:

    estimator.obj(batch: AdvantageBatch) -> (advantages [B, T], returns [B, T] or None)

The batch carries the facts an estimator may need and nothing else: the rows, their segments, the group size
(`num_samples_per_prompt`), how a macro action's value is read from its tokens' (`value_weighting`, as the value
loss reads it) and the estimator's own options; never the run's config. Whether a critic is built and trained is
the estimator's `needs_critic`, and the fewest responses per prompt it works with its `min_samples_per_prompt`.
This package holds the registry (`base.py`) and the built-ins: `gae` (`gae.py`: macro GAE over segments, the
critic's values; `ngram=1` is token-level GAE; its options, `GAEOptions`, are gamma and the lambda schedule), and
the critic-free
sequence estimators `rloo`, `grpo`, `reinforce` (`sequence.py`), which give every token of a response the
advantage of its summed reward (score minus the KL penalty, as TRL's RLOO does), and the critic-free per-token
`prefix_tree` (TEMPO, `prefix_tree.py`: from the sampled tokens, `response_ids`) and `entropy_weighted` (GTPO /
GRPO-S, `entropy_weighted.py`: from the policy's entropy at each token, `entropy`, which PPO computes for an
estimator registered with `reads_entropy=True`), on the same summed reward; the critic-free `mc_segment`
(VinePPO / SPO-chain, `mc_segment.py`: Monte-Carlo values at macro-action boundaries, from continuations the trainer
samples, `continue_and_score`); and `gigpo` (`gigpo.py`: multi-turn episodes, from their turns, `turn_ids`, and
anchor states, `turn_state_ids`). The group statistics (`rloo`, `grpo`, `prefix_tree`) are computed in float64 and
returned in the rewards' dtype. Each declares its options once, in the
dataclass it registers (the built-ins' are also PPOConfig's flat flags: marlhf.plugins). A new one, with options of
its own, is one file:

    @dataclasses.dataclass
    class MyOptions:
        baseline: float = 0.0

    @register_estimator("my_est", needs_critic=False, options=MyOptions)
    def my_est(batch):
        totals = batch.gather_rows(batch.rewards.sum(dim=1))  # batch statistics span all processes
        ...  # batch.options.baseline, batch.num_samples_per_prompt
        return advantages, None
"""

from marlhf.estimators.base import ESTIMATORS, REGISTRY, AdvantageBatch, Estimate, get_estimator, register_estimator
from marlhf.estimators.gae import GAEOptions  # noqa: E402  (importing a built-in's file registers it)
from marlhf.estimators.sequence import GRPOOptions  # noqa: E402
from marlhf.estimators.prefix_tree import PrefixTreeOptions  # noqa: E402
from marlhf.estimators.entropy_weighted import EntropyWeightedOptions  # noqa: E402
from marlhf.estimators.mc_segment import MCSegmentOptions  # noqa: E402
from marlhf.estimators.gigpo import GiGPOOptions  # noqa: E402

__all__ = ["AdvantageBatch", "Estimate", "REGISTRY", "ESTIMATORS", "register_estimator", "get_estimator", "GAEOptions",
           "GRPOOptions", "PrefixTreeOptions", "EntropyWeightedOptions", "MCSegmentOptions", "GiGPOOptions"]
