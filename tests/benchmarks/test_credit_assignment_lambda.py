"""Study II (`benchmarks/credit_assignment_lambda.py`): the pre-registered design, its statistics against known
values, the tuning and decision rules on made-up result files, and the tiny version end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import credit_assignment_lambda as study  # noqa: E402


def test_the_design_is_the_pre_registered_one():
    design = study.DESIGN
    tuning = study.tuning_jobs(design)
    assert len(tuning) == 13 * 2 * 2 * 2  # settings x tasks x set-ups x seeds
    assert {job[1] for job in tuning} == {"task1", "task1_long"} and {job[4] for job in tuning} == {0}
    settings = {family: list(s) for family, (_, s) in design.families.items()}
    assert settings == {"ppo": ["lam0.95", "lam0.99", "lam1"],
                        "vcppo": ["lam0.95", "lam0.95+warmup", "lam0.99", "lam0.99+warmup"],
                        "vapo": ["alpha0.02", "alpha0.05", "alpha0.1"], "ma_first": ["lam0.9", "lam0.95", "lam1"]}
    jobs = study.confirmation_jobs(design)
    primary = [j for j in jobs if j[0] == "confirmation"]
    assert len(primary) == 7 * 3 * 2 * 8 and len(jobs) - len(primary) == 2 * 3 * 2 * 8
    assert {(j[4], j[5]) for j in primary} == {(b, s) for b in (1, 2) for s in (10, 11, 12, 13)}
    assert jobs.index(primary[-1]) < min(i for i, j in enumerate(jobs) if j[0] == "secondary")
    assert set(study.KL_TARGETS) == {(t, s) for t in design.tasks for s in design.setups}
    assert study.TASKS["task3"]["gold"] == "alternation"

    choices = {"settings": {"ppo": "lam1", "vcppo": "lam0.99+warmup", "vapo": "alpha0.05", "ma_first": "lam0.9"},
               "tok": "vcppo"}
    options = study.job_options(("confirmation", "task1_long", "rm_rm", "vcppo", 1, 10), design, choices)
    assert options == {"termination": "fixed", "ngram": 1, "lam": 0.99, "lam_critic": 1.0, "critic_warmup_steps": 5,
                       "kl_target": 10.0, "kl_horizon": 160}
    fixed = study.job_options(("secondary", "task1", "gold_sft", "tok_fixed_kl", 2, 13), design, choices)
    assert "kl_target" not in fixed and fixed["lam_critic"] == 1.0
    ma = study.job_options(("secondary", "task3", "gold_sft", "ma_first_fixed_kl", 1, 10), design, choices)
    assert ma == {"termination": "fixed", "ngram": 5, "value_weighting": "first", "lam": 0.9}
    vapo = study.job_options(("tuning", "task1", "gold_sft", "vapo+alpha0.1", 0, 0), design, None)
    assert vapo["lam_schedule"] == "length_adaptive" and vapo["lam_alpha"] == 0.1 and vapo["kl_target"] == 9.0


def _write(results: Path, job: tuple, gold: float, sft: float = 0.0, sft_sha256: str = "a") -> None:
    path = study.result_path(results, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    phase, task, setup, arm, build, seed = job
    path.write_text(json.dumps({
        "phase": phase, "task": task, "setup": setup, "arm": arm, "build": build, "seed": seed,
        "sft_sha256": sft_sha256, "reward_sha256": "b",
        "held_out": {"gold_reward": gold}, "sft_held_out": {"gold_reward": sft}, "run_seconds": 1.0,
        "curves": {"gold_reward": [sft, gold], "objective/kl": [0.0, 5.0]}}))


def test_tuning_and_decision_rules_on_made_up_results(tmp_path):
    """Tuning picks each family's best setting (ties: the first listed) and TOK; MA clearly ahead in one group and
    level elsewhere is case 1, with the groups named; MA clearly behind somewhere and never ahead is case 2."""
    design = study.DESIGN
    rng = np.random.default_rng(0)
    best = {"ppo+lam1": 0.5, "vcppo+lam0.99": 0.6, "vapo+alpha0.05": 0.55, "ma_first+lam0.9": 0.4,
            "ma_first+lam0.95": 0.4}  # ma_first: a tie, lam0.9 is listed first
    for job in study.tuning_jobs(design):
        _write(tmp_path, job, best.get(job[3], 0.3) + (0.1 if job[1] == "task1" else 0.0), sft=0.1)
    assert study.choose_settings(design, {}) is None
    results = study.load_results(tmp_path)
    choices = study.choose_settings(design, results)
    assert choices["settings"] == {"ppo": "lam1", "vcppo": "lam0.99", "vapo": "alpha0.05", "ma_first": "lam0.9"}
    assert choices["tok"] == "vcppo" and choices["scores"]["vcppo+lam0.99"] == pytest.approx(0.55)

    def confirm(ma_shift):
        for job in study.confirmation_jobs(design):
            if job[0] == "confirmation":
                noise = rng.normal(0, 0.01)  # shared by a (build, seed) pair across arms: paired
                shift = ma_shift.get(f"{job[1]}/{job[2]}", 0.0) if job[3] == "ma_first" else 0.0
                _write(tmp_path, job, 0.5 + 0.01 * job[5] + shift + (noise if job[3] == "ma_first" else 0.0))
        return study.compare(design, study.load_results(tmp_path), choices)

    table = confirm({"task1/gold_sft": 0.2})
    decision = table["decision"]
    assert decision["complete"] and decision["case"] == 1 and decision["ma_ahead"] == ["task1/gold_sft"]
    assert decision["tok_ahead"] == [] and len(decision["no_difference"]) == 5
    assert decision["defaults"]["options"]["lam"] == 0.9
    entry = table["groups"]["task1/gold_sft"]["arms"]["ma_first"]
    assert entry["vs_tok"]["mean"] == pytest.approx(0.2, abs=0.01) and entry["vs_tok"]["p_holm"] < 0.05
    assert table["groups"]["task1/gold_sft"]["arms"]["vcppo"]["verdict"] == "-"  # TOK itself
    _write(tmp_path, ("secondary", "task1", "gold_sft", "tok_fixed_kl", 1, 10), 0.5)
    _write(tmp_path, ("secondary", "task1", "gold_sft", "ma_first_fixed_kl", 1, 10), 0.5)
    assert study.secondary(design, study.load_results(tmp_path)) == {}  # 1 of 8 runs: not shown yet
    lines = study.headline(table)
    assert lines[0].startswith("## Headline")
    assert sum(line.startswith("| task") and "set-up" not in line for line in lines) == 6
    assert "| task1/gold_sft | 0.615 | 0.8" in "\n".join(lines)  # TOK 0.5 + 0.01 x mean seed 11.5
    assert "Case 1 of the rule: TOK is ahead in no group" in lines[-2]
    assert "MA-PPO ahead in: task1/gold_sft;" in lines[-2]

    kl = "\n".join(study.kl_against_target(table))  # every made-up run ends at KL 5
    assert "within ±0.0 in every group" in kl and "within 10 % of it in no group" in kl
    assert "task1_long/gold_sft (above: aimed at 4, ended 5.0-5.0)" in kl and "task1/gold_sft (below: aimed at 9" in kl
    assert "no difference detected; differences beyond ±" in "\n".join(lines)

    decision = confirm({"task3/rm_rm": -0.2})["decision"]
    assert decision["case"] == 2 and decision["tok_ahead"] == ["task3/rm_rm"] and decision["ma_ahead"] == []
    assert decision["defaults"] == {"family": "vcppo", "setting": "lam0.99", "options": study.FAMILIES["vcppo"][1][
        "lam0.99"]}


@pytest.mark.slow  # a whole tiny study: `pytest -m slow` (CI runs it)
def test_quick_study_runs_resumes_and_summarizes(tmp_path, capsys):
    work, results = tmp_path / "work", tmp_path / "results"
    arguments = ["--quick", "--work", str(work), "--results", str(results)]
    assert study.main(arguments) == 0
    files = sorted(results.glob("*/*/*/*/*.json"))
    assert len(files) == 4 + 6 + 4
    result = json.loads(study.result_path(results, ("confirmation", "task1", "gold_sft", "ma_first", 1, 10))
                        .read_text())
    assert result["options"]["kl_target"] == 9.0 and result["hyper_parameters"]["task_seed"] == 1235
    assert result["curves"]["objective/kl_coef"][0] == 0.05  # the adaptive coefficient starts at the demo's
    assert result["sft_held_out"]["gold_reward"] == pytest.approx(result["sft_held_out"]["gold_reward"])
    fixed = json.loads(study.result_path(results, ("secondary", "task1", "gold_sft", "tok_fixed_kl", 1, 10))
                       .read_text())
    assert "kl_target" not in fixed["options"] and set(fixed["curves"]["objective/kl_coef"]) == {None}
    choices = json.loads((results / "choices.json").read_text())
    assert set(choices["settings"]) == {"ppo", "ma_first"} and choices["tok"] == "ppo"
    table = (results / "summary.md").read_text()
    assert "## Tuning" in table and "## Pre-registered decision" in table and "| rloo | 2 |" in table
    assert (results / "paired_differences.png").read_bytes()[:4] == b"\x89PNG"

    before = {f: f.stat().st_mtime_ns for f in files}
    capsys.readouterr()
    assert study.main(arguments) == 0  # resumed: nothing runs again
    out = capsys.readouterr().out
    assert "4 runs, 4 done, 0 to run" in out and "10 runs, 10 done, 0 to run" in out
    assert {f: f.stat().st_mtime_ns for f in files} == before


def test_runs_of_one_build_must_share_their_models(tmp_path):
    _write(tmp_path, ("tuning", "task1", "gold_sft", "ppo+lam1", 0, 0), 0.5)
    _write(tmp_path, ("tuning", "task1", "rm_rm", "ppo+lam1", 0, 1), 0.5)
    _write(tmp_path, ("confirmation", "task1", "gold_sft", "ppo", 1, 10), 0.5, sft_sha256="other")  # another build
    assert len(study.load_results(tmp_path)) == 3
    _write(tmp_path, ("tuning", "task1", "gold_sft", "ppo+lam1", 0, 1), 0.5, sft_sha256="rebuilt")
    with pytest.raises(ValueError, match="different models of task1 build 0"):
        study.load_results(tmp_path)



def test_power_and_what_a_group_excludes():
    """The exact power of the paired t-test against textbook values (n = 10, effect 1 SD, alpha 0.05: 0.803; no
    effect: alpha), the detectable difference as its inverse, and the simultaneous interval as Bonferroni's."""
    assert study.t_test_power(1.0, 1.0, 10, 0.05) == pytest.approx(0.8031, abs=5e-4)
    assert study.t_test_power(0.0, 2.0, 8, 0.05 / 6) == pytest.approx(0.05 / 6, rel=1e-4)
    detectable = study.detectable_difference(2.0, 10, 0.05)  # just under 1 SD, where the power is 0.803
    assert 1.98 < detectable < 2.0 and study.t_test_power(detectable, 2.0, 10, 0.05) == pytest.approx(0.8, abs=1e-6)
    diffs = np.array([0.01, -0.02, 0.03, 0.0, 0.015, -0.005, 0.02, 0.01])
    bounds = study._bounds(diffs, 6)
    low, high = study.paired_t(diffs, 1 - 0.05 / 6)["ci"]
    assert bounds["simultaneous_ci"] == (low, high) and bounds["excluded_beyond"] == max(-low, high)
    assert bounds["detectable"] == pytest.approx(study.detectable_difference(float(diffs.std(ddof=1)), 8, 0.05 / 6))
    assert study.finding(bounds, "no difference detected") == (
        f"no difference detected; differences beyond ±{max(-low, high):.3f} excluded")
    assert study.finding(bounds, "behind") == "behind"
