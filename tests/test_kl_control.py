"""The adaptive KL coefficient against the rule written out by hand."""

from __future__ import annotations

import math

import pytest

from marlhf.kl_control import AdaptiveKLController


def test_update_follows_ziegler_et_al():
    control = AdaptiveKLController(0.1, target=6.0, horizon=100, responses_per_step=10)
    assert control.update(7.2) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # 7.2 / 6 - 1 = 0.2
    assert control.update(6.6) == pytest.approx(0.1 * 1.02 * (1 + 0.1 * 10 / 100))
    before = control.value
    assert control.update(600.0) == pytest.approx(before * 1.02)  # the error is clipped to 0.2
    before = control.value
    assert control.update(0.0) == pytest.approx(before * 0.98)  # and to -0.2
    before = control.value
    assert control.update(6.0) == before  # at the target nothing moves
    assert control.update(math.nan) == before


def test_state_round_trip_and_checks():
    control = AdaptiveKLController(0.05, target=2.0, horizon=50, responses_per_step=8)
    for kl in (3.0, 0.5, 4.0):
        control.update(kl)
    restored = AdaptiveKLController(0.05, target=2.0, horizon=50, responses_per_step=8)
    restored.load_state_dict(control.state_dict())
    assert restored.value == control.value and restored.update(1.0) == control.update(1.0)
    with pytest.raises(ValueError, match="kl_horizon"):
        AdaptiveKLController(0.05, target=2.0, horizon=1, responses_per_step=8)  # 1 - 0.2 * 8 < 0
    with pytest.raises(ValueError, match="kl_target"):
        AdaptiveKLController(0.05, target=0.0, horizon=50, responses_per_step=8)
    with pytest.raises(ValueError, match="start finite and > 0"):
        AdaptiveKLController(0.0, target=2.0, horizon=50, responses_per_step=8)
