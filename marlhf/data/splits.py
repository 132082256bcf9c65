"""Deterministic, disjoint splits of a dataset's rows among the training stages.

The paper (following DeepSpeed-Chat) splits the train split of each preference dataset 20% / 40% / 40%
for SFT / reward modelling / RL, and APPS 20% / 80% for SFT / RL, with seed 1234; WebGPT, which has one
split, is first cut 95% / 5% into training and held-out rows, and the 95% part (in its shuffled order) is
then split among the stages. The rule is DeepSpeed-Chat's `get_raw_dataset_split_index`, exactly: the rows
are shuffled with ``numpy.random.RandomState(seed)`` (the legacy generator, whose stream numpy keeps fixed
across versions), part i takes ``round(f_i * n)`` of them, and every boundary is shifted by the same
amount so that the last one is n. The split is made over *raw rows*, before any row is converted or
skipped, so a row's stage does not depend on which other rows are malformed.
"""

from __future__ import annotations

import numpy as np


def split_indices(num_rows: int, fractions: tuple[float, ...], seed: int) -> list[list[int]]:
    """Partition ``range(num_rows)`` into ``len(fractions)`` disjoint index lists, each in the shuffled order
    (as DeepSpeed-Chat's index files hold them; sort a part for the dataset's row order).

    ``fractions`` must be positive and sum to 1 (DeepSpeed-Chat's "2,4,4" is (0.2, 0.4, 0.4)).
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not fractions or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be positive and sum to 1, got {fractions}")
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * float(num_rows))))
    shift = bounds[-1] - num_rows  # rounding can overshoot or fall short; DeepSpeed-Chat moves every boundary
    bounds = [0] + [bound - shift for bound in bounds[1:]]
    order = np.random.RandomState(seed).permutation(num_rows)
    return [order[start:stop].tolist() for start, stop in zip(bounds[:-1], bounds[1:])]
