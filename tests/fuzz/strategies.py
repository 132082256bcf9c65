"""Hypothesis strategies derived from the config dataclasses (marlhf.config): for each field, values its type or
bounds refuse, so a new option is fuzzed as soon as it is declared; misspellings of names; broken YAML and JSON;
the ways a file can be odd (empty, huge, not UTF-8, CRLF, BOM)."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Literal

import yaml
from hypothesis import strategies as st

FINITE_JUNK = st.sampled_from(["abc", "", " ", "1,5", "0x10", "ten", "--", "é", "[1"])


@dataclasses.dataclass(frozen=True)
class Bad:
    """An invalid value: as a YAML file holds it, and as command-line words (None: it cannot be typed there)."""

    value: Any
    words: tuple[str, ...] | None


def _split_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def bound_violations(bounds: dict[str, float | None] | None, integer: bool) -> list[Bad]:
    """Values just past each bound (the bound itself for a strict one), then far past it."""
    step = 1 if integer else 1e-9
    values = []
    for key, bound in (bounds or {}).items():
        if bound is None:
            continue
        bound = int(bound) if integer else float(bound)
        values.append({"gt": bound, "lt": bound, "ge": bound - step, "le": bound + step}[key])
        values.append({"gt": bound - 1000, "ge": bound - 1000, "lt": bound + 1000, "le": bound + 1000}[key])
    return [Bad(value, (_text(value),)) for value in values]


def invalid_values(annotation: Any, bounds: dict[str, float | None] | None = None,
                   choices: tuple[str, ...] | None = None) -> st.SearchStrategy[Bad]:
    """Values that a field of type `annotation` with `bounds` must refuse. `choices`: the names a plain str field
    accepts besides dotted paths `package.module:object` (a plug-in registry's; () for dotted paths only); None:
    any string passes."""
    inner, optional = _split_optional(annotation)
    origin = typing.get_origin(inner)
    none = [] if optional else [Bad(None, None)]
    structures = [Bad([1, 2], None), Bad({"a": 1}, None)]
    if origin is Literal:
        names = [str(c) for c in typing.get_args(inner)]
        misspelt = st.sampled_from(names).flatmap(misspellings).filter(lambda word: word not in names)
        return st.one_of(misspelt.map(lambda word: Bad(word, (word,))),
                         st.sampled_from(none + structures + [Bad(3, ("3",)), Bad(True, None)]))
    if origin is tuple:
        item = typing.get_args(inner)[0]
        items = invalid_values(item, bounds, choices).filter(lambda bad: bad.value is not None)
        return st.one_of(
            items.map(lambda bad: Bad([bad.value], bad.words)),
            st.sampled_from(none + [Bad({"a": 1}, None), Bad([[1]], None)] + ([] if item is str else [Bad("x", ("x",))])))
    if inner is bool:
        return st.sampled_from(none + structures + [Bad("maybe", ("maybe",)), Bad(2, ("2",)), Bad(0.5, ("0.5",)),
                                                    Bad("", None)])
    if inner in (int, float):
        integer = inner is int
        numbers = [Bad(v, (_text(v),)) for v in (math.nan, math.inf, -math.inf)]
        numbers += [Bad(1.5, ("1.5",)), Bad("1e3x", ("1e3x",))] if integer else []
        numbers += [Bad(10 ** 400, None)] if not integer else []  # overflows a float
        past_bounds = [st.sampled_from(violations)] if (violations := bound_violations(bounds, integer)) else []
        return st.one_of(*past_bounds, st.sampled_from(none + structures + numbers + [Bad(True, None)]),
                         FINITE_JUNK.map(lambda word: Bad(word, (word,))))
    if inner is str:
        wrong_types = none + structures + [Bad(5, None), Bad(1.5, None), Bad(True, None)]
        if choices is not None:
            names = st.sampled_from(["no_such_module:fn", "marlhf.config:no_such_object", "os:", ":", "a b:c"])
            if choices:
                unknown = st.sampled_from(sorted(choices)).flatmap(misspellings).filter(lambda w: w not in choices)
                names = st.one_of(names, unknown)
            return st.one_of(st.sampled_from(wrong_types), names.map(lambda w: Bad(w, (w,))))
        return st.sampled_from(wrong_types)
    if origin is dict:
        return st.sampled_from(none + [Bad([1, 2], ("[1, 2]",)), Bad(5, ("5",)), Bad("{a: 1", ("{a: 1",)),
                                       Bad({1: 2}, ("{1: 2}",)), Bad("just text", ("just text",))])
    raise TypeError(f"the fuzzer has no strategy for {annotation!r}; add one in {__name__}")


def field_invalid_values(config_class: type, name: str, choices: tuple[str, ...] | None = None
                         ) -> st.SearchStrategy[Bad]:
    """For an option of the config (a field, or a flat option declared by a plug-in's dataclass: declarations)."""
    annotation, field = config_class.declarations()[name]
    return invalid_values(annotation, field.metadata.get("bounds"), choices)


def field_bound_violations(config_class: type, name: str) -> list[Bad]:
    """A value just past each bound of the option `name` (none for one without bounds)."""
    annotation, field = config_class.declarations()[name]
    inner, _ = _split_optional(annotation)
    is_tuple = typing.get_origin(inner) is tuple
    item = typing.get_args(inner)[0] if is_tuple else inner
    violations = bound_violations(field.metadata.get("bounds"), item is int)[::2]
    return [Bad([bad.value], bad.words) for bad in violations] if is_tuple else violations


def misspellings(word: str) -> st.SearchStrategy[str]:
    """Near misses of `word`: a letter dropped, doubled, swapped or changed, a dash for an underscore, upper case."""
    def edit(data: tuple[int, str]) -> str:
        index, kind = data
        i = index % max(1, len(word))
        if kind == "drop":
            return word[:i] + word[i + 1:]
        if kind == "double":
            return word[:i] + word[i:i + 1] * 2 + word[i + 1:]
        if kind == "swap" and len(word) > 1:
            i = min(i, len(word) - 2)
            return word[:i] + word[i + 1] + word[i] + word[i + 2:]
        if kind == "change":
            return word[:i] + ("x" if word[i:i + 1] != "x" else "y") + word[i + 1:]
        if kind == "dash":
            return word.replace("_", "-") if "_" in word else word + "-"
        return word.upper() if word.upper() != word else word + "s"

    kinds = st.sampled_from(["drop", "double", "swap", "change", "dash", "upper"])
    return st.tuples(st.integers(0, 64), kinds).map(edit).filter(lambda w: w != word and w.strip())


def broken_yaml(values: dict[str, Any]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(what is broken, file bytes) for a config holding `values`: YAML and JSON syntax errors, a mapping that is
    not one, bytes that are not UTF-8. Each is refused whatever `values` holds."""
    text = yaml.safe_dump(values, sort_keys=False)
    first = next(iter(values))
    cases = {
        "tab indent": text + "extra:\n\t- 1\n",
        "unclosed bracket": text + f"{first}_list: [1, 2\n",
        "unclosed quote": text.replace(": ", ': "', 1),
        "bad indentation": text + "  nested: 1\n bad: 2\n",
        "duplicate key": text + f"{first}: {json.dumps(values[first])}\n",
        "top-level list": "- " + text.replace("\n", "\n  "),
        "top-level scalar": "just some words\n",
        "json missing brace": json.dumps(values)[:-1],
        "mapping key without value": text + ": 1\n",
    }
    raw = {name: content.encode() for name, content in cases.items()}
    raw["latin-1 byte"] = text.encode() + b"comment: caf\xe9\n"
    raw["binary"] = bytes(range(256))
    raw["utf-16"] = text.encode("utf-16")
    return st.sampled_from(sorted(raw.items()))


def _yaml(values: dict[str, Any]) -> str:
    return yaml.safe_dump(values, sort_keys=False)


# Ways to write a config that must read as its values: YAML, JSON (a YAML subset), CRLF line ends, a UTF-8
# byte-order mark, a large comment block.
ENCODINGS = (
    lambda values: _yaml(values).encode(),
    lambda values: json.dumps(values, indent=2).encode(),
    lambda values: _yaml(values).replace("\n", "\r\n").encode(),
    lambda values: b"\xef\xbb\xbf" + _yaml(values).encode(),
    lambda values: b"\xef\xbb\xbf" + _yaml(values).replace("\n", "\r\n").encode(),
    lambda values: ("# padding\n" * 200_000 + _yaml(values)).encode(),
)
