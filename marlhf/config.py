"""Config dataclasses: YAML file + command-line overrides + validation up front. This is the option machinery
(`ConfigBase`, `option`), which every layer may use; the options every run shares (`RunConfig`, `TrainingConfig`)
are in marlhf.run_config.

API (for trainer authors):
    @dataclass(kw_only=True)
    class MyConfig(TrainingConfig):            # marlhf.run_config; or RunConfig for non-optimising jobs
        clip: float = option(0.2, "PPO clip range", gt=0)
        mode: Literal["a", "b"] = option("a", "what mode")
        def validate(self): super().validate(); ...cross-field checks...

    MyConfig(clip=-1)                          -> ValueError naming "clip"
    MyConfig.from_dict({...})                  -> unknown key / wrong type -> ValueError naming the key
    MyConfig.from_yaml("run.yaml", clip=0.1)   -> file values, then keyword overrides
    MyConfig.parse_args(argv)                  -> argparse from the fields; `--config run.yaml` then flags
    MyConfig.add_arguments(parser); MyConfig.from_arguments(namespace)   (used by marlhf.cli subcommands)
    config.to_dict(); config.save_yaml(path)

An option renamed keeps its old name as an alias (`RENAMED = {"old": "new"}`: files, flags and keyword arguments;
`--help` shows it beside the new one). A config may take input names that are not its fields (PPOConfig's flat
plug-in options): it lists them in `input_names`, their declarations in `declarations`, their defaults in
`option_defaults`, and rewrites them into fields in `expand_values`. Aliases are resolved when a config is built,
whichever way (a file, flags, `MyConfig(**values)`: `ConfigBase`'s metaclass), and are never attributes: a config
is read by its fields.

Supported field types: bool (`--name` or `--name true|false` on the command line), int, float, str, Literal[...],
tuple[T, ...], dict[str, Any] (a mapping: a YAML mapping in a file, YAML flow text `'{a: 1}'` on the command
line), and `X | None` of these.
Every field is declared with `option(default, help, gt=, ge=, lt=, le=)`; the bounds are checked on
construction (None always passes bounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import yaml

from marlhf.errors import MarlhfError, did_you_mean

_NONE_WORDS = ("none", "null")
_TRUE_WORDS, _FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")  # YAML 1.1's, and 1/0


def option(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,
           lt: float | None = None, le: float | None = None) -> Any:
    """A config field with a help text and optional numeric bounds (checked in `validate`)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("config defaults must be immutable; use a tuple instead of a list")
    bounds = {"gt": gt, "ge": ge, "lt": lt, "le": le}
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds})


def check_bounds(name: str, value: Any, bounds: dict[str, float | None]) -> None:
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    checks = {"gt": (lambda v, b: v > b, ">"), "ge": (lambda v, b: v >= b, ">="),
              "lt": (lambda v, b: v < b, "<"), "le": (lambda v, b: v <= b, "<=")}
    for key, bound in bounds.items():
        if bound is None:
            continue
        passes, symbol = checks[key]
        for v in values:
            if not passes(v, bound):
                raise ValueError(f"{name} must be {symbol} {bound}, got {value!r}")


def _split_optional(annotation: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (annotation, False)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config type {annotation!r}")
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def coerce_option(name: str, value: Any, annotation: Any) -> Any:
    """Check `value` against `annotation`; return it in canonical form (int -> float, list -> tuple). A ValueError
    names `name`."""
    inner, optional = _split_optional(annotation)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} must not be None")
    origin = typing.get_origin(inner)
    if origin is Literal:
        choices = typing.get_args(inner)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        item_type, ellipsis = typing.get_args(inner)
        if ellipsis is not Ellipsis:
            raise TypeError(f"unsupported config type {annotation!r} for {name}; use tuple[T, ...]")
        if isinstance(value, str) and (item_type is str or typing.get_origin(item_type) is Literal):
            value = (value,)  # `report_to: wandb` in a YAML file, or an old config.yaml's single value
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return tuple(coerce_option(f"{name}[{i}]", v, item_type) for i, v in enumerate(value))
    if inner is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool (true/false), got {value!r}")
        return value
    if inner is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        return value
    if inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int past the largest float
            raise ValueError(f"{name} must be a finite number, got an integer of {len(str(abs(value)))} "
                             "digits") from None
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return number
    if inner is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    if origin is dict:
        if isinstance(value, str):  # YAML flow text from the command line
            value = _yaml_mapping(name, value)
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            raise ValueError(f"{name} must be a mapping of option: value, got {value!r}")
        return dict(value)
    if inner is Any:
        return value
    raise TypeError(f"unsupported config type {annotation!r} for {name}")


def _yaml_mapping(name: str, text: str) -> dict:
    try:
        value = yaml.load(text, Loader=_ConfigLoader)
    except (yaml.YAMLError, ValueError) as error:
        raise ValueError(f"{name}: cannot read {text!r} as a YAML mapping ({error})") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping such as '{{option: value}}', got {text!r}")
    return value


