"""Functions named on the command line by a dotted path, `package.module:function`."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def import_function(spec: str, what: str) -> Callable:
    """The function at `package.module:function`; a ValueError naming `what` (the option) when it cannot be
    imported or is not callable."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"{what} {spec!r}: expected a dotted path 'package.module:function'")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {spec!r}: cannot import it ({error})") from None
    if not callable(function):
        raise ValueError(f"{what} {spec!r} is not a function")
    return function
