"""A longer fuzz run than CI's: `python -m tests.fuzz --examples 2000 --seed 7 [pytest options]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
parser.add_argument("--examples", type=int, default=200,
                    help="examples per fuzz test (pytest: 1 to 3, -m slow: 2 to 30)")
parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (CI: 0)")
arguments, pytest_options = parser.parse_known_args()
os.environ.update(FUZZ_EXAMPLES=str(arguments.examples), FUZZ_SEED=str(arguments.seed))
sys.exit(pytest.main([str(Path(__file__).parent), "-p", "no:cacheprovider", *pytest_options]))
