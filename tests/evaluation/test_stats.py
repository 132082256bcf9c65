"""Small-sample statistics against tabulated values and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from marlhf.evaluation.stats import holm, paired_t, t_cdf, t_quantile


def test_t_distribution_and_holm_against_tables():
    assert t_quantile(0.975, 7) == pytest.approx(2.364624, abs=1e-6)
    assert t_quantile(0.975, 3) == pytest.approx(3.182446, abs=1e-6)
    assert t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-6)
    assert t_cdf(2.0, 10) == pytest.approx(0.963306, abs=1e-6)
    assert t_cdf(-1.5, 4) == pytest.approx(0.5 + 0.75 * -0.6 * (1 - 0.36 / 3), abs=1e-12)  # closed form, df 4
    assert t_cdf(0.0, 5) == pytest.approx(0.5)
    stats = paired_t(np.array([0.1, 0.3, 0.2, 0.4]))
    se = np.std([0.1, 0.3, 0.2, 0.4], ddof=1) / 2
    assert stats["mean"] == pytest.approx(0.25)
    assert stats["ci"] == pytest.approx((0.25 - 3.182446 * se, 0.25 + 3.182446 * se), abs=1e-6)
    assert stats["p"] == pytest.approx(2 * (1 - t_cdf(0.25 / se, 3)))
    assert math.isnan(paired_t(np.array([0.3]))["p"])
    assert holm([0.01, 0.04, 0.03, math.nan]) == pytest.approx([0.03, 0.06, 0.06, math.nan], nan_ok=True)
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
