"""One home per option (issue 36): a plug-in's options are declared once, by its options dataclass; PPOConfig takes
the built-in plug-ins' options flat (`--ngram 5`, `lam: 1`, `PPOConfig(lam=1)`) through input aliases generated
from those dataclasses (marlhf.trainers.ppo_config.FLAT_OPTIONS), and they are read from their typed block
(`config.plugin_options("advantage").lam`); `--help` lists each option once, under its plug-in; the
`rollout_logprobs` mode is `old_logprobs_from`, its old name an alias. The options of a block of no plug-in kind
(BLOCKS: the asynchronous rollouts', the adaptive KL controller's) are declared by its dataclass, read as it
(`config.kl_control`) and taken flat the same way, listed once, in the block's section."""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest

from marlhf import cli
from marlhf.plugins import Registry
from marlhf.trainers.ppo_config import BLOCKS, FLAT_OPTIONS, PLUGINS, PPOConfig, flat_options

PLUGIN_OPTIONS = sorted(name for name, flat in FLAT_OPTIONS.items() if flat.plugin is not None)
BLOCK_OPTIONS = sorted(name for name, flat in FLAT_OPTIONS.items() if flat.plugin is None)


def _builtin_declarations() -> dict[str, list[tuple[str, str | None]]]:
    """{option name: [(kind, plug-in or None for a block), ...]} over every option of marlhf's registered plug-ins
    and of the blocks of no plug-in kind."""
    declared = collections.defaultdict(list)
    for kind, registry in PLUGINS.items():
        for name in registry.names():
            options = registry.get(name).options
            if options is not None and options.__module__.startswith("marlhf."):
                for f in dataclasses.fields(options):
                    declared[f.name].append((kind, name))
    for kind, options in BLOCKS.items():
        for f in dataclasses.fields(options):
            declared[f.name].append((kind, None))
    return declared


def _declaration(flat) -> dataclasses.Field:
    options = BLOCKS[flat.kind] if flat.plugin is None else PLUGINS[flat.kind].get(flat.plugin).options
    return next(f for f in dataclasses.fields(options) if f.name == flat.name)


def _other_value(flat):
    """A valid value of the flat option other than its default."""
    others = {bool: lambda d: not d, int: lambda d: (d or 1) + 1, float: lambda d: d / 2 if d else 0.5}
    if flat.name in ("randomized_lengths",):
        return (2, 4)
    if flat.name == "engine_kwargs":
        return {"max_num_seqs": 4}
    if flat.name == "server_url":
        return "http://127.0.0.1:9"
    choices = getattr(flat.annotation, "__args__", ())
    literal = next((a for a in choices if getattr(a, "__origin__", None) is not None), flat.annotation)
    if getattr(literal, "__args__", None) and isinstance(literal.__args__[0], str):
        return next(c for c in literal.__args__ if c != flat.default)
    if flat.default is None:
        return 0.5 if float in choices else 2
    return others[type(flat.default)](flat.default)


def test_every_flat_option_maps_to_exactly_one_plugin_option():
    declared = _builtin_declarations()
    assert set(FLAT_OPTIONS) == set(declared)  # generated from the dataclasses: all of them, nothing else
    for name, flat in FLAT_OPTIONS.items():
        assert declared[name] == [(flat.kind, flat.plugin)], name  # one plug-in declares it
        assert name not in PPOConfig.field_names(), name  # and PPOConfig does not
        field = _declaration(flat)
        assert flat.field is field and flat.field.metadata.get("help"), name  # its one declaration, with help
        assert not hasattr(PPOConfig(), name), name  # an input alias, not an attribute


