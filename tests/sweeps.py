"""What the default run (`pytest`) keeps of a sweep, and what it leaves to `pytest -m slow` (CI runs both).

A sweep that repeats one property over seeds or over cases of the same kind runs its first case by default, which
catches a broken property in seconds; the rest, marked slow, catch what only some inputs show."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def sweep(values: Iterable, by_default: int = 1) -> list:
    """`values` of one argument (or a fixture's params): the first `by_default` run by default, the rest are marked
    slow."""
    return [value if index < by_default else pytest.param(value, marks=pytest.mark.slow)
            for index, value in enumerate(values)]


def seeds(count: int) -> list:
    """Seeds 0 to count - 1 of a sweep that checks one property on fresh random inputs: seed 0 by default."""
    return sweep(range(count))
