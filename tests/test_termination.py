"""Termination rules behind one interface: the registry, dotted paths, and the plug-in guide's custom rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from marlhf.segments import fixed_ngram
from marlhf.termination import (TERMINATION_RULES, SegmentationBatch, get_termination, reads_reference,
                                register_termination, segment)
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.test_ppo import RECORDS, _config, count_e


def pairs(batch: SegmentationBatch) -> torch.Tensor:
    """A rule reached by its dotted path, tests.test_termination:pairs."""
    return fixed_ngram(batch.response_mask, 2)


def _batch(tokenizer, texts: list[str], **options) -> SegmentationBatch:
    """The texts as a batch, with the options of the rule that PPOConfig(**options) names."""
    encoded = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_token_id] * (width - len(e)) for e in encoded])
    mask = torch.arange(width)[None, :] < torch.tensor([len(e) for e in encoded])[:, None]
    config = PPOConfig(**options)
    return SegmentationBatch(ids, mask, torch.zeros(mask.shape), tokenizer, config.plugin_options("termination"),
                             seed=0)


def test_builtin_rules_are_registered_and_unknown_names_are_refused():
    assert {"fixed", "randomized", "perplexity", "parsing", "word"} <= set(TERMINATION_RULES)
    assert get_termination("tests.test_termination:pairs").obj is pairs
    for bad, message in (("fixd", "one of"), ("tests.test_termination:nothing", "cannot import"),
                         ("no_such_module:rule", "cannot import"), ("tests.test_termination:RECORDS", "not a function")):
        with pytest.raises(ValueError, match=message):
            get_termination(bad)
        with pytest.raises(ValueError, match="termination"):
            PPOConfig(termination=bad)
    with pytest.raises(ValueError, match="already registered"):
        register_termination("fixed")(pairs)
    with pytest.raises(ValueError, match="name"):
        register_termination("a:b")


def test_which_rules_read_the_reference():
    assert [name for name in ("fixed", "randomized", "perplexity", "parsing", "word") if reads_reference(name)] == [
        "perplexity"]
    assert reads_reference("tests.test_termination:pairs")  # a dotted path may read it
    register_termination("free_pairs", reads_reference=False)(pairs)
    try:
        assert not reads_reference("free_pairs")
        TERMINATION_RULES.pop("free_pairs")
        register_termination("free_pairs")(pairs)  # the name registered again, as a reader this time
        assert reads_reference("free_pairs")
    finally:
        TERMINATION_RULES.pop("free_pairs")
    with pytest.raises(ValueError, match="one of"):
        reads_reference("fixd")


def test_builtins_through_the_interface(tiny_tokenizer):
    batch = _batch(tiny_tokenizer, ["Human: hello there", "ok"], ngram=3)
    ids, stats = segment("fixed", batch)
    assert torch.equal(ids, fixed_ngram(batch.response_mask, 3)) and stats == {}
    ids, stats = segment("parsing", _batch(tiny_tokenizer, ["x = 1\ny = 2"], termination="parsing",
                                           parsing_language="python"))
    assert set(stats) == {"parse_fallbacks"}
    with pytest.raises(ValueError, match="shaped like"):
        register_termination("broken")(lambda b: b.response_mask[:, :1].long())
        segment("broken", batch)
    TERMINATION_RULES.pop("broken")


def test_plugin_guide_custom_rule(tiny_tokenizer):
    """The plug-in guide's 10-line rule (docs/plugins.md), run as written: a segment ends after every '.', '!' or
    '?'."""
    guide = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", guide, re.S) if "register_termination" in block)
    namespace: dict = {}
    exec(code, namespace)
    try:
        batch = _batch(tiny_tokenizer, ["Yes. No! Why? Fine", "a b"])
        ids, _ = segment("sentences", batch)
        tokens = tiny_tokenizer.convert_ids_to_tokens(batch.response_ids[0])
        expected, current = [], 0
        for token in tokens:
            expected.append(current)
            current += token in (".", "!", "?")
        assert ids[0].tolist() == expected and ids[0].max().item() == 3
        assert ids[1].tolist() == [0] * int(batch.response_mask[1].sum()) + [-1] * int((~batch.response_mask[1]).sum())
    finally:
        TERMINATION_RULES.pop("sentences")


@pytest.mark.parametrize("termination", ["tests.test_termination:pairs", "registered_pairs"])
def test_ppo_runs_a_user_rule(tmp_path, make_tiny_causal_lm, tiny_tokenizer, termination):
    register_termination("registered_pairs")(pairs)
    try:
        config = _config(tmp_path, termination=termination, max_steps=1)
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        from marlhf.logging_utils import read_metrics

        (metrics,) = read_metrics(tmp_path / "ppo")
        length = metrics["objective/response_length"]
        assert 1.0 < metrics["macro/mean_segment_length"] <= 2.0 or length <= 1.0
    finally:
        TERMINATION_RULES.pop("registered_pairs")
