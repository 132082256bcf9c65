"""`benchmarks/multiturn_rollout.py` runs end to end at a tiny size and prints its three rates and ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def test_the_benchmark_prints_both_ratios_and_the_share_in_step():
    arguments = ["--batch", "2", "--turns", "2", "--turn-tokens", "3", "--observation-tokens", "2", "--rounds", "1",
                 "--prompt-lengths", "4", "6", "--threads", "1"]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent), str(BENCHMARKS)])}
    printed = subprocess.run([sys.executable, str(BENCHMARKS / "multiturn_rollout.py"), *arguments], check=True,
                             capture_output=True, text=True, env=environment, timeout=300).stdout
    assert "multi-turn / single-turn action tokens/s:" in printed
    assert "re-reading / single-turn action tokens/s:" in printed
    assert "2 generate calls a round, median share of time in step" in printed
