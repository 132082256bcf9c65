"""Small-sample statistics for comparing runs over seeds: Student's t distribution and paired t-intervals,
and Holm's correction (numpy only, no SciPy)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["t_cdf", "t_quantile", "paired_t", "holm"]


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * fraction


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: int) -> float:
    """Inverse of `t_cdf` (bisection to 1e-12)."""
    low, high = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return 0.5 * (low + high)


def paired_t(differences: Sequence[float] | np.ndarray, level: float = 0.95) -> dict:
    """Mean, `level` t-interval and two-sided p-value of paired differences ({"n", "mean", "ci", "p"}; nan
    interval and p with fewer than 2 pairs)."""
    differences = np.asarray(differences, dtype=float)
    n = len(differences)
    mean = float(differences.mean()) if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "ci": (math.nan, math.nan), "p": math.nan}
    se = float(differences.std(ddof=1)) / math.sqrt(n)
    half = t_quantile(0.5 + level / 2, n - 1) * se
    p = 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1)) if se > 0 else (0.0 if mean != 0 else 1.0)
    return {"n": n, "mean": mean, "ci": (mean - half, mean + half), "p": p}


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the input order (nan stays nan and is not counted)."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted, running = [math.nan] * len(p_values), 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (len(indexed) - rank) * p))
        adjusted[i] = running
    return adjusted