def _argparse_kwargs(name: str, annotation: Any) -> dict[str, Any]:
    """argparse keyword arguments that parse one field from the command line."""
    inner, optional = _split_optional(annotation)
    origin = typing.get_origin(inner)
    if inner is bool and not optional:
        # `--name` alone, or `--name true|false` as in a config file
        return {"nargs": "?", "const": True, "metavar": "true|false", "type": _scalar_parser(name, bool, optional)}
    if origin is dict:
        return {"metavar": "'{OPTION: VALUE, ...}'"}  # a string, read as YAML by coerce_option
    if origin is tuple:
        item_type = typing.get_args(inner)[0]
        return {"nargs": "+", "type": _scalar_parser(name, item_type, optional=False)}
    kwargs: dict[str, Any] = {"type": _scalar_parser(name, inner, optional)}
    if origin is Literal:
        kwargs["metavar"] = "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}"
    return kwargs


def _scalar_parser(name: str, annotation: Any, optional: bool):
    if typing.get_origin(annotation) is Literal:
        base = type(typing.get_args(annotation)[0])
    else:
        base = annotation

    def parse(text: str) -> Any:
        if optional and text.lower() in _NONE_WORDS:
            return None
        if base is bool:
            if text.lower() not in _TRUE_WORDS + _FALSE_WORDS:
                raise argparse.ArgumentTypeError(f"expects true or false (or yes/no, on/off, 1/0), got {text!r}")
            return text.lower() in _TRUE_WORDS
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {base.__name__}, got {text!r}") from None

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


class _ResolvesAliases(type):
    """The metaclass of the configs: `MyConfig(**values)` rewrites the input aliases in `values` (old names, and
    PPOConfig's flat options and plug-in blocks) into fields before the dataclass's __init__ sees them
    (expand_values, not strict: `dataclasses.replace(config, old_name=...)` passes the field's old value too)."""

    def __call__(cls, **values: Any) -> Any:
        return super().__call__(**cls.expand_values(values, strict=False))


