"""Deterministic, disjoint splits of a dataset's rows among the training stages.

The paper (following DeepSpeed-Chat) splits the train split of each preference dataset 20% / 40% / 40%
for SFT / reward modelling / RL, and APPS 20% / 80% for SFT / RL, with seed 1234. Rows are shuffled
with ``numpy.random.RandomState(seed)`` (the legacy generator, whose stream numpy keeps fixed across
versions), the shuffled order is cut at the rounded cumulative fractions, and each part is returned in
the dataset's original row order. The split is made over *raw rows*, before any row is converted or
skipped, so a row's stage does not depend on which other rows are malformed.
"""

from __future__ import annotations

import numpy as np


def split_indices(num_rows: int, fractions: tuple[float, ...], seed: int) -> list[list[int]]:
    """Partition ``range(num_rows)`` into ``len(fractions)`` disjoint sorted index lists.

    Part ``i`` holds the shuffled positions ``[round(c_{i-1} * n), round(c_i * n))`` where ``c_i`` is
    the cumulative sum of ``fractions`` (which must be positive and sum to 1), so the parts cover every row.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not fractions or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be positive and sum to 1, got {fractions}")
    order = np.random.RandomState(seed).permutation(num_rows)
    cumulative = np.cumsum(fractions)
    bounds = [0] + [int(round(c * num_rows)) for c in cumulative[:-1]] + [num_rows]
    return [sorted(order[start:stop].tolist()) for start, stop in zip(bounds[:-1], bounds[1:])]
