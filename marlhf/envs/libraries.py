"""The environment libraries marlhf adapts, named `LIBRARY:ID` (`reasoning_gym:chain_sum`, `textarena:Wordle-v0`,
`skyrl_gym:gsm8k`): which module of marlhf adapts each, which package it needs, and the one-line error when that
package is missing. A library is imported only when one of its environments is asked for."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, NamedTuple

from marlhf.errors import MissingPackage

__all__ = ["Library", "LIBRARIES", "library_of", "require", "library_plugin"]


class Library(NamedTuple):
    adapter: str  # the marlhf module holding its `plugin(id)` and `available()`
    package: str  # the Python package it imports
    distribution: str  # its name on the package registry


LIBRARIES = {
    "reasoning_gym": Library("marlhf.envs.reasoning_gym", "reasoning_gym", "reasoning-gym"),
    "textarena": Library("marlhf.envs.textarena", "textarena", "textarena"),
    "skyrl_gym": Library("marlhf.envs.skyrl_gym", "skyrl_gym", "skyrl-gym"),
}


def library_of(spec: str) -> str | None:
    """The library a spec `LIBRARY:ID` names, or None for any other spec."""
    prefix, colon, _ = spec.partition(":")
    return prefix if colon and prefix in LIBRARIES else None


def require(library: str) -> Any:
    """The library's package, imported; a MissingPackage naming the extra when it is not installed."""
    package = LIBRARIES[library].package
    if importlib.util.find_spec(package) is None:
        raise MissingPackage(f"{library} environments need the package {LIBRARIES[library].distribution!r}, which "
                             f"is not installed: pip install \"marlhf[envs]\"")
    return importlib.import_module(package)


def library_plugin(spec: str) -> Any:
    """The environment plug-in of `LIBRARY:ID` (its adapter's `plugin(id)`), or None for a spec of no library."""
    library = library_of(spec)
    if library is None:
        return None
    identifier = spec.partition(":")[2]
    if not identifier:
        raise ValueError(f"env {spec!r} names no environment of {library}: write {library}:ID")
    return importlib.import_module(LIBRARIES[library].adapter).plugin(identifier)