@dataclasses.dataclass(kw_only=True)
class ConfigBase(metaclass=_ResolvesAliases):
    """Base of every marlhf config: typed, bounded fields; YAML and CLI round trips."""

    HELP_SECTIONS: typing.ClassVar[dict[str, tuple[str, ...]]] = {}  # --help title -> field names
    RENAMED: typing.ClassVar[dict[str, str]] = {}  # an option's old name -> its field, kept as an alias

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Type- and bound-check every field. Subclasses add cross-field checks after super()."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = coerce_option(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
            check_bounds(f.name, value, f.metadata.get("bounds", {}))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def input_names(cls) -> list[str]:
        """The names a config file, a flag or a keyword argument may set: the fields, their old names (RENAMED) and
        any a subclass rewrites into fields (expand_values)."""
        return cls.field_names() + list(cls.RENAMED)

    @classmethod
    def declarations(cls) -> dict[str, tuple[Any, dataclasses.Field]]:
        """{name: (type, the dataclass field declaring it)} of every option `input_names` lists but the old names
        (PPOConfig's flat options are declared by their plug-ins' dataclasses)."""
        hints = typing.get_type_hints(cls)
        return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """{name: default} of every option `to_dict` writes (tuples as lists, as to_dict writes them)."""
        return {f.name: list(f.default) if isinstance(f.default, tuple) else f.default for f in dataclasses.fields(cls)}

    @classmethod
    def as_written(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A config.yaml of an earlier version in the form `to_dict` writes now (old names renamed), to compare."""
        return cls.rename_old_names(dict(values), strict=False)

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        values = cls.expand_values(dict(values))
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            hints = "; ".join(f"{name!r}{did_you_mean(name, cls.input_names())}" for name in unknown)
            raise ValueError(f"unknown {cls.__name__} option(s): {hints} (`--help` lists them)")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any):
        values = _read_yaml(path)
        values.update(overrides)
        return cls.from_dict(values)

    @classmethod
    def expand_values(cls, values: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Rewrite file / command-line / keyword values into fields before they are checked: an old name (RENAMED)
        becomes its field (PPOConfig also expands plug-in blocks and flat plug-in options). `strict`: the old and
        the new name given with different values is an error; else the old one wins (`dataclasses.replace(config,
        old_name=...)` passes both)."""
        return cls.rename_old_names(values, strict)

    @classmethod
    def rename_old_names(cls, values: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """`values` with each old name (RENAMED) replaced by its field (see expand_values for `strict`)."""
        for old, new in cls.RENAMED.items():
            if old in values:
                value = values.pop(old)
                if strict and new in values and values[new] != value:
                    raise ValueError(f"{old} is the old name of {new}, and both are given ({value!r} and "
                                     f"{values[new]!r}): keep {new}")
                values[new] = value
        return values

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save_yaml(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_yaml())

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add `--config` and one `--<field>` flag per field (defaults are applied in from_arguments)."""
        parser.add_argument("--config", default=None, metavar="FILE.yaml",
                            help="YAML file of option values; flags given on the command line override it")
        hints = typing.get_type_hints(cls)
        # Fields named in HELP_SECTIONS are listed under their section's title in --help, the rest first.
        section_of = {name: title for title, names in cls.HELP_SECTIONS.items() for name in names}
        unknown = sorted(set(section_of) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"{cls.__name__}.HELP_SECTIONS names fields it does not have: {unknown}")
        groups = {title: parser.add_argument_group(title) for title in cls.HELP_SECTIONS}
        old_names = {new: old for old, new in cls.RENAMED.items()}
        for f in dataclasses.fields(cls):
            if f.name == "config":
                raise TypeError("a config field may not be called 'config' (reserved for --config)")
            target = groups[section_of[f.name]] if f.name in section_of else parser
            flags = [f"--{f.name}"] + ([f"--{old_names[f.name]}"] if f.name in old_names else [])
            add_option_argument(target, flags, f.name, hints[f.name], f)

    @classmethod
    def from_arguments(cls, namespace: argparse.Namespace):
        """Defaults < values from --config < flags given on the command line."""
        values = cls.rename_old_names(_read_yaml(namespace.config)) if namespace.config else {}
        values.update({name: getattr(namespace, name) for name in cls.input_names() if hasattr(namespace, name)})
        return cls.from_dict(values)

    @classmethod
    def parse_args(cls, argv: list[str] | None = None, prog: str | None = None):
        parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
        cls.add_arguments(parser)
        return cls.from_arguments(parser.parse_args(argv))


def add_option_argument(parser, flags: list[str], dest: str, annotation: Any, f: dataclasses.Field) -> None:
    """One `--<name>` flag for the option declared by the dataclass field `f` (with its help and default); the
    value is applied in from_arguments (no argparse default)."""
    help_text = f"{f.metadata.get('help', '')} (default: {_format_default(f.default)})"
    parser.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, help=help_text,
                        **_argparse_kwargs(dest, annotation))


def _format_default(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return str(value)


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` (no dot) as a string; users write learning rates that way, so it is a float here.
    A key given twice is an error, not "the last one wins"."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                break  # the base class names an unhashable key
            if key in seen:
                raise MarlhfError(f"config file {self.name}, line {key_node.start_mark.line + 1}: option {key!r} is "
                                  "given twice; keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _read_yaml(path: str | Path) -> dict[str, Any]:
    """The option: value mapping of a config file. A file that cannot be read, is not UTF-8, not YAML, empty or
    not a mapping is a MarlhfError naming the file (and the line and column where YAML gives them)."""
    where = f"config file {path}"
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise MarlhfError(f"{where} does not exist: check the --config path") from None
    except IsADirectoryError:
        raise MarlhfError(f"{where} is a directory: --config takes a YAML file") from None
    except OSError as error:
        raise MarlhfError(f"{where} cannot be read ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is dropped
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise MarlhfError(f"{where}, line {line}: byte {data[error.start]:#04x} is not UTF-8; save the file as "
                          "UTF-8") from None
    loader = _ConfigLoader(text)  # line ends \n, \r\n or \r alike
    loader.name = str(path)
    try:
        values = loader.get_single_data()
    except yaml.YAMLError as error:
        raise MarlhfError(f"{where}{_yaml_problem(error)}; fix the YAML") from None
    except RecursionError:
        raise MarlhfError(f"{where} nests lists or mappings too deeply to be a config") from None
    finally:
        loader.dispose()
    if values is None:
        raise MarlhfError(f"{where} holds no options (it is empty or only comments): write one `option: value` "
                          "per line, or leave out --config")
    if not isinstance(values, dict):
        raise MarlhfError(f"{where} must hold a mapping of option: value (one per line), got a "
                          f"{type(values).__name__}")
    for key in values:
        if not isinstance(key, str):
            raise MarlhfError(f"{where}: option names are words, got {key!r}")
    return values


def _yaml_problem(error: yaml.YAMLError) -> str:
    """', line L, column C: what YAML found (where the construct it was reading began)', with a hint for a tab."""
    mark, context, context_mark = (getattr(error, name, None) for name in ("problem_mark", "context", "context_mark"))
    text = " ".join(str(getattr(error, "problem", None) or error).split())
    if "'\\t'" in text:
        text += " (YAML indents with spaces, never tabs)"
    if context and context_mark is not None and mark is not None and context_mark.line != mark.line:
        text += f" ({context} from line {context_mark.line + 1}, column {context_mark.column + 1})"
    at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {text}"
