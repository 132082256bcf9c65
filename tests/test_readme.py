"""The README runs as written: its Python blocks and its command-line tour, on the demo's models and data.

`runs/demo` is the session's quick demo (tests/conftest.py `demo_run`), so the commands and paths are the
README's own; only tiny step counts are appended to the training commands (`TINY`)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from marlhf import cli
from marlhf.evaluation.plots import default_label
from marlhf.logging_utils import read_metrics

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = {"sft": ["--max_steps", "2"], "reward": ["--max_steps", "2"], "ppo": ["--max_steps", "2"],
        "dpo": ["--max_steps", "2"], "evaluate": ["--num_samples", "8"], "plot": []}


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def tour_commands() -> list[list[str]]:
    """The commands of the command-line section's bash block: continuation lines joined, comments dropped."""
    (block,) = re.findall(r"```bash\n(.*?)```", _section("Command line"), re.S)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture
def in_demo_dir(tmp_path, monkeypatch, demo_run):
    """A working directory whose runs/demo is the quick demo's output, as after the README's set-up command."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "demo").symlink_to(demo_run[0], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_is_one_page():
    assert len(README.read_text().splitlines()) <= 150
    assert "../shared" not in README.read_text()


def test_the_command_line_tour_runs_as_written(in_demo_dir, capsys):
    commands = tour_commands()
    assert [c[:2] for c in commands] == [["marlhf", name] for name in
                                         ("sft", "reward", "ppo", "ppo", "ppo", "dpo", "evaluate", "plot")]
    for command in commands:
        assert cli.main(command[1:] + TINY[command[1]]) == 0, (command, capsys.readouterr().err[-2000:])
    tour = in_demo_dir / "runs" / "tour"
    for run in ("sft", "reward", "ma_ppo", "ppo", "grpo", "dpo"):
        assert (tour / run / "config.json").is_file(), run
    assert [m["step"] for m in read_metrics(tour / "grpo")] == [1, 2]
    assert read_metrics(tour / "ppo")[0]["macro/mean_segment_length"] == 1.0  # --ngram 1: token-level PPO
    assert read_metrics(tour / "ma_ppo")[0]["macro/mean_segment_length"] > 4
    pair = json.loads((tour / "eval" / "comparison.json").read_text())["pairs"]["ppo_vs_ma_ppo"]
    assert (pair["model"], pair["baseline"]) == ("ppo", "ma_ppo")
    assert (tour / "plots" / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    plot = next(c for c in commands if c[1] == "plot")
    assert [default_label(run) for run in plot[2:] if not run.startswith("-")][:2] == ["ppo", "ma_ppo"]  # two curves


def test_the_python_blocks_run_as_written(in_demo_dir):
    (block,) = python_blocks()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), {})
    assert printed.getvalue().splitlines() == re.findall(r"^print\(.*\)\s+# (.*)$", block, re.M)  # as commented
    assert [m["step"] for m in read_metrics(in_demo_dir / "runs" / "api")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md", "benchmarks/results/credit_assignment/README.md",
                                  "benchmarks/results/credit_assignment_lambda/README.md"])
def test_relative_links_resolve(page):
    path = README.parent / page
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", path.read_text())
    missing = [t for t in targets if not re.match(r"^[a-z]+:", t) and not (path.parent / t).exists()]
    assert targets and not missing
