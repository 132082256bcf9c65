"""The package's shape (scripts/structure.py): no import cycle, no import that climbs back up, no long function."""

import importlib.util
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "structure.py"
spec = importlib.util.spec_from_file_location("structure", SCRIPT)
structure = sys.modules["structure"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(structure)


def test_no_import_cycle_and_no_climb_back_up():
    measured = structure.measure()
    assert measured.room_cycles == [] and measured.module_cycles == []
    assert measured.climbs == []


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
    measured = structure.measure(package)
    assert measured.room_cycles == [["pkg.high", "pkg.low"]]
    assert measured.climbs == [("pkg.high", "pkg.low.a"), ("pkg.low.a", "pkg.high"), ("pkg.low.a", "pkg.low")]
    assert list(structure.function_lengths(package)) == [(61, "pkg/high.py:f")]
