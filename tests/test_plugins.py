"""One seam for every plug-in kind: a user's termination rule, estimator, policy loss and engine, each with its own
options, chosen by dotted path from Python, YAML and the command line (marlhf.plugins)."""

from __future__ import annotations

import dataclasses

import pytest

from marlhf.cli import build_parser
from marlhf.logging_utils import read_metrics
from marlhf.plugins import Plugin, Registry
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests import plugin_examples
from tests.trainers.test_ppo import RECORDS, _config, count_e

USER = dict(termination="tests.plugin_examples:every_k", advantage="tests.plugin_examples:shifted_reinforce",
            policy_loss="tests.plugin_examples:scaled_clip", rollout_engine="tests.plugin_examples:TaggedEngine")


def test_a_users_plugins_with_their_options_run_a_ppo_step(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    for calls in plugin_examples.CALLS.values():
        calls.clear()
    config = _config(tmp_path, max_steps=1, kl_coef=0.0, **USER, termination_options={"k": 3},
                     advantage_options={"shift": 0.5}, policy_loss_options={"scale": 2.0},
                     rollout_engine_options={"tag": "x"})
    assert not config.uses_critic and not config.uses_reference  # the estimator's and the rule's traits
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    calls = plugin_examples.CALLS
    assert calls["rule"] == [plugin_examples.EveryK(k=3)]
    assert calls["estimator"] == [plugin_examples.Shifted(shift=0.5)]
    assert calls["loss"] and set(calls["loss"]) == {plugin_examples.Scaled(scale=2.0, clip=0.2)}
    assert calls["engine"] == [plugin_examples.Tagged(tag="x")]
    (metrics,) = read_metrics(tmp_path / "ppo")
    assert metrics["macro/mean_segment_length"] > 2 and "loss/value" not in metrics


def test_blocks_from_yaml_and_the_command_line(tmp_path):
    yaml_file = tmp_path / "ppo.yaml"
    yaml_file.write_text("termination: {name: tests.plugin_examples:every_k, k: 4}\n"
                         "advantage: {name: gae, lam: 0.9}\n"
                         "rollout_engine: {name: hf, kv_cache: static}\n")
    config = PPOConfig.from_yaml(yaml_file)
    assert (config.termination, config.termination_options) == ("tests.plugin_examples:every_k", {"k": 4})
    assert (config.advantage, config.lam, config.advantage_options) == ("gae", 0.9, None)  # PPO's own option
    assert config.kv_cache == "static" and config.plugin_options("termination") == plugin_examples.EveryK(k=4)

    parser = build_parser("ppo")
    for argv in (["--termination", "tests.plugin_examples:every_k", "--termination_options", "{k: 5}"],
                 ["--termination", "{name: tests.plugin_examples:every_k, k: 5}"]):
        config = PPOConfig.from_arguments(parser.parse_args(["ppo", *argv]))
        assert config.plugin_options("termination") == plugin_examples.EveryK(k=5), argv
    old_flags = PPOConfig.from_arguments(parser.parse_args(["ppo", "--termination", "randomized", "--repeat_times",
                                                            "2", "--ngram", "3"]))
    assert old_flags.plugin_options("termination").repeat_times == 2 and old_flags.ngram == 3


@pytest.mark.parametrize("options, message", [
    (dict(termination="tests.plugin_examples:every_k", termination_options={"kk": 3}),
     r"termination rule 'every_k' has no option 'kk' \(did you mean 'k'\?\); its options: k"),
    (dict(termination="fixed", termination_options={"k": 3}), r"termination rule 'fixed' has no option 'k'"),
    (dict(policy_loss="tests.plugin_examples:scaled_clip", policy_loss_options={"scale": "big"}),
     r"policy loss 'scaled_clip' option 'scale' must be a number, got 'big'"),
    (dict(termination="fixed", termination_options={"ngram": 3}), r"'ngram' is a PPO option: set it as ngram"),
    (dict(advantage="gea"), r"advantage must be one of .* got 'gea' \(did you mean 'gae'\?\)"),
    (dict(policy_loss="tests.plugin_examples:nothing"), r"policy_loss 'tests.plugin_examples:nothing': cannot import"),
    (dict(rollout_engine="tests.plugin_examples:TaggedEngine", kv_cache="static"),
     r"kv_cache='static' is the hf engine's option"),
])
def test_a_wrong_option_names_the_plugin_and_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**options)
    with pytest.raises(ValueError, match="needs the plug-in's name"):
        PPOConfig.from_dict({"termination": {"ngram": 3}})
    with pytest.raises(ValueError, match="ngram is given twice"):
        PPOConfig.from_dict({"termination": {"name": "fixed", "ngram": 3}, "ngram": 4})


def test_registry_rules_and_help():
    registry = Registry("widget", "widget", fast=False)

    @dataclasses.dataclass
    class Size:
        size: int = 1

    registry.register("w", options=Size, fast=True)(len)
    assert registry.get("w") == Plugin("widget", "w", len, Size, {"fast": True}) and registry.get("w").fast
    with pytest.raises(TypeError, match="no trait 'slow'"):
        registry.register("v", slow=True)
    with pytest.raises(TypeError, match="must be a dataclass"):
        registry.register("v", options=int)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("w")(print)
    with pytest.raises(AttributeError, match="no trait 'speed'"):
        registry.get("w").speed
    usage = build_parser("ppo").format_help() + build_parser("ppo")._subparsers._group_actions[0].choices[
        "ppo"].format_help()
    assert "fixed (ngram=5)" in usage and "gae (gamma=1.0" in usage and "ppo (clip_range=0.2" in usage

