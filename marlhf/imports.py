"""Objects named on the command line by a dotted path, `package.module:name`, or by a file and a name,
`path/to/file.py:name`."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def import_object(spec: str, what: str) -> Any:
    """The object at `package.module:name`, or at `path/to/file.py:name` (an existing file, loaded once as a module
    of its own); a ValueError naming `what` (the option) when it cannot be imported."""
    module_name, _, name = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"{what} {spec!r}: expected a dotted path 'package.module:name' or 'path/to/file.py:name'")
    try:
        is_file = module_name.endswith(".py") and os.path.isfile(module_name)
        return getattr(_import_file(module_name) if is_file else importlib.import_module(module_name), name)
    except (ImportError, AttributeError, SyntaxError) as error:
        raise ValueError(f"{what} {spec!r}: cannot import it ({error})") from None


def _import_file(path: str) -> ModuleType:
    """The Python file at `path` as a module, named after its absolute path so that two files with one name are two
    modules, and loaded once (a second import returns the same module, so a class it registers is the same class)."""
    path = os.path.abspath(path)
    module_name = "marlhf_file_" + path.replace(os.sep, "_").replace(".", "_")
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def import_function(spec: str, what: str) -> Callable:
    """The function at `package.module:function` (import_object, and it must be callable)."""
    function = import_object(spec, what)
    if not callable(function):
        raise ValueError(f"{what} {spec!r} is not a function")
    return function
