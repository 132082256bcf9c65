"""Objects named on the command line by a dotted path, `package.module:name`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_object(spec: str, what: str) -> Any:
    """The object at `package.module:name`; a ValueError naming `what` (the option) when it cannot be imported."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"{what} {spec!r}: expected a dotted path 'package.module:name'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {spec!r}: cannot import it ({error})") from None


def import_function(spec: str, what: str) -> Callable:
    """The function at `package.module:function` (import_object, and it must be callable)."""
    function = import_object(spec, what)
    if not callable(function):
        raise ValueError(f"{what} {spec!r} is not a function")
    return function
