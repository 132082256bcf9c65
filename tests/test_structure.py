"""The package's shape (scripts/structure.py): no import cycle, no import that climbs into a higher layer of
docs/contributing.md's table or back up, every module in a layer, no long function."""

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "structure.py"
spec = importlib.util.spec_from_file_location("structure", SCRIPT)
structure = sys.modules["structure"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(structure)

def test_no_import_cycle_and_no_climb_back_up():
    measured = structure.measure()
    assert measured.room_cycles == [] and measured.module_cycles == []
    assert measured.climbs == []


def test_every_module_has_a_layer_and_every_listed_path_a_module():
    measured = structure.measure()
    assert not measured.unassigned, (
        f"modules without a layer: {measured.unassigned}; add their paths to the layer table of docs/contributing.md")
    assert not measured.unmatched, f"paths of the layer table with no module: {measured.unmatched}"


def test_the_layer_table_assigns_by_the_longest_listed_path():
    layers = structure.measure().layers
    assert [name for name, _ in structure.layer_table(structure.CONTRIBUTING.read_text())] == [
        "foundation", "pure math", "the seam", "plug-ins", "run", "trainers", "tools"]
    assert (layers["marlhf.config"], layers["marlhf.segments"], layers["marlhf.plugins"]) == (
        "foundation", "pure math", "the seam")
    assert (layers["marlhf.data.tasks.apps"], layers["marlhf.data.loading"]) == ("plug-ins", "run")
    assert (layers["marlhf.engines.vllm"], layers["marlhf.engines.vllm_serve"]) == ("plug-ins", "tools")
    assert (layers["marlhf.trainers.ppo"], layers["marlhf.commands.serve"]) == ("trainers", "tools")


def test_an_import_into_a_higher_layer_is_a_climb(tmp_path):
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    for path in ("__init__.py", "low/__init__.py", "low/b.py", "mid.py", "stray.py"):
        (package / path).write_text("")
    (package / "low" / "a.py").write_text("from pkg.low import b\n\n\ndef f():\n    from pkg import high\n")
    (package / "high.py").write_text("from pkg import mid\nimport pkg.stray\n")  # down, and to no layer
    table = "\n".join([structure.LAYER_TABLE_HEADER, "|---|---|---|",
                       "| bottom | `low/`, `__init__.py` (`a` and `b`) | nothing |",
                       "| middle | `low/b.py`, `mid.py`, `gone.py` | bottom |",
                       "| top | `high.py` | everything |", "", "| not | `stray.py` | a layer |"])
    measured = structure.measure(package, structure.layer_table(table))
    assert measured.layers == {"pkg": "bottom", "pkg.high": "top", "pkg.low": "bottom", "pkg.low.a": "bottom",
                               "pkg.low.b": "middle", "pkg.mid": "middle"}
    assert measured.room_cycles == [] and measured.climbs == [("pkg.low.a", "pkg.high"), ("pkg.low.a", "pkg.low.b")]
    assert (measured.unassigned, measured.unmatched) == (["pkg.stray"], ["gone.py"])
    with pytest.raises(ValueError, match="listed in two layers"):
        structure.measure(package, structure.layer_table(table.replace("`gone.py`", "`high.py`")))


def test_the_ppo_step_stays_one_readable_file_under_450_lines():
    """trainers/ppo.py holds the loop and its stages in reading order; what is not the step (asynchronous rollouts,
    token budgets, continuations, episodes, set-up) lives beside it."""
    lines = len((structure.PACKAGE / "trainers" / "ppo.py").read_text().splitlines())
    assert lines < 450, f"marlhf/trainers/ppo.py has {lines} lines: move what is not the step beside it"


def test_no_function_is_longer_than_60_lines():
    over = [f"{name}: {lines} lines" for lines, name in structure.function_lengths()
            if lines > structure.MAX_FUNCTION_LINES]
    assert over == [], "functions whose body (without the docstring) is over 60 lines: " + ", ".join(over)


def test_the_measure_sees_a_cycle_a_climb_and_a_long_function(tmp_path):
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from pkg import high\nfrom pkg.low import b, helper\n")
    (package / "low" / "b.py").write_text("")
    (package / "high.py").write_text("from pkg.low import a\n\n\ndef f():\n    '''doc'''\n" + "    x = 1\n" * 61)
    measured = structure.measure(package, layers=[])
    assert measured.room_cycles == [["pkg.high", "pkg.low"]]
    assert measured.climbs == [("pkg.high", "pkg.low.a"), ("pkg.low.a", "pkg.high"), ("pkg.low.a", "pkg.low")]
    assert list(structure.function_lengths(package)) == [(61, "pkg/high.py:f")]
