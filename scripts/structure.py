"""The shape of the `marlhf` package, measured from its source with `ast` (nothing is imported):

    python scripts/structure.py            # rooms, arrows, cycles, climbs, layers, the longest functions

A *room* is a top-level module or subpackage of marlhf (`marlhf.data`, `marlhf.modeling`, ...); an *arrow* is a
distinct room -> room import (any import in any module of the room, also one inside a function); a *cycle* is a
set of rooms (or of modules) that import each other round. A module's *layer* is read from the layer table of
docs/contributing.md, the one place that assigns them: each row a layer, bottom first, its modules the backticked
paths (relative to the package) ending in `.py` or `/`; the longest listed path that holds a module names its
layer. A *climb* is an import that goes back up: one into a higher layer than the importer's, an arrow between
two rooms of one cycle, or a module importing the package it sits in. tests/test_structure.py keeps the counts of
cycles and climbs at 0, every module in a layer and every function's body at most MAX_FUNCTION_LINES lines.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys
from collections.abc import Iterator

MAX_FUNCTION_LINES = 60
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "marlhf"
CONTRIBUTING = PACKAGE.parent / "docs" / "contributing.md"
LAYER_TABLE_HEADER = "| layer | modules | may import |"


@dataclasses.dataclass
class Structure:
    modules: dict[str, set[str]]  # module -> the marlhf modules it imports
    rooms: list[str]
    arrows: set[tuple[str, str]]
    room_cycles: list[list[str]]
    module_cycles: list[list[str]]
    climbs: list[tuple[str, str]]  # (importer, imported) modules
    layers: dict[str, str]  # module -> its layer
    unassigned: list[str]  # modules the layer table does not hold
    unmatched: list[str]  # paths of the layer table that hold no module


def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The marlhf modules `path` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known and module != name}


def room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """The layers of a contributing page's layer table (the one under LAYER_TABLE_HEADER), bottom first: (name,
    the backticked paths of its modules cell that end in `.py` or `/`)."""
    lines = text.splitlines()
    if LAYER_TABLE_HEADER not in lines:
        raise ValueError(f"no layer table: no line {LAYER_TABLE_HEADER!r}")
    layers = []
    for line in lines[lines.index(LAYER_TABLE_HEADER) + 2:]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        name, modules = (cell.strip() for cell in line.strip().strip("|").split("|")[:2])
        layers.append((name, [path for path in re.findall(r"`([^`]+)`", modules) if path.endswith((".py", "/"))]))
    return layers


def assign_layers(paths: dict[str, str], layers: list[tuple[str, list[str]]]) -> tuple[dict[str, int], list[str]]:
    """module -> the index of its layer, from `paths` (module -> its path relative to the package) and the table:
    the longest table path that is the module's path or a folder above it; and the table paths that hold none."""
    owner: dict[str, int] = {}
    for index, (name, listed) in enumerate(layers):
        for path in listed:
            if path in owner:
                raise ValueError(f"layer table: {path} is listed in two layers, {layers[owner[path]][0]} and {name}")
            owner[path] = index
    assigned = {}
    for module, path in paths.items():
        holders = [listed for listed in owner if _holds(listed, path)]
        if holders:
            assigned[module] = owner[max(holders, key=len)]
    unmatched = sorted(listed for listed in owner if not any(_holds(listed, path) for path in paths.values()))
    return assigned, unmatched


def _holds(listed: str, path: str) -> bool:
    return path == listed or (listed.endswith("/") and path.startswith(listed))


def measure(package: pathlib.Path = PACKAGE, layers: list[tuple[str, list[str]]] | None = None) -> Structure:
    """The package's structure; `layers` (default: docs/contributing.md's table) assigns the modules' layers."""
    layers = layer_table(CONTRIBUTING.read_text()) if layers is None else layers
    paths = {module_name(path, package): path for path in package.rglob("*.py")}
    known = set(paths)
    modules = {name: imported_modules(path, name, known) for name, path in paths.items()}
    top = package.name
    room_graph: dict[str, set[str]] = {room(name): set() for name in modules if name != top}
    for name, targets in modules.items():
        for target in targets:
            if name != top and target != top and room(name) != room(target):
                room_graph[room(name)].add(room(target))
    arrows = {(source, target) for source, targets in room_graph.items() for target in targets}
    room_cycles = cycles(room_graph)
    in_cycle = {member: n for n, cycle in enumerate(room_cycles) for member in cycle}
    level, unmatched = assign_layers({name: path.relative_to(package).as_posix() for name, path in paths.items()},
                                     layers)
    climbs = sorted((name, target) for name, targets in modules.items() for target in targets
                    if (room(name) != room(target) and room(name) in in_cycle
                        and in_cycle[room(name)] == in_cycle.get(room(target)))
                    or (target != top and name.startswith(target + "."))  # a module importing its own package
                    or level.get(name, len(layers)) < level.get(target, -1))  # into a higher layer
    return Structure(modules, sorted(room_graph), arrows, room_cycles, cycles(modules), climbs,
                     {name: layers[index][0] for name, index in sorted(level.items())},
                     sorted(set(paths) - set(level)), unmatched)


def function_lengths(package: pathlib.Path = PACKAGE) -> Iterator[tuple[int, str]]:
    """(lines, 'path:qualified name') of every function: its body's lines, without the docstring."""
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        yield from _lengths(tree, path.relative_to(package.parent).as_posix(), "")


def _lengths(node: ast.AST, path: str, prefix: str) -> Iterator[tuple[int, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = child.body
            if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str) and len(body) > 1):
                body = body[1:]  # the docstring does not count
            yield body[-1].end_lineno - body[0].lineno + 1, f"{path}:{prefix}{child.name}"
            yield from _lengths(child, path, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _lengths(child, path, f"{prefix}{child.name}.")
        else:
            yield from _lengths(child, path, prefix)


def main() -> int:
    structure = measure()
    print(f"rooms {len(structure.rooms)}, arrows {len(structure.arrows)}, room cycles {len(structure.room_cycles)}, "
          f"module cycles {len(structure.module_cycles)}, climbs {len(structure.climbs)}")
    for cycle in structure.room_cycles + structure.module_cycles:
        print("  cycle:", " <-> ".join(cycle))
    for source, target in structure.climbs:
        print(f"  climb: {source} ({structure.layers.get(source, 'no layer')}) -> {target} "
              f"({structure.layers.get(target, 'no layer')})")
    print(f"modules {len(structure.modules)}, without a layer {len(structure.unassigned)}; paths of the layer table "
          f"that hold no module {len(structure.unmatched)}")
    for name in structure.unassigned:
        print(f"  no layer: {name} (add its path to the layer table of docs/contributing.md)")
    for path in structure.unmatched:
        print(f"  no module: {path}")
    lengths = sorted(function_lengths(), reverse=True)
    over = [entry for entry in lengths if entry[0] > MAX_FUNCTION_LINES]
    print(f"functions {len(lengths)}, over {MAX_FUNCTION_LINES} lines {len(over)}; the longest:")
    for lines, name in lengths[: max(5, len(over))]:
        print(f"  {lines:4d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
