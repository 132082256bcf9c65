"""Throughput of the sandboxed code reward: programs scored per second by worker count.

Each program is a correct A+B solution checked on TESTS stdin tests, so every test pays one
sandboxed interpreter start; the per-test figure is that overhead.

    .venv/bin/python benchmarks/code_reward.py [--programs 32] [--tests 4]
"""

from __future__ import annotations

import argparse
import os
import time

from marlhf.rewards import code_rewards
from marlhf.rewards.code import _isolation

SOLUTION = "a, b = map(int, input().split())\nprint(a + b)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=32)
    parser.add_argument("--tests", type=int, default=4)
    args = parser.parse_args()
    tests = {"inputs": [f"{i} {i}\n" for i in range(args.tests)], "outputs": [f"{2 * i}\n" for i in range(args.tests)]}
    print(f"isolation: {_isolation()}, cpus: {os.cpu_count()}, {args.programs} programs x {args.tests} tests")
    baseline = None
    for workers in sorted({1, 2, os.cpu_count() or 1}):
        start = time.perf_counter()
        scores = code_rewards([SOLUTION] * args.programs, [tests] * args.programs, max_workers=workers)
        elapsed = time.perf_counter() - start
        assert scores == [1.0] * args.programs, scores
        baseline = baseline or elapsed
        print(
            f"max_workers={workers}: {args.programs / elapsed:6.1f} programs/s, "
            f"{1000 * elapsed * workers / (args.programs * args.tests):5.1f} ms per test per worker, "
            f"speed-up x{baseline / elapsed:.2f}"
        )


if __name__ == "__main__":
    main()
