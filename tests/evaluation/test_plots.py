import numpy as np
import pytest

from marlhf.evaluation.plots import group_curves, load_runs, moving_average, plot_diagnostics
from marlhf.logging_utils import MetricsLogger
from tests.evaluation.conftest import write_run


@pytest.fixture
def runs_root(tmp_path):
    for seed in (1, 2, 3):
        write_run(tmp_path / "ma_ppo" / f"seed{seed}", seed, reward_offset=0.5)
    for seed in (1, 2):
        write_run(tmp_path / "ppo" / f"seed{seed}", seed + 10, num_steps=25)
    return tmp_path


def test_group_curves_mean_and_spread_over_seeds(runs_root):
    dirs = sorted(runs_root.glob("*/seed*"))
    runs = load_runs(dirs)
    assert sorted({run.label for run in runs}) == ["ma_ppo", "ppo"]
    curves = group_curves(runs, "objective/rm_score")
    ma = curves["ma_ppo"]
    values = np.stack([run.curve("objective/rm_score")[1] for run in runs if run.label == "ma_ppo"])
    assert ma.num_runs == 3
    np.testing.assert_array_equal(ma.steps, np.arange(1, 31))
    np.testing.assert_allclose(ma.mean, values.mean(0))
    np.testing.assert_allclose(ma.std, values.std(0))
    assert curves["ppo"].num_runs == 2 and len(curves["ppo"].steps) == 25


def test_runs_outside_seed_directories_are_labelled_by_their_own_name(tmp_path):
    for name in ("ppo", "ma_ppo"):
        write_run(tmp_path / "tour" / name, 1)
    assert [run.label for run in load_runs([tmp_path / "tour" / "ppo", tmp_path / "tour" / "ma_ppo"])] == ["ppo", "ma_ppo"]


def test_group_curves_uses_only_common_steps_and_explicit_labels(tmp_path):
    with MetricsLogger(tmp_path / "a") as logger:
        for step, value in [(1, 1.0), (2, 2.0), (3, 3.0)]:
            logger.log({"objective/kl": value}, step)
    with MetricsLogger(tmp_path / "b") as logger:
        for step, value in [(2, 4.0), (3, 5.0), (4, 6.0)]:
            logger.log({"objective/kl": value}, step)
    runs = load_runs([tmp_path / "a", tmp_path / "b"], labels=["same", "same"])
    curve = group_curves(runs, "objective/kl")["same"]
    np.testing.assert_array_equal(curve.steps, [2, 3])
    np.testing.assert_allclose(curve.mean, [3.0, 4.0])
    np.testing.assert_allclose(curve.std, [1.0, 1.0])


def test_moving_average_matches_loop():
    values = np.array([1.0, 5.0, 2.0, 8.0, 3.0])
    expected = [np.mean(values[max(0, i - 2):i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(moving_average(values, 3), expected)
    np.testing.assert_allclose(moving_average(values, 1), values)


def test_plot_diagnostics_writes_pngs(runs_root, tmp_path):
    out = tmp_path / "plots"
    written = plot_diagnostics(sorted(runs_root.glob("*/seed*")), out, smoothing=3)
    names = sorted(p.name for p in written)
    assert names == sorted(["objective_rm_score.png", "objective_kl.png", "val_advantage_l2.png", "val_return_l2.png",
                            "macro_mean_segment_length.png", "objective_repetition.png", "diagnostics.png"])
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5000


def test_plot_diagnostics_errors(runs_root, tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot_diagnostics([tmp_path / "nowhere"], tmp_path / "out")
    with pytest.raises(ValueError, match="no run logged"):
        plot_diagnostics([runs_root / "ppo" / "seed1"], tmp_path / "out", metrics=["val/missing"])
    with pytest.raises(ValueError, match="one label per run"):
        load_runs([runs_root / "ppo" / "seed1"], labels=["a", "b"])
