import itertools
import json
import math
from fractions import Fraction

import pytest

from marlhf.evaluation.passk import aggregate_pass_at_k, apps_pass_at_k, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows float64; the exact rational value is the reference.
    for n, c, k in [(1000, 3, 500), (1000, 1, 1), (200, 150, 5), (1000, 999, 1000)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)


def test_pass_at_1_is_the_fraction_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


@pytest.mark.parametrize("args", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


def test_aggregate_by_difficulty():
    result = aggregate_pass_at_k(
        ["interview", "introductory", "interview", "competition"], [4, 4, 4, 4], [4, 0, 2, 1], ks=(1, 2))
    assert list(result) == ["introductory", "interview", "competition", "all"]
    assert result["introductory"] == {"num_problems": 1, "pass@1": 0.0, "pass@2": 0.0}
    assert result["interview"]["pass@1"] == pytest.approx((1.0 + 0.5) / 2)
    assert result["interview"]["pass@2"] == pytest.approx((1.0 + brute_force_pass_at_k(4, 2, 2)) / 2)
    assert result["all"]["num_problems"] == 4
    assert result["all"]["pass@1"] == pytest.approx((0 + 1 + 0.5 + 0.25) / 4)


def test_aggregate_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        aggregate_pass_at_k(["interview"], [1, 2], [0, 1], ks=(1,))


def test_apps_pass_at_k_runs_programs_in_the_sandbox():
    records = [
        {"prompt": "sum", "difficulty": "introductory",
         "input_output": json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})},
        {"prompt": "even", "difficulty": "interview",
         "input_output": {"fn_name": "is_even", "inputs": [[2], [3]], "outputs": [[True], [False]]}},
    ]
    programs = [
        ["a, b = map(int, input().split())\nprint(a + b)\n",  # passes
         "print(3)\n",  # passes one test of two: partial credit is not a pass
         "def broken(:\n"],  # does not compile
        ["def is_even(n):\n    return n % 2 == 0\n",
         "def is_even(n):\n    raise RuntimeError\n"],
    ]
    result = apps_pass_at_k(records, programs, ks=(1, 2), timeout_s=5.0, max_workers=2)
    assert result["introductory"]["pass@1"] == pytest.approx(1 / 3)
    assert result["introductory"]["pass@2"] == pytest.approx(brute_force_pass_at_k(3, 1, 2))
    assert result["interview"]["pass@1"] == pytest.approx(0.5)
    assert result["interview"]["pass@2"] == pytest.approx(1.0)
    assert result["all"]["pass@1"] == pytest.approx((1 / 3 + 0.5) / 2)


def test_apps_pass_at_k_needs_apps_fields():
    with pytest.raises(ValueError, match="difficulty"):
        apps_pass_at_k([{"prompt": "x", "input_output": "{}"}], [["print(1)"]])
