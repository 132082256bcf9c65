"""Advantage estimators behind one interface: built-ins equal the core functions; a registered one trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from marlhf.advantages import grpo, length_adaptive_lam, macro_gae, reinforce, rloo
from marlhf.estimators import ESTIMATORS, AdvantageBatch, get_estimator, register_estimator
from marlhf.logging_utils import read_metrics
from marlhf.segments import fixed_ngram, num_segments
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.reference import random_batch
from tests.trainers.test_ppo import RECORDS, _config, count_e


def _batch(**options) -> AdvantageBatch:
    g = torch.Generator().manual_seed(0)
    mask, _ = random_batch(8, 7, g)
    rewards = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    values = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    config = PPOConfig(**options)
    segment_ids = fixed_ngram(mask, config.plugin_options("termination").ngram)
    return AdvantageBatch(rewards, values, mask, segment_ids, config.plugin_options("advantage"),
                          config.num_samples_per_prompt, config.value_weighting)


def test_builtins_are_the_core_functions():
    assert {name: (e.needs_critic, e.min_samples_per_prompt) for name, e in ESTIMATORS.items()
            if name in ("gae", "rloo", "grpo", "reinforce")} == {
        "gae": (True, 1), "rloo": (False, 2), "grpo": (False, 2), "reinforce": (False, 1)}
    batch = _batch(value_weighting="first", lam=0.9, ngram=3)
    advantages, returns = get_estimator("gae").obj(batch)
    expected = macro_gae(batch.rewards, batch.values, batch.mask, batch.segment_ids, 1.0, 0.9, "first")
    assert torch.equal(advantages, expected[0]) and torch.equal(returns, expected[1])
    totals = batch.rewards.sum(1)
    for name, reference in (("rloo", rloo(totals, 2)), ("grpo", grpo(totals, 2)), ("reinforce", reinforce(totals))):
        advantages, returns = get_estimator(name).obj(_batch(advantage=name, num_samples_per_prompt=2)
                                                     if name != "reinforce" else batch)
        assert returns is None
        assert torch.equal(advantages, torch.where(batch.mask, reference[:, None], 0.0)), name


def test_every_built_in_estimator_is_named_where_the_estimators_are_listed():
    """The lists a reader meets (the package's docstring, `--advantage`'s help, the PPO trainer's docstring, the API
    index and the glossary) name every built-in estimator: one added without them fails here."""
    import marlhf.estimators
    import marlhf.trainers.ppo
    from marlhf.cli import build_parser

    built_in = [name for name, e in ESTIMATORS.items() if e.obj.__module__.startswith("marlhf.estimators.")]
    assert {"gae", "rloo", "grpo", "reinforce", "prefix_tree", "entropy_weighted", "mc_segment"} <= set(built_in)
    parser = build_parser("ppo").commands["ppo"]
    docs = Path(__file__).resolve().parents[1] / "docs"
    lists = {"marlhf.estimators": marlhf.estimators.__doc__, "marlhf.trainers.ppo": marlhf.trainers.ppo.__doc__,
             "--advantage": next(a.help for a in parser._actions if "--advantage" in a.option_strings),
             "docs/api/index.md": (docs / "api" / "index.md").read_text(),
             "docs/glossary.md": (docs / "glossary.md").read_text()}
    missing = {where: [name for name in built_in if not re.search(rf"\b{name}\b", text)]
               for where, text in lists.items()}
    assert missing == {where: [] for where in lists}


@pytest.mark.parametrize("ngram", [1, 3])
def test_gae_lambda_schedules(ngram):
    """The actor's advantages take the schedule's lambda, the critic's returns lam_critic (else lam)."""
    def gae(batch, lam):
        return macro_gae(batch.rewards, batch.values, batch.mask, batch.segment_ids, 1.0, lam, "first")

    decoupled = _batch(ngram=ngram, lam=0.9, lam_critic=1.0)
    advantages, returns = get_estimator("gae").obj(decoupled)
    assert torch.equal(advantages, gae(decoupled, 0.9)[0]) and torch.equal(returns, gae(decoupled, 1.0)[1])
    assert not torch.equal(returns, gae(decoupled, 0.9)[1])

    adaptive = _batch(ngram=ngram, lam=0.8, lam_schedule="length_adaptive", lam_alpha=0.9)
    advantages, returns = get_estimator("gae").obj(adaptive)
    per_row = length_adaptive_lam(num_segments(adaptive.segment_ids), 0.9)  # over macro actions
    assert len(set(per_row.tolist())) >= 2  # rows of different lengths get different lambdas
    assert torch.equal(advantages, gae(adaptive, per_row)[0]) and torch.equal(returns, gae(adaptive, 0.8)[1])


def test_unknown_estimator_and_too_few_samples_are_refused():
    with pytest.raises(ValueError, match="advantage must be one of"):
        PPOConfig(advantage="ppo")
    with pytest.raises(ValueError, match="num_samples_per_prompt >= 2"):
        PPOConfig(advantage="grpo")
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("gae", needs_critic=False)(lambda batch: None)


def test_a_registered_critic_free_estimator_trains_without_a_critic(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    seen = []

    @register_estimator("sign", needs_critic=False)
    def sign(batch):  # +1 / -1 by whether a response's total beats the batch median
        totals = batch.gather_rows(batch.rewards.sum(dim=1))
        seen.append(batch.values)
        advantages = batch.own_rows(torch.sign(totals - totals.median()))
        return torch.where(batch.mask, advantages[:, None], 0.0), None

    try:
        config = _config(tmp_path, advantage="sign", max_steps=2)
        assert not config.uses_critic
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        metrics = read_metrics(tmp_path / "ppo")
        assert len(metrics) == 2 and "loss/value" not in metrics[0] and seen == [None, None]
    finally:
        ESTIMATORS.pop("sign")


def test_gae_passes_every_default_the_math_has_explicitly(monkeypatch):
    """macro_gae's defaults are the paper's (lam 0.95, value_weighting "equal"), the trainer's are lam 1 and "first":
    the estimator passes all of them, so the math's defaults never decide a run (marlhf.advantages, Defaults)."""
    import inspect

    import marlhf.estimators.gae as gae_module

    calls = []

    def recording(*args, **kwargs):
        calls.append(inspect.signature(macro_gae).bind(*args, **kwargs).arguments)
        return macro_gae(*args, **kwargs)

    monkeypatch.setattr(gae_module, "macro_gae", recording)
    get_estimator("gae").obj(_batch())
    defaulted = [name for name, p in inspect.signature(macro_gae).parameters.items() if p.default is not p.empty]
    assert calls and all(set(defaulted) <= set(call) for call in calls)
    assert (calls[0]["lam"], calls[0]["value_weighting"]) == (1.0, "first")  # the trainer's, not the paper's
