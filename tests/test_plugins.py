"""One seam for every plug-in kind: a user's termination rule, estimator, policy loss and engine, each with its own
options, chosen by dotted path from Python, YAML and the command line (marlhf.plugins); plug-ins see typed batches,
never the config; a package of a user's plug-ins and a dataset trains with no change to marlhf."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys

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
    assert calls["estimator"] == [(plugin_examples.Shifted(shift=0.5), 1)]
    assert calls["loss"] and set(calls["loss"]) == {plugin_examples.Scaled(scale=2.0, clip=0.2)}
    assert calls["engine"] == [(plugin_examples.Tagged(tag="x"), config.max_length)]
    (metrics,) = read_metrics(tmp_path / "ppo")
    assert metrics["macro/mean_segment_length"] > 2 and "loss/value" not in metrics


def test_blocks_from_yaml_and_the_command_line(tmp_path):
    yaml_file = tmp_path / "ppo.yaml"
    yaml_file.write_text("termination: {name: tests.plugin_examples:every_k, k: 4}\n"
                         "advantage: {name: gae, lam: 0.9}\n"
                         "rollout_engine: {name: hf, kv_cache: static}\n")
    config = PPOConfig.from_yaml(yaml_file)
    assert (config.termination, config.termination_options) == ("tests.plugin_examples:every_k", {"k": 4})
    # a built-in plug-in's option lives in its kind's block, read from there; config files write it flat
    assert (config.advantage, config.plugin_options("advantage").lam, config.advantage_options) == (
        "gae", 0.9, {"lam": 0.9})
    assert config.to_dict()["lam"] == 0.9 and config.to_dict()["advantage_options"] is None
    assert config.plugin_options("rollout_engine").kv_cache == "static"
    assert config.plugin_options("termination") == plugin_examples.EveryK(k=4)

    parser = build_parser("ppo")
    for argv in (["--termination", "tests.plugin_examples:every_k", "--termination_options", "{k: 5}"],
                 ["--termination", "{name: tests.plugin_examples:every_k, k: 5}"]):
        config = PPOConfig.from_arguments(parser.parse_args(["ppo", *argv]))
        assert config.plugin_options("termination") == plugin_examples.EveryK(k=5), argv
    old_flags = PPOConfig.from_arguments(parser.parse_args(["ppo", "--termination", "randomized", "--repeat_times",
                                                            "2", "--ngram", "3"]))
    assert old_flags.plugin_options("termination").repeat_times == 2
    assert old_flags.termination_options == {"repeat_times": 2, "ngram": 3}  # ngram kept for the fixed rule


@pytest.mark.parametrize("options, message", [
    (dict(termination="tests.plugin_examples:every_k", termination_options={"kk": 3}),
     r"termination rule 'every_k' has no option 'kk' \(did you mean 'k'\?\); its options: k"),
    (dict(termination="fixed", termination_options={"k": 3}), r"termination rule 'fixed' has no option 'k'"),
    (dict(policy_loss="tests.plugin_examples:scaled_clip", policy_loss_options={"scale": "big"}),
     r"policy loss 'scaled_clip' option 'scale' must be a number, got 'big'"),
    (dict(termination="fixed", termination_options={"lam": 3}),
     r"termination_options: 'lam' is an option of advantage estimator 'gae': set it as lam or in advantage_options"),
    (dict(termination="fixed", termination_options={"ngram": 0}), r"termination rule 'fixed' option 'ngram' must be >= 1, got 0"),
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


def test_plugin_batches_carry_facts_not_the_config():
    """What a plug-in reads is what its batch declares: no batch (nor an engine's context) hands over the config."""
    from marlhf.engines import EngineContext
    from marlhf.estimators import AdvantageBatch
    from marlhf.policy_losses import PolicyLossBatch
    from marlhf.termination import SegmentationBatch

    for batch in (SegmentationBatch, AdvantageBatch, PolicyLossBatch, EngineContext):
        names = {f.name for f in dataclasses.fields(batch)}
        assert "config" not in names and "options" in names, batch.__name__
    assert {"num_samples_per_prompt", "value_weighting"} <= {f.name for f in dataclasses.fields(AdvantageBatch)}


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
    for title in ("termination rule fixed (--termination fixed", "advantage estimator gae (--advantage gae",
                  "policy loss ppo (--policy_loss ppo", "rollout engine hf (--rollout_engine hf"):
        assert title in usage, title
    assert "perplexity; turn; word" in usage  # the rules without options, by name



# A user's package of plug-ins, one file per kind and a dataset, written outside marlhf and named by dotted path.
USER_PACKAGE = {
    "rule.py": '''
import dataclasses

from marlhf.segments import fixed_ngram
from marlhf.termination import register_termination


@dataclasses.dataclass(frozen=True)
class Pairs:
    size: int = 2


@register_termination("user_pairs", options=Pairs, reads_reference=False)
def pairs(batch):
    return fixed_ngram(batch.response_mask, batch.options.size), {"pair_size": float(batch.options.size)}
''',
    "estimator.py": '''
import torch

from marlhf.estimators import register_estimator

SEEN = []


@register_estimator("user_group_mean", needs_critic=False, min_samples_per_prompt=2)
def group_mean(batch):
    """Each response's summed reward minus its group's mean (the group size comes with the batch)."""
    SEEN.append((batch.num_samples_per_prompt, batch.value_weighting))
    groups = batch.gather_rows(batch.rewards.sum(dim=1)).view(-1, batch.num_samples_per_prompt)
    advantages = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    return torch.where(batch.mask, batch.own_rows(advantages)[:, None], 0.0), None
''',
    "loss.py": '''
import dataclasses

from marlhf.losses import policy_loss
from marlhf.policy_losses import register_policy_loss


@dataclasses.dataclass(frozen=True)
class Scale:
    factor: float = 1.0


@register_policy_loss("user_scaled", options=Scale)
def scaled(batch):
    loss, stats = policy_loss(batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask, batch.segment_ids,
                              0.2, loss_agg_mode=batch.loss_agg_mode, num_slots=batch.num_slots)
    return batch.options.factor * loss, stats
''',
    "engine.py": '''
from marlhf.engines import Generation, register_engine
from marlhf.engines.hf import generate_responses

EVENTS = []


@register_engine("user_engine")
class CounterHashEngine:
    """transformers' generate with the counter-hash noise, written against the engine protocol alone."""

    def __init__(self, context):
        self.policy, self.max_length = None, context.max_length

    def sync_weights(self, policy):
        self.policy = policy
        EVENTS.append("sync")

    def generate(self, prompt_ids, prompt_mask, **sampling):
        EVENTS.append("generate")
        return Generation(*generate_responses(self.policy, prompt_ids, prompt_mask, sampling_noise="counter_hash",
                                              **sampling))

    def close(self):
        EVENTS.append("close")
''',
    "data.py": '''
from marlhf.data.tasks import Task, register_task, text_field


def to_record(row, stage):
    return {"prompt": f"Human: say something about {text_field(row.get('topic'), 'topic')}\\n\\nAssistant:"}


TASK = register_task(Task(name="user_topics", hub_id="", hub_kwargs={}, train_split="train", eval_split="test",
                          stage_fractions={"rl": 1.0}, to_record=to_record))
''',
}


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """The package `user_plugins` on sys.path; afterwards its modules and what they registered are gone."""
    from marlhf.data.tasks import TASKS
    from marlhf.trainers.ppo_config import PLUGINS

    package = tmp_path / "user_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in USER_PACKAGE.items():
        (package / name).write_text(text.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_plugins"
    for registry in PLUGINS.values():
        for name in [n for n in registry.names() if n.startswith("user_")]:
            registry.plugins.pop(name)
    TASKS.pop("user_topics", None)
    for module in [m for m in sys.modules if m == "user_plugins" or m.startswith("user_plugins.")]:
        del sys.modules[module]


def test_a_package_of_plugins_and_a_dataset_trains_by_dotted_path(tmp_path, user_package, make_tiny_causal_lm,
                                                                   tiny_tokenizer):
    """A termination rule, an estimator, a policy loss, an engine and a dataset, one file each outside marlhf, chosen
    by dotted path with their options: two PPO steps on the dataset's records, and the engine closed at the end."""
    topics = tmp_path / "topics.jsonl"
    topics.write_text("".join(json.dumps({"topic": topic}) + "\n" for topic in ("cats", "dogs", "bread", "rain")))
    config = _config(tmp_path, max_steps=2, per_device_batch_size=2, num_samples_per_prompt=2, mini_batch_size=4,
                     kl_coef=0.0, dataset=str(topics), dataset_task=f"{user_package}.data:TASK",
                     termination=f"{user_package}.rule:pairs", termination_options={"size": 3},
                     advantage=f"{user_package}.estimator:group_mean",
                     policy_loss=f"{user_package}.loss:scaled", policy_loss_options={"factor": 0.5},
                     rollout_engine=f"{user_package}.engine:CounterHashEngine")
    assert not config.uses_critic and not config.uses_reference
    train_ppo(config, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)

    package = importlib.import_module(user_package)
    assert package.engine.EVENTS == ["sync", "generate"] * 2 + ["close"]
    assert package.estimator.SEEN == [(2, config.value_weighting)] * 2
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["macro/pair_size"] for m in metrics] == [3.0, 3.0] and "loss/value" not in metrics[0]
    assert all(m["macro/mean_segment_length"] > 1 for m in metrics)
