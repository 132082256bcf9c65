"""pass@k on APPS: the unbiased estimator of Chen et al. (2021), aggregated by problem difficulty.

A program passes a problem when the sandboxed unit-test reward (`marlhf.rewards.code_reward`) is
+1.0, i.e. every test passes; partially correct programs count as failures.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from marlhf.rewards import code_rewards
from marlhf.rewards.code import REWARD_ALL_PASSED

APPS_DIFFICULTIES = ("introductory", "interview", "competition")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from `num_samples`
    (of which `num_correct` pass) passes: 1 - C(n-c, k) / C(n, k).

    The ratio of binomials is computed as the product prod_{i=n-c+1}^{n} (1 - k/i), which never
    forms the huge binomial coefficients themselves."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, num_samples={num_samples}], got {num_correct}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, num_samples={num_samples}], got {k}")
    if num_samples - num_correct < k:  # every draw of k samples contains a correct one
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def aggregate_pass_at_k(
    difficulties: Sequence[str], num_samples: Sequence[int], num_correct: Sequence[int], ks: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Mean pass@k over the problems of each difficulty and over all problems ("all").

    Returns {group: {"num_problems": m, "pass@1": ..., ...}}, groups in APPS order, then any other
    difficulty label in sorted order, then "all"."""
    if not len(difficulties) == len(num_samples) == len(num_correct):
        raise ValueError(
            f"difficulties, num_samples and num_correct must have the same length, got "
            f"{len(difficulties)}, {len(num_samples)} and {len(num_correct)}"
        )
    if not ks:
        raise ValueError("ks must name at least one k")
    per_group: dict[str, list[int]] = defaultdict(list)
    for index, difficulty in enumerate(difficulties):
        per_group[difficulty].append(index)
        per_group["all"].append(index)
    order = [d for d in APPS_DIFFICULTIES if d in per_group]
    order += sorted(set(per_group) - set(APPS_DIFFICULTIES) - {"all"}) + ["all"] * bool(per_group)
    result = {}
    for group in order:
        indices = per_group[group]
        summary: dict[str, float] = {"num_problems": len(indices)}
        for k in ks:
            summary[f"pass@{k}"] = float(np.mean([pass_at_k(num_samples[i], num_correct[i], k) for i in indices]))
        result[group] = summary
    return result


def count_passing(
    programs: Sequence[Sequence[str]],
    input_outputs: Sequence[dict[str, Any] | str],
    timeout_s: float = 4.0,
    max_workers: int | None = None,
) -> list[int]:
    """Number of programs of each problem that pass all its tests in the code sandbox.

    `programs[i]` are the samples for problem i; `input_outputs[i]` its tests, as a dict or as the
    JSON string the APPS records carry."""
    if len(programs) != len(input_outputs):
        raise ValueError(f"programs and input_outputs must have the same length, got {len(programs)} and {len(input_outputs)}")
    tests = [json.loads(io) if isinstance(io, str) else io for io in input_outputs]
    flat_programs = [program for samples in programs for program in samples]
    flat_tests = [tests[i] for i, samples in enumerate(programs) for _ in samples]
    rewards = code_rewards(flat_programs, flat_tests, timeout_s=timeout_s, max_workers=max_workers)
    counts, start = [], 0
    for samples in programs:
        counts.append(sum(reward == REWARD_ALL_PASSED for reward in rewards[start : start + len(samples)]))
        start += len(samples)
    return counts


def apps_pass_at_k(
    records: Sequence[dict[str, Any]],
    programs: Sequence[Sequence[str]],
    ks: Sequence[int] = (1, 5),
    timeout_s: float = 4.0,
    max_workers: int | None = None,
) -> dict[str, dict[str, float]]:
    """pass@k by APPS difficulty for `programs[i]`, the samples generated for `records[i]` (records of
    the "eval" stage of codeparrot/apps: they carry "input_output" and "difficulty")."""
    if len(records) != len(programs):
        raise ValueError(f"records and programs must have the same length, got {len(records)} and {len(programs)}")
    for index, record in enumerate(records):
        for field in ("input_output", "difficulty"):
            if field not in record:
                raise ValueError(f"records[{index}] has no {field!r} field (pass@k needs APPS records)")
    num_correct = count_passing(programs, [r["input_output"] for r in records], timeout_s, max_workers)
    return aggregate_pass_at_k([r["difficulty"] for r in records], [len(p) for p in programs], num_correct, ks)
