"""A fuzzer of the `marlhf` command line (Hypothesis): every command gets malformed and adversarial inputs (config
files, options, data files, paths, earlier output) and must answer each with one `marlhf: error: ...` line that
names the option or the file, a non-zero exit, no file written outside its output directory and no earlier output
changed.

Each fuzz test runs at a fixed seed (FUZZ_SEED) at two depths (its `fuzz_depth` argument, tests/fuzz/conftest.py):
`quick` by default, with the explicit examples (every bound just past it) and a tenth of the test's full count of
drawn examples; `full`, marked slow (`pytest -m slow`, which CI runs too), with its full count. A longer run is
`python -m tests.fuzz --examples 2000 --seed 7` (FUZZ_EXAMPLES: that count at either depth).
"""

from __future__ import annotations

import os

SEED = int(os.environ.get("FUZZ_SEED", "0"))


def examples(full_count: int, depth: str) -> int:
    """A test's count of drawn examples at `depth` ('quick' or 'full'), or FUZZ_EXAMPLES for a longer run."""
    if "FUZZ_EXAMPLES" in os.environ:
        return int(os.environ["FUZZ_EXAMPLES"])
    return full_count if depth == "full" else max(1, full_count // 10)