@pytest.mark.parametrize("name", PLUGIN_OPTIONS)
def test_a_flat_option_goes_to_its_plugin(name):
    flat = FLAT_OPTIONS[name]
    value = _other_value(flat)
    base = {"rollout_engine": flat.plugin} if flat.kind == "rollout_engine" else {"num_samples_per_prompt": 2}
    config = PPOConfig(**base, **{name: value})
    assert getattr(config, f"{flat.kind}_options") == {name: value}  # its home: the kind's block
    chosen = PPOConfig(**{**base, flat.kind: flat.plugin, name: value})
    assert getattr(chosen.plugin_options(flat.kind), name) == value
    written = chosen.to_dict()
    assert written[name] == (list(value) if isinstance(value, tuple) else value)  # config files: flat, as before
    assert written[f"{flat.kind}_options"] is None
    assert PPOConfig.from_dict(written) == chosen
    assert PPOConfig(**{**base, flat.kind: {"name": flat.plugin, name: value}}) == chosen  # a block in Python


# A valid setting of each block's options away from their defaults (max_staleness > 0 needs a rollout worker).
BLOCK_VALUES = {"async_rollout": {"max_staleness": 2, "rollout_workers": 3, "rollout_worker_threads": 2,
                                  "rollout_worker_timeout": 30.0},
                "kl_control": {"kl_target": 6.0, "kl_horizon": 5000, "kl_coef_max": 2.0},
                "multi_turn": {"max_turns": 3, "max_turn_tokens": 16, "max_response_tokens": 96, "step_timeout": 2.5,
                               "env_errors": "raise", "observation_separator": "|"}}


def test_the_blocks_of_no_plugin_kind():
    assert set(BLOCK_VALUES) == set(BLOCKS) and set(BLOCK_OPTIONS) == {n for v in BLOCK_VALUES.values() for n in v}
    assert len([f for f in PPOConfig.field_names() if f not in PPOConfig.__mro__[1].__dataclass_fields__]) <= 43
    for kind, values in BLOCK_VALUES.items():
        config = PPOConfig(**values)
        assert getattr(config, f"{kind}_options") == values  # their home: the block
        assert dataclasses.asdict(config.block_options(kind)) == values  # read from the typed block
        written = config.to_dict()
        assert f"{kind}_options" not in written and {name: written[name] for name in values} == values  # flat
        assert PPOConfig.from_dict(written) == config == PPOConfig(**{f"{kind}_options": values})
        assert PPOConfig.from_dict({f"{kind}_options": values}) == config
        assert dataclasses.replace(config, **{name: BLOCKS[kind]().__dict__[name] for name in values}) == PPOConfig()
        args = [f"--{name}={value}" for name, value in values.items()]
        assert PPOConfig.from_arguments(cli.build_parser("ppo").parse_args(["ppo", *args])) == config
    with pytest.raises(ValueError, match="async_rollout_options has no option 'workers' .did you mean "
                                         "'rollout_workers'..; its options: max_staleness, rollout_workers"):
        PPOConfig(async_rollout_options={"workers": 1})
    with pytest.raises(ValueError, match="^rollout_worker_threads must be >= 1, got 0$"):
        PPOConfig(rollout_worker_threads=0)
    with pytest.raises(ValueError, match="kl_control_options option 'kl_horizon' must be >= 1, got 0"):
        PPOConfig(kl_control_options={"kl_horizon": 0})
    with pytest.raises(ValueError, match="'max_staleness' is an option of async_rollout_options"):
        PPOConfig(advantage_options={"max_staleness": 1})
    with pytest.raises(ValueError, match="max_staleness is given twice"):
        PPOConfig.from_dict({"max_staleness": 1, "async_rollout_options": {"max_staleness": 2}})


def test_a_name_two_plugins_declare_is_refused():
    @dataclasses.dataclass
    class One:
        size: int = 1

    first, second = Registry("widget", "widget"), Registry("gadget", "gadget")
    first.register("a", options=One)(len)
    second.register("b", options=One)(print)
    One.__module__ = "marlhf.fake"
    with pytest.raises(TypeError, match="'size' is declared by gadget 'b' and by widget 'a'"):
        flat_options({"widget": first, "gadget": second})
    with pytest.raises(TypeError, match="'size' is declared by thing_options and by widget 'a'"):
        flat_options({"widget": first}, {"thing": One})


