"""A fuzzer of the `marlhf` command line (Hypothesis): every command gets malformed and adversarial inputs (config
files, options, data files, paths, earlier output) and must answer each with one `marlhf: error: ...` line that
names the option or the file, a non-zero exit, no file written outside its output directory and no earlier output
changed.

CI runs a fixed number of examples per test at a fixed seed (FUZZ_EXAMPLES, FUZZ_SEED); a longer run is
`python -m tests.fuzz --examples 2000 --seed 7`.
"""

from __future__ import annotations

import os

SEED = int(os.environ.get("FUZZ_SEED", "0"))


def examples(ci_count: int) -> int:
    """A test's example count: its CI count, or FUZZ_EXAMPLES for a longer run."""
    return int(os.environ.get("FUZZ_EXAMPLES", ci_count))
