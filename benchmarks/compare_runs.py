"""Is a refactor behaviour-preserving? Compare two fixed-seed output trees file by file, exactly.

    git worktree add /tmp/before HEAD~1
    (cd /tmp/before && PYTHONPATH=. python -m marlhf demo --quick --out /tmp/runs_before --methods rloo dpo)
    marlhf demo --quick --out /tmp/runs_after --methods rloo dpo
    python benchmarks/compare_runs.py /tmp/runs_before /tmp/runs_after

Every metrics.jsonl (without its time/ entries, which measure the machine), gold.jsonl and eval_samples.jsonl
under the first tree must have a twin under the second with the same values, bit for bit. Prints one line
per file and exits 1 on any difference or missing twin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FILES = ("metrics.jsonl", "gold.jsonl", "eval_samples.jsonl")


def rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    arguments = parser.parse_args(argv)
    paths = sorted(p for name in FILES for p in arguments.before.rglob(name))
    if not paths:
        print(f"no {', '.join(FILES)} under {arguments.before}")
        return 1
    differences = 0
    for path in paths:
        twin = arguments.after / path.relative_to(arguments.before)
        verdict = "missing" if not twin.exists() else "same" if rows(path) == rows(twin) else "DIFFERENT"
        differences += verdict != "same"
        print(f"{verdict:>9}  {path.relative_to(arguments.before)}")
    print(f"{len(paths) - differences} of {len(paths)} files identical")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
