"""`benchmarks/credit_assignment.py --quick`: a 2-cell grid end to end, resumed without rerunning anything."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import credit_assignment  # noqa: E402


def test_grid_is_the_pre_registered_one():
    cells = credit_assignment.grid()
    runs = sum(len(seeds) for seeds in cells.values())
    assert len(cells) == 106 and runs == 414
    assert cells[("task1", "gold_sft", "n1")] == (0, 1, 2, 3, 4)
    assert cells[("task1", "rm_rm", "n3")] == (0, 1, 2)
    assert cells[("task1", "gold_sft", "randomized")] == (0, 1, 2, 3, 4)  # equal weighting: 5 seeds
    assert cells[("task2", "rm_rm", "randomized+vw_unit")] == (0, 1, 2)
    assert ("task1_long", "gold_sft", "n3") not in cells
    assert ("task2", "gold_sft", "whole+sw_uniform") not in cells  # segment weighting: task 1 only
    jobs = credit_assignment.job_order(cells)
    assert len(jobs) == runs and jobs[0][3] == 0 and jobs[-1][0] == "task1_long"


@pytest.mark.slow  # a whole tiny study: `pytest -m slow` (CI runs it)
def test_quick_grid_runs_resumes_and_summarizes(tmp_path, capsys):
    work, results = tmp_path / "work", tmp_path / "results"
    arguments = ["--quick", "--work", str(work), "--results", str(results)]
    assert credit_assignment.main(arguments) == 0
    files = sorted(results.glob("task1/gold_sft/*/seed0.json"))
    assert [f.parent.name for f in files] == ["n1", "word+vw_first"]
    for path in files:
        result = json.loads(path.read_text())
        steps = result["steps"]
        assert steps == list(range(1, len(steps) + 1)) and set(result["held_out"]) == {"gold_reward", "rm_reward", "kl"}
        # reward=gold: PPO's score is 4 x the gold reward of the same responses
        assert result["curves"]["objective/rm_score"] == pytest.approx(
            [credit_assignment.GOLD_SCALE * g for g in result["curves"]["gold_reward"]], abs=1e-5)
        lengths = result["curves"]["macro/mean_segment_length"]
        if result["cell"] == "n1":
            assert lengths == [1.0] * len(steps)
        else:  # one macro action per word (words are 1-5 tokens)
            assert result["options"] == {"termination": "word", "value_weighting": "first"}
            assert all(1.5 < x < 5 for x in lengths)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["missing_runs"] == [] and set(summary["cells"]) == {"task1/gold_sft/n1", "task1/gold_sft/word+vw_first"}
    speedup = summary["cells"]["task1/gold_sft/n1"]["speedup_vs_ppo"]
    assert speedup == 1.0 or math.isnan(speedup)  # nan: PPO did not improve on SFT in 3 steps
    assert (results / "task1_gold_sft.png").read_bytes()[:4] == b"\x89PNG"
    table = (results / "summary.md").read_text()
    assert "| n1 | 1 |" in table and "| word+vw_first | 1 |" in table

    before = {f: f.stat().st_mtime_ns for f in files}
    capsys.readouterr()
    assert credit_assignment.main(arguments) == 0  # resumed: every run is read back, none is run again
    assert "2 done, 0 to run" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in files} == before
    assert json.loads((results / "summary.json").read_text())["cells"] == summary["cells"]


def test_summary_figures_of_merit_on_made_up_curves(tmp_path):
    """Steps to 80 %, AUC and gold at matched KL from hand-made result files (no training)."""
    def write(cell, seed, gold, kl, held_out):
        path = credit_assignment.result_path(tmp_path, "task1", "gold_sft", cell, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        curves = {key: [0.0] * len(gold) for key in ("policy/clipfrac", "macro/mean_segment_length", "val/advantage_l2",
                                                     "val/return_l2")}
        curves.update({"gold_reward": gold, "objective/kl": kl, "objective/response_length": [64.0] * len(gold)})
        path.write_text(json.dumps({"task": "task1", "setup": "gold_sft", "cell": cell, "seed": seed,
                                    "sft_sha256": "a", "reward_sha256": "b", "steps": list(range(1, len(gold) + 1)),
                                    "curves": curves, "held_out": {"gold_reward": held_out, "kl": kl[-1]},
                                    "run_seconds": 1.0}))

    steps = 20
    ramp = [min(1.0, s / 10) for s in range(steps)]  # PPO: 0 -> 1 by step 11
    fast = [min(1.0, s / 5) for s in range(steps)]  # twice as fast
    for seed in (0, 1):
        write("n1", seed, ramp, [float(s) for s in range(steps)], 0.9)
        write("n5", seed, fast, [2.0 * s for s in range(steps)], 0.95)
    cells = {("task1", "gold_sft", "n1"): (0, 1), ("task1", "gold_sft", "n5"): (0, 1, 2)}
    summary = credit_assignment.summarize(tmp_path, cells)
    assert summary["missing_runs"] == ["task1/gold_sft/n5/seed2"]
    ppo, n5 = summary["cells"]["task1/gold_sft/n1"], summary["cells"]["task1/gold_sft/n5"]
    smoothed = credit_assignment._smooth(np.array(ramp), credit_assignment.SMOOTHING)
    target = summary["groups"]["task1/gold_sft"]["target_gold_80"]
    assert target == pytest.approx(0.8 * smoothed[-1])  # start gold 0
    assert ppo["steps_to_80"] == 1 + next(i for i, v in enumerate(smoothed) if v >= target)
    assert n5["steps_to_80"] < ppo["steps_to_80"] and n5["speedup_vs_ppo"] == pytest.approx(ppo["steps_to_80"] / n5["steps_to_80"])
    assert n5["auc"] > ppo["auc"] and n5["final_held_out_gold"] == pytest.approx(0.95)
    assert n5["steps_to_80_ci"] == (n5["steps_to_80"], n5["steps_to_80"])  # identical seeds: a point interval
    # matched KL = n1's final KL: n5 reaches it at half the steps, where its gold is the same
    # as n1's there (gold rises at the same rate per unit of KL in both)
    assert n5["gold_at_matched_kl"] == pytest.approx(ppo["gold_at_matched_kl"], abs=0.05)


def test_no_target_when_ppos_gain_is_within_seed_noise(tmp_path):
    """Token-level PPO up on one seed and down on the other: its gain's interval reaches 0, so steps to 80 % are
    undefined for every cell of the group (not read off the start of the curves), and the table says so."""
    steps = 20
    for seed, direction in ((0, 1.0), (1, -1.0)):
        for cell in ("n1", "n5"):
            path = credit_assignment.result_path(tmp_path, "task2", "gold_sft", cell, seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            gold = [direction * 0.1 * s / steps for s in range(steps)]
            curves = {key: [0.0] * steps for key in ("policy/clipfrac", "macro/mean_segment_length",
                                                     "objective/response_length")}
            curves.update({"gold_reward": gold, "objective/kl": [0.1 * s for s in range(steps)]})
            path.write_text(json.dumps({"task": "task2", "setup": "gold_sft", "cell": cell, "seed": seed,
                                        "sft_sha256": "a", "reward_sha256": "b", "steps": list(range(1, steps + 1)),
                                        "curves": curves, "held_out": {"gold_reward": 0.0, "kl": 1.9},
                                        "run_seconds": 1.0}))
    cells = {("task2", "gold_sft", "n1"): (0, 1), ("task2", "gold_sft", "n5"): (0, 1)}
    summary = credit_assignment.summarize(tmp_path, cells)
    group = summary["groups"]["task2/gold_sft"]
    low, high = group["ppo_gain_ci"]
    assert low < 0 < high and not group["target_defined"] and group["target_gold_80"] == math.inf
    assert all(math.isnan(entry["steps_to_80"]) for entry in summary["cells"].values())
    credit_assignment.write_summary(summary, tmp_path, {"run_seconds_total": 4.0, "runs": 4})
    table = (tmp_path / "summary.md").read_text()
    assert "no 80 % target" in table and "| n5 | 2 | undefined |" in table


def test_gold_at_kl_first_and_last_crossing():
    """KL that peaks early and falls back (Task 1-long): the first crossing reads the rising edge, the last one
    where the curve comes down to the target; with KL that only grows the two agree."""
    kl = np.array([0.0, 4.0, 8.0, 6.0, 3.0, 2.0])
    gold = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    assert credit_assignment._gold_at_kl(kl, gold, 2.0) == pytest.approx(0.05)  # between steps 1 and 2
    assert credit_assignment._gold_at_kl(kl, gold, 2.0, crossing="last") == pytest.approx(0.5)  # the last step
    assert credit_assignment._gold_at_kl(kl, gold, 4.5, crossing="last") == pytest.approx(0.35)  # 6 -> 3, halfway
    assert math.isnan(credit_assignment._gold_at_kl(kl, gold, 9.0, crossing="last"))  # never that far
    rising = np.array([0.0, 1.0, 2.0, 3.0])
    for target in (0.5, 2.5):
        assert credit_assignment._gold_at_kl(rising, gold[:4], target, crossing="last") == pytest.approx(
            credit_assignment._gold_at_kl(rising, gold[:4], target))


def test_value_weighting_decision_applies_the_pre_registered_rule():
    def cell(gold, gold_ci, kl_gold, kl_ci):
        return {"final_held_out_gold": gold, "final_held_out_gold_ci": gold_ci,
                "gold_at_matched_kl": kl_gold, "gold_at_matched_kl_ci": kl_ci}

    cells = {}
    for group, term in credit_assignment.DECISION_COMPARISONS:
        cells[f"{group}/{term}"] = cell(0.5, (0.45, 0.55), 0.4, (0.35, 0.45))
        cells[f"{group}/{term}+vw_first"] = cell(0.7, (0.65, 0.75), 0.38, (0.30, 0.40))  # matched KL: overlaps
    decide = credit_assignment.value_weighting_decision
    result = decide({"cells": cells, "missing_runs": []})
    assert result["complete"] and result["first_becomes_default"] and len(result["comparisons"]) == 8

    group, term = credit_assignment.DECISION_COMPARISONS[-1]
    touching = dict(cells, **{f"{group}/{term}+vw_first": cell(0.6, (0.55, 0.65), 0.4, (0.35, 0.45))})
    assert decide({"cells": touching, "missing_runs": []})["first_becomes_default"] is False  # 0.55 = 0.55: not disjoint
    below = dict(cells, **{f"{group}/{term}+vw_first": cell(0.7, (0.65, 0.75), 0.2, (0.1, 0.3))})
    assert decide({"cells": below, "missing_runs": []})["first_becomes_default"] is False
    never = dict(cells, **{f"{group}/{term}+vw_first": cell(0.7, (0.65, 0.75), math.nan, (math.nan, math.nan))})
    assert decide({"cells": never, "missing_runs": []})["first_becomes_default"] is False
    incomplete = decide({"cells": cells, "missing_runs": [f"{group}/{term}/seed4"]})
    assert not incomplete["complete"] and incomplete["first_becomes_default"] is None


def test_transients_find_the_kl_peak_and_the_shortest_responses():
    kl = np.array([[0.0, 6.0, 2.0, 1.0], [0.0, 2.0, 4.0, 1.0]])  # seed-mean 0, 4, 3, 1: peak 4 at step 2
    length = np.array([[180.0, 90.0, 60.0, 170.0], [180.0, 70.0, 100.0, 150.0]])  # mean 180, 80, 80, 160
    assert credit_assignment._transients(kl, length) == {
        "kl_peak": 4.0, "kl_peak_step": 2, "length_start": 180.0, "length_min": 80.0, "length_min_step": 2,
        "length_final": 160.0}
