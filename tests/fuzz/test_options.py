"""Every option of every config (and every option of every registered plug-in) is fed values its type or bounds
refuse, in a config file or on the command line: the command stops before any run starts, with one line naming
the option. The options are read off the dataclasses, so a new one is fuzzed as soon as it is declared."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml
from hypothesis import example, given, seed
from hypothesis import strategies as st

from marlhf.data.tasks import TASKS
from marlhf.trainers.ppo_config import PLUGINS
from tests.fuzz import SEED
from tests.fuzz.harness import Example, check, config_classes, fuzz_settings
from tests.fuzz.strategies import Bad, field_bound_violations, field_invalid_values, invalid_values

CONFIGS = config_classes()
# A str option that names a plug-in, a dataset task or a function accepts only those (or a dotted path that imports).
NAMED = {**{kind: tuple(registry.names()) for kind, registry in PLUGINS.items()}, "reward_fns": ()}
TASK_NAMES = tuple(TASKS)  # dataset_task, an option of every command that reads a dataset
# Every option a config declares: its fields and, for ppo, the built-in plug-ins' options it takes flat.
OPTIONS = [(command, name) for command, config in CONFIGS.items() for name in config.declarations()]
PLUGIN_OPTIONS = [(kind, name, option.name) for kind, registry in PLUGINS.items() for name in registry.names()
                  if (plugin := registry.get(name)).options is not None
                  for option in dataclasses.fields(plugin.options)]


def _output_option(command: str) -> str:
    return "out" if command == "demo" else "output_dir"


def _example(command: str, values: dict, flags: list[str], culprits: set[str]) -> Example:
    values = {_output_option(command): "out", **values}
    return Example([command, "--config", "config.yaml", *flags],
                   files={"config.yaml": yaml.safe_dump(values).encode()}, culprits=culprits)


@pytest.mark.parametrize(("command", "name"), OPTIONS, ids=[f"{c}-{n}" for c, n in OPTIONS])
def test_every_option_refuses_invalid_values(command, name, no_runs, fuzz_depth):
    config = CONFIGS[command]
    choices = TASK_NAMES if name == "dataset_task" else NAMED.get(name) if command == "ppo" else None

    @fuzz_settings(3, fuzz_depth)
    @seed(SEED)
    @given(bad=field_invalid_values(config, name, choices), on_command_line=st.booleans())
    def refused(bad: Bad, on_command_line: bool) -> None:
        if on_command_line and bad.words is not None:
            check(_example(command, {}, [f"--{name}", *bad.words], {name}))
        else:
            check(_example(command, {name: bad.value}, [], {name}))

    # Every bound is tried just past it, whatever the random examples draw.
    for bad in field_bound_violations(config, name):
        refused = example(bad=bad, on_command_line=False)(refused)
    refused()


@pytest.mark.parametrize(("kind", "plugin", "name"), PLUGIN_OPTIONS, ids=["-".join(o) for o in PLUGIN_OPTIONS])
def test_every_plugin_option_refuses_invalid_values(kind, plugin, name, no_runs, fuzz_depth):
    """In the plug-in's block (`kind: {name: plugin, option: value}`) and in its `<kind>_options`, with the bounds
    of its own field (declared with marlhf.config.option; the flat flag of the same name is fuzzed with the config's
    options)."""
    options = PLUGINS[kind].get(plugin).options
    own_field = next(f for f in dataclasses.fields(options) if f.name == name)
    values = invalid_values(typing.get_type_hints(options)[name], own_field.metadata.get("bounds"))

    @fuzz_settings(2, fuzz_depth)
    @seed(SEED)
    @given(bad=values, as_block=st.booleans())
    def refused(bad: Bad, as_block: bool) -> None:
        # An engine that is not installed may be named instead of its option.
        culprits = {name, plugin} if kind == "rollout_engine" else {name}
        if as_block:
            values = {kind: {"name": plugin, name: bad.value}}
        else:
            values = {kind: plugin, f"{kind}_options": {name: bad.value}}
        check(_example("ppo", values, [], culprits))

    refused()


def test_an_integer_past_the_largest_float_is_refused_in_one_line():
    """Found by the fuzzer: `learning_rate: 1000...0` (401 digits) in a config file ended in an OverflowError
    traceback (float() of the int)."""
    check(_example("sft", {"learning_rate": 10 ** 400}, [], {"learning_rate"}))
