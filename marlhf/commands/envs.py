"""`marlhf envs` (marlhf.envs): the environments this installation can run, where each comes from, and what one
would need that is not here (a download, a network, files, a package)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from importlib import metadata

from marlhf.errors import MarlhfError
from marlhf.commands.base import Tool

# Modules of marlhf that register an environment when imported (the demo's, once it has one).
BUILT_IN_MODULES = ("marlhf.demo.env",)


def _envs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("libraries", nargs="*", metavar="SOURCE",
                        help="list only these sources: registered (built-in ones too), reasoning_gym, textarena, "
                             "skyrl_gym (default: all)")
    parser.add_argument("--offline", action="store_true", help="list only the environments that run offline here")


def _registered() -> list[tuple[str, str, str]]:
    from marlhf.envs.base import ENVS

    for module in BUILT_IN_MODULES:
        if importlib.util.find_spec(module.rpartition(".")[0]) and importlib.util.find_spec(module):
            importlib.import_module(module)
    rows = []
    for name, plugin in sorted(ENVS.items()):
        module = getattr(plugin.obj, "__module__", "?")
        rows.append((name, f"{'built-in' if module.startswith('marlhf.') else 'registered'} ({module})", ""))
    return rows


def _library_rows(library: str) -> list[tuple[str, str, str]]:
    """(spec, source, needs) of every environment of an installed library."""
    adapter = importlib.import_module(f"marlhf.envs.{library}")
    source = f"{library} {metadata.version(library.replace('_', '-'))}"
    rows = []
    for identifier in adapter.available():
        if library == "textarena" and adapter.num_players(identifier) is None:
            needs = "more than two players (not adapted)"
        else:
            needs = "; ".join(getattr(adapter, "problems", lambda _: ())(identifier))
        rows.append((f"{library}:{identifier}", source, needs))
    return rows


def _run_envs(arguments: argparse.Namespace) -> int:
    from marlhf.envs.libraries import LIBRARIES

    sources = ["registered", *LIBRARIES]
    unknown = sorted(set(arguments.libraries) - set(sources))
    if unknown:
        raise MarlhfError(f"envs: no source {unknown[0]!r}; sources: {', '.join(sources)}")
    wanted = arguments.libraries or sources
    rows = _registered() if "registered" in wanted else []
    for library in (name for name in LIBRARIES if name in wanted):
        if importlib.util.find_spec(LIBRARIES[library].package) is None:
            print(f"{library}: not installed (pip install \"marlhf[envs]\")")
            continue
        rows += _library_rows(library)
    rows = [row for row in rows if not (arguments.offline and row[2])]
    width = max((len(spec) for spec, _, _ in rows), default=0)
    for spec, source, needs in rows:
        print(f"{spec:<{width}}  {source}  {needs or 'offline'}")
    offline = sum(not needs for _, _, needs in rows)
    print(f"{len(rows)} environments, {offline} offline here")
    return 0


ENVS_COMMAND = Tool(_envs_arguments, _run_envs,
                    "list the environments: registered ones and those of the installed libraries (reasoning-gym, "
                    "TextArena, SkyRL-Gym), with what each needs that is not here")
