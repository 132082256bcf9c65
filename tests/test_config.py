from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from marlhf.config import ConfigBase, option
from marlhf.run_config import RunConfig, TrainingConfig


@dataclasses.dataclass(kw_only=True)
class ToyConfig(RunConfig):
    lr: float = option(1e-3, "learning rate", gt=0)
    clip: float = option(0.2, "clip range", gt=0)
    mode: Literal["macro", "token"] = option("macro", "ratio granularity")
    lengths: tuple[int, ...] = option((2, 3, 5, 10), "segment lengths", ge=1)
    n: int | None = option(None, "segment length (none: one segment)", ge=1)
    flag: bool = option(False, "a switch")


def test_defaults_and_coercion():
    config = ToyConfig(lr=1, lengths=[4, 5])
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.lengths == (4, 5)
    assert config.report_to == ("jsonl",)
    assert ToyConfig.from_dict({"report_to": "tensorboard"}).report_to == ("tensorboard",)  # YAML `key: one`


@pytest.mark.parametrize("values, field", [
    ({"lr": 0.0}, "lr"), ({"lr": -1e-5}, "lr"), ({"clip": 0}, "clip"), ({"mode": "segment"}, "mode"),
    ({"lr": "fast"}, "lr"), ({"n": 0}, "n"), ({"n": 2.5}, "n"), ({"n": True}, "n"), ({"flag": "yes"}, "flag"),
    ({"lengths": [2, 0]}, "lengths"), ({"lengths": 3}, "lengths"), ({"report_to": "comet"}, "report_to"),
    ({"save_steps": -1}, "save_steps"), ({"seed": None}, "seed"),
])
def test_bad_values_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        ToyConfig.from_dict(values)


def test_unknown_key_is_rejected():
    with pytest.raises(ValueError, match="learning_rat"):
        TrainingConfig.from_dict({"learning_rat": 1e-5})


def test_cross_field_check():
    with pytest.raises(ValueError, match="max_prompt_length"):
        TrainingConfig(max_prompt_length=64, max_length=64)


def test_yaml_then_cli_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.5\nmode: token\nlengths: [1, 2]\nn: 3\n")
    config = ToyConfig.parse_args(["--config", str(path), "--mode", "macro", "--flag", "--n", "none"])
    assert (config.lr, config.mode, config.lengths, config.n, config.flag) == (0.5, "macro", (1, 2), None, True)
    assert ToyConfig.parse_args(["--lengths", "7", "8", "--flag", "false"]).lengths == (7, 8)
    assert ToyConfig.from_yaml(path, lr=0.25).lr == 0.25


@pytest.mark.parametrize("words, value", [
    ([], True), (["true"], True), (["True"], True), (["yes"], True), (["on"], True), (["1"], True),
    (["false"], False), (["FALSE"], False), (["no"], False), (["off"], False), (["0"], False),
])
def test_a_switch_takes_the_spellings_of_a_config_file(words, value):
    """`--flag`, `--flag true`, `--flag false` (and what YAML reads as a boolean) on the command line, as
    `flag: true` in a file."""
    config = ToyConfig.parse_args(["--flag", *words, "--lr", "0.5"])
    assert config.flag is value and config.lr == 0.5


def test_a_switch_with_another_word_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        ToyConfig.parse_args(["--flag", "maybe"])
    assert "--flag: expects true or false" in capsys.readouterr().err


def test_yaml_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("lr: -1\n")
    with pytest.raises(ValueError, match="lr"):
        ToyConfig.parse_args(["--config", str(path)])
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        ToyConfig.from_yaml(path)


def test_cli_rejects_bad_choice_and_type(capsys):
    with pytest.raises(SystemExit):
        ToyConfig.parse_args(["--lr", "fast"])
    assert "--lr" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mode"):
        ToyConfig.parse_args(["--mode", "segment"])


def test_help_lists_every_option_with_default():
    parser = argparse.ArgumentParser()
    ToyConfig.add_arguments(parser)
    text = parser.format_help()
    for field in dataclasses.fields(ToyConfig):
        assert f"--{field.name}" in text
        assert field.metadata["help"], field.name
    assert "(default: 2 3 5 10)" in text and "(default: 0.001)" in text


def test_round_trip_through_yaml(tmp_path):
    config = ToyConfig(lr=0.1, lengths=(1, 2), n=4, output_dir=str(tmp_path))
    config.save_yaml(tmp_path / "config.yaml")
    assert ToyConfig.from_yaml(tmp_path / "config.yaml") == config


def test_list_default_is_refused():
    with pytest.raises(TypeError):
        option([1, 2], "mutable")


def test_reserved_config_field():
    @dataclasses.dataclass(kw_only=True)
    class Clash(ConfigBase):
        config: str = option("x", "clashes with --config")

    with pytest.raises(TypeError, match="config"):
        Clash.add_arguments(argparse.ArgumentParser())


def test_help_sections_group_the_flags():
    from marlhf.trainers.ppo import PPOConfig

    parser = argparse.ArgumentParser()
    PPOConfig.add_arguments(parser)
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    titles = list(groups)
    assert groups["macro actions"][:2] == ["termination", "termination_options"]
    # a built-in plug-in's options follow the section naming its kind, under the plug-in's own title
    fixed = "termination rule fixed (--termination fixed; its options also in termination_options)"
    assert groups[fixed] == ["ngram"] and titles.index(fixed) > titles.index("macro actions")
    assert "segment_weighting" in groups["policy loss ppo (--policy_loss ppo; its options also in "
                                         "policy_loss_options)"]
    assert "value_weighting" in groups["rewards and advantages"]
    listed = {name for names in PPOConfig.HELP_SECTIONS.values() for name in names}
    assert set(sum(groups.values(), [])) >= set(PPOConfig.input_names()) - set(PPOConfig.RENAMED) | {"config"}
    assert not listed & set(groups["options"])

    @dataclasses.dataclass(kw_only=True)
    class Bad(PPOConfig):
        HELP_SECTIONS = {"oops": ("no_such_field",)}

    with pytest.raises(TypeError, match="no_such_field"):
        Bad.add_arguments(argparse.ArgumentParser())
