"""Runs one fuzz example: lays out its files in a fresh directory, calls `marlhf.cli.main(argv)` in-process from
there, and checks the outcome (see `check`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import io
import os
import re
import tempfile
import traceback
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

from marlhf import cli
from tests.fuzz import examples

ERROR_LINE = re.compile(r"^marlhf( [\w-]+)?: error: ")


class Started(Exception):
    """A run started on an input the fuzzer made invalid."""


def fuzz_settings(full_examples: int, depth: str):
    """Hypothesis with `full_examples` drawn examples at depth 'full' and a tenth of them at 'quick' (FUZZ_EXAMPLES
    for a longer run), no example database (each run starts from the seed alone), no deadline (the machine is
    shared)."""
    return settings(max_examples=examples(full_examples, depth), database=None, deadline=None, derandomize=False,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink), print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


def config_classes() -> dict[str, type]:
    """Every command that reads a config: its config class."""
    from marlhf.demo.config import DemoConfig

    classes = {name: getattr(importlib.import_module(module), config)
               for name, (module, config, _, _) in cli.COMMANDS.items()}
    return {**classes, "demo": DemoConfig}


@dataclasses.dataclass
class Example:
    """One command line and the files it reads. `culprits`: names the error line may name (options, files); one
    of them must appear in it. `must_fail`: the input holds something invalid (else it may also succeed).
    `output`: the directory (or file) the command may write, relative to the example's directory; `protected`:
    paths there that hold an earlier run and must not change."""

    argv: list[str]
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    dirs: list[str] = dataclasses.field(default_factory=list)
    symlinks: dict[str, str] = dataclasses.field(default_factory=dict)
    culprits: set[str] = dataclasses.field(default_factory=set)
    must_fail: bool = True
    output: tuple[str, ...] = ("out",)
    protected: tuple[str, ...] = ()

    def lay_out(self, root: Path) -> None:
        for name in self.dirs:
            (root / name).mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
        for name, target in self.symlinks.items():
            os.symlink(target, root / name)


@dataclasses.dataclass
class Outcome:
    code: int
    out: str
    err: str


def run_cli(argv: list[str], cwd: Path) -> Outcome:
    """`cli.main(argv)` run from `cwd` with its stdout and stderr captured; a SystemExit is its exit code (a string
    code is printed and exits 1, as Python does), an exception escaping main is printed as its traceback."""
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(argv))
            except SystemExit as stop:
                code = stop.code
                if isinstance(code, str):
                    print(code, file=err)
                    code = 1
            except Exception:  # noqa: BLE001 - a bug: the fuzzer reports its traceback
                traceback.print_exc(file=err)
                code = 1
    finally:
        os.chdir(previous)
    return Outcome(0 if code is None else code, out.getvalue(), err.getvalue())


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` -> 'dir', 'link -> target' or its content's hash."""
    state = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_symlink():
            state[relative] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            state[relative] = "dir"
        else:
            state[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def error_lines(stderr: str) -> list[str]:
    """stderr's lines without argparse's usage block (its `usage:` line and the indented lines after it)."""
    lines, in_usage = [], False
    for line in stderr.splitlines():
        if line.startswith("usage:"):
            in_usage = True
            continue
        if in_usage and line[:1].isspace():
            continue
        in_usage = False
        if line.strip():
            lines.append(line)
    return lines


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(prefix.rstrip("/") + "/") for prefix in prefixes)


def check(example: Example, shared: list[Path] = ()) -> Outcome:
    """Run `example` in a fresh directory and assert: no traceback; a non-zero exit with exactly one error line
    naming one of its culprits (or, for an input that may be valid, exit 0); nothing written outside its output,
    nothing changed in its protected paths or in the `shared` input directories."""
    with tempfile.TemporaryDirectory(prefix="fuzz_") as directory:
        root = Path(directory)
        example.lay_out(root)
        before, shared_before = snapshot(root), [snapshot(path) for path in shared]
        outcome = run_cli(example.argv, root)
        after = snapshot(root)
    shown = f"marlhf {' '.join(example.argv)}\nfiles: {sorted(example.files)}\nstderr:\n{outcome.err}"
    assert "Traceback" not in outcome.err + outcome.out, shown
    if outcome.code != 0 or example.must_fail:
        assert outcome.code not in (0, None), f"accepted an invalid input (exit 0)\n{shown}"
        lines = error_lines(outcome.err)
        assert len(lines) == 1 and ERROR_LINE.match(lines[0]), f"not one error line\n{shown}"
        named = lines[0].replace("-", "_") if lines else ""  # --tie-margin is the option tie_margin
    assert not example.culprits or any(name.replace("-", "_") in named for name in example.culprits), \
            f"the error names none of {sorted(example.culprits)}\n{shown}"
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    outside = [path for path in changed if not _under(path, example.output) or _under(path, example.protected)]
    assert not outside, f"wrote outside the output or changed an earlier run: {outside}\n{shown}"
    for path, state in zip(shared, shared_before):
        assert snapshot(path) == state, f"changed the input directory {path}\n{shown}"
    return outcome
