"""The shape of the `marlhf` package, measured from its source with `ast` (nothing is imported):

    python scripts/structure.py            # rooms, arrows, cycles, climbs, the longest functions

A *room* is a top-level module or subpackage of marlhf (`marlhf.data`, `marlhf.modeling`, ...); an *arrow* is a
distinct room -> room import (any import in any module of the room, also one inside a function); a *cycle* is a
set of rooms (or of modules) that import each other round; a *climb* is an import that goes back up: an arrow
between two rooms of one cycle, or a module importing the package it sits in. tests/test_structure.py keeps the
counts of cycles and climbs at 0 and every function's body at most MAX_FUNCTION_LINES lines.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
from collections.abc import Iterator

MAX_FUNCTION_LINES = 60
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "marlhf"


@dataclasses.dataclass
class Structure:
    modules: dict[str, set[str]]  # module -> the marlhf modules it imports
    rooms: list[str]
    arrows: set[tuple[str, str]]
    room_cycles: list[list[str]]
    module_cycles: list[list[str]]
    climbs: list[tuple[str, str]]  # (importer, imported) modules


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


def measure(package: pathlib.Path = PACKAGE) -> Structure:
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
    climbs = sorted((name, target) for name, targets in modules.items() for target in targets
                    if (room(name) != room(target) and room(name) in in_cycle
                        and in_cycle[room(name)] == in_cycle.get(room(target)))
                    or (target != top and name.startswith(target + ".")))  # a module importing its own package
    return Structure(modules, sorted(room_graph), arrows, room_cycles, cycles(modules), climbs)


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
        print(f"  climb: {source} -> {target}")
    lengths = sorted(function_lengths(), reverse=True)
    over = [entry for entry in lengths if entry[0] > MAX_FUNCTION_LINES]
    print(f"functions {len(lengths)}, over {MAX_FUNCTION_LINES} lines {len(over)}; the longest:")
    for lines, name in lengths[: max(5, len(over))]:
        print(f"  {lines:4d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
