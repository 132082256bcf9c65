"""A benchmark run on two checkouts side by side: before and after a change, alternating, so both see the same
machine load. Each round runs the benchmark once per checkout (its own PYTHONPATH) and reads one figure off its
output with a regex; prints every round and the after / before ratio of the medians.

    git worktree add /tmp/before HEAD~3
    python benchmarks/ab.py --before /tmp/before --rounds 3 --figure '^step\\s+([\\d.]+)' -- \\
        benchmarks/ppo_step.py --threads 1 --mini-batch 4 --steps 4        # mean step seconds (lower is better)
    python benchmarks/ab.py --before /tmp/before --figure 'marlhf / TRL throughput: ([\\d.]+)x' -- \\
        benchmarks/vs_trl.py --pieces 4                                    # marlhf / TRL steps/s (higher is better)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

AFTER = Path(__file__).resolve().parents[1]


def figure(tree: Path, benchmark: list[str], pattern: re.Pattern) -> float:
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run([sys.executable, str(tree / benchmark[0]), *benchmark[1:]], cwd=tree, env=environment,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{tree}: {' '.join(benchmark)} failed:\n{result.stderr[-3000:]}")
    match = pattern.search(result.stdout)
    if match is None:
        raise SystemExit(f"{tree}: no match for {pattern.pattern!r} in:\n{result.stdout}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--after", type=Path, default=AFTER, help="checkout after the change (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--figure", required=True, help="regex with one group: the number to compare")
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- script (relative to a checkout) and its options")
    arguments = parser.parse_args()
    benchmark = arguments.benchmark[1:] if arguments.benchmark[:1] == ["--"] else arguments.benchmark
    if not benchmark:
        parser.error("give the benchmark after --")
    pattern = re.compile(arguments.figure, re.M)
    values: dict[str, list[float]] = {"before": [], "after": []}
    for round_index in range(arguments.rounds):
        order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
        for side in order:
            values[side].append(figure(getattr(arguments, side).resolve(), benchmark, pattern))
        print(f"round {round_index + 1}: before {values['before'][-1]:.4g}  after {values['after'][-1]:.4g}",
              flush=True)
    before, after = statistics.median(values["before"]), statistics.median(values["after"])
    print(f"{' '.join(benchmark)}\n  median before {before:.4g}, after {after:.4g}: after / before = {after / before:.3f}")


if __name__ == "__main__":
    main()
