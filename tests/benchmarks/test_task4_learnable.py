"""`benchmarks/task4_learnable.py`: its interval against known values, the table from made-up result files, and the
toy-size run end to end (resumed without rerunning)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import task4_learnable as bench  # noqa: E402


def test_interval_matches_a_hand_computed_t_interval():
    mean, low, high = bench.interval([0.1, 0.2, 0.3, 0.4])
    half = 3.182446 * 0.1290994 / 2  # t(0.975, 3) * sample sd / sqrt(4)
    assert mean == pytest.approx(0.25) and low == pytest.approx(0.25 - half, abs=1e-5)
    assert high == pytest.approx(0.25 + half, abs=1e-5)


def made_up_result(seed: int, gain: float) -> dict:
    shares = {"right_of_found": 0.3, "markers_found": 1.0}
    return {"design": "rate0.3", "setup": "gold_sft", "seed": seed, "commit": "abcdef0123", "clean": True,
            "sft_held_out": {"gold_reward": 0.2, "kl": 0.0, **shares},
            "held_out": {"gold_reward": 0.2 + gain, "kl": 5.0, **shares}, "gain": gain,
            "reward_model_accuracy": 0.9, "run_seconds": 40.0}


def test_summary_table_from_result_files(tmp_path):
    with pytest.raises(ValueError, match="no result files"):
        bench.summarize(tmp_path)
    for seed, gain in enumerate([0.1, 0.2, 0.3, 0.4]):
        path = tmp_path / "rate0.3" / "gold_sft" / f"seed{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(made_up_result(seed, gain)))
    lines = bench.summarize(tmp_path)
    row = next(line for line in lines if line.startswith("| rate0.3 | gold_sft"))
    assert "| 0,1,2,3 | 0.200 | 0.300, 0.400, 0.500, 0.600 | +0.250 [+0.045, +0.455] |" in row
    assert "Commits (clean tree?): abcdef0 (clean)" in lines


@pytest.mark.slow  # a whole tiny study: `pytest -m slow` (CI runs it)
def test_quick_run_writes_provenance_and_resumes(tmp_path, capsys):
    arguments = ["--quick", "--seeds", "0", "--setups", "gold_sft", "--work", str(tmp_path / "work"),
                 "--results", str(tmp_path / "results")]
    assert bench.main(arguments) == 0
    path = tmp_path / "results" / "rate0.3" / "gold_sft" / "seed0.json"
    result = json.loads(path.read_text())
    assert len(result["commit"]) == 40 and isinstance(result["clean"], bool)
    assert result["hyper_parameters"]["gold"] == "decision" and result["options"] == {"termination": "fixed",
                                                                                       "ngram": 1}
    assert result["gain"] == pytest.approx(result["held_out"]["gold_reward"] - result["sft_held_out"]["gold_reward"])
    assert 0.0 <= result["held_out"]["gold_reward"] <= 1.0 and 0.0 <= result["reward_model_accuracy"] <= 1.0
    assert len(result["train_gold"]) == result["hyper_parameters"]["ppo_steps"]
    written = path.stat().st_mtime_ns
    assert bench.main(arguments) == 0  # nothing left to run
    assert path.stat().st_mtime_ns == written
    assert "| rate0.3 | gold_sft | 0 |" in capsys.readouterr().out