def test_flat_option_and_block_agree_or_are_refused():
    assert PPOConfig(lam=0.5) == PPOConfig(advantage_options={"lam": 0.5}) == PPOConfig.from_dict({"lam": 0.5})
    assert PPOConfig(lam=1.0) == PPOConfig() and PPOConfig(lam=1.0).advantage_options is None  # defaults dropped
    with pytest.raises(ValueError, match="lam is given twice"):
        PPOConfig.from_dict({"lam": 0.5, "advantage_options": {"lam": 0.9}})
    with pytest.raises(ValueError, match="lam must be <= 1, got 2"):
        PPOConfig(lam=2)
    config = PPOConfig(lam=0.9, ngram=3)
    replaced = dataclasses.replace(config, lam=0.5)  # the flat value given last wins
    assert (replaced.plugin_options("advantage").lam, replaced.plugin_options("termination").ngram) == (0.5, 3)


def test_old_logprobs_from_keeps_its_old_name(tmp_path):
    assert PPOConfig(rollout_logprobs="sampling").old_logprobs_from == "sampling"
    assert not hasattr(PPOConfig(), "rollout_logprobs")  # an input alias only
    assert PPOConfig.from_dict({"rollout_logprobs": "sampling"}).old_logprobs_from == "sampling"
    config = dataclasses.replace(PPOConfig(), rollout_logprobs="sampling")
    assert config.old_logprobs_from == "sampling" and "rollout_logprobs" not in config.to_dict()
    with pytest.raises(ValueError, match="rollout_logprobs is the old name of old_logprobs_from"):
        PPOConfig.from_dict({"rollout_logprobs": "sampling", "old_logprobs_from": "recompute"})
    file = tmp_path / "ppo.yaml"
    file.write_text("rollout_logprobs: sampling\nngram: 3\n")
    parser = cli.build_parser("ppo")
    for argv in (["--rollout_logprobs", "sampling"], ["--config", str(file)],
                 ["--config", str(file), "--old_logprobs_from", "recompute", "--ngram", "4"]):
        config = PPOConfig.from_arguments(parser.parse_args(["ppo", *argv]))
        expected = "recompute" if "recompute" in argv else "sampling"
        assert config.old_logprobs_from == expected, argv
    assert config.plugin_options("termination").ngram == 4  # a flag overrides the file's flat option


def test_resume_reads_an_earlier_config_yaml_as_written_now():
    earlier = {"rollout_logprobs": "sampling", "termination_options": {"threshold": 0.8, "k": 2}}
    assert PPOConfig.as_written(earlier) == {"old_logprobs_from": "sampling", "threshold": 0.8,
                                             "termination_options": {"k": 2}}


def test_help_lists_each_option_once_under_its_plugin(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ppo", "--help"])
    text = capsys.readouterr().out
    flags = collections.Counter(re.findall(r"(?m)^  (--\w+)", text))
    for name in set(PPOConfig.input_names()) - set(PPOConfig.RENAMED):
        assert flags[f"--{name}"] == 1, name
    assert text.count("--rollout_logprobs") == 1 and "--old_logprobs_from {recompute,sampling}, --rollout_logprobs" \
        in text  # the old name beside the new one
    sections = dict(re.findall(r"(?ms)^(\S[^\n]*):\n(.*?)(?=^\S|\Z)", text))  # title -> its lines
    for name, flat in FLAT_OPTIONS.items():
        assert f"{name}=" not in text, name  # not listed again as `plugin (name=default)`
        title = next(t for t in sections if (re.search(rf"(?m)^  --{flat.kind}_options\b", sections[t])
                                             if flat.plugin is None else
                                             t.startswith(f"{PLUGINS[flat.kind].kind} {flat.plugin} (--{flat.kind} ")))
        assert re.search(rf"(?m)^  --{name}\b", sections[title]), name  # in its plug-in's or its block's section
