"""Study III (`benchmarks/credit_segments.py`): the pre-registered design, the tuning rule, the findings, the token
budget's pairing, the refusal of a dirty tree, and the tiny version end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import credit_segments as study  # noqa: E402

CHOICES = {"settings": {"TOK": "lam1", "MA5": "lam0.95", "MA-LP": "threshold0.9", "MC5": "K4"}}


def test_the_design_is_the_pre_registered_one():
    design = study.DESIGN
    tuning = [j for stage in study.tuning_stages(design) for j in stage]
    assert len(tuning) == 48 and {j[2] for j in tuning} == {"gold_sft"} and {(j[4], j[5]) for j in tuning} == {
        (0, 0), (0, 1)}
    assert [s[0][3].split("+")[0] for s in study.tuning_stages(design)] == ["TOK", "MA5", "MA-LP", "MC5"]
    stages = study.confirmation_stages(design)
    assert {j[3] for j in stages[0]} == {"TOK"} and len(stages[0]) == 6 * 12
    assert [{j[4] for j in s} for s in stages[1:4]] == [{1}, {2}, {3}]
    assert sum(len(s) for s in stages[:4]) == 8 * 6 * 12 and len(stages[4]) == 48
    assert {j[3] for j in stages[4]} == {"MC5", "MC-LP"} and stages[4][0][0] == "equal_steps"
    assert study.KL_TARGETS == {("task1_long", "gold_sft"): 4, ("task1_long", "rm_rm"): 10, ("task3", "gold_sft"): 9,
                                ("task3", "rm_rm"): 11, ("task4", "gold_sft"): 8, ("task4", "rm_rm"): 11}
    assert study.TASKS["task4"] == {"num_words": 20, "gold": "decision"} and study.TASKS["task1_long"]["num_words"] == 60
    assert study.MARGINS == {"task1_long": 0.03, "task3": 0.03, "task4": 0.015}
    # every arm's options are PPOConfig's (plug-in option names checked), each sampling 32 responses a step
    from marlhf.trainers.ppo_config import PPOConfig
    for arm in design.arms:
        for setting in study.ARMS[arm].settings or [""]:
            options = study.arm_options(f"{arm}+{setting}" if setting else arm, CHOICES)
            samples = options.get("num_samples_per_prompt", 1)
            PPOConfig(**options, per_device_batch_size=32 // samples, mini_batch_size=16, kl_target=8.0,
                      kl_horizon=160).validate()
    assert study.arm_options("MA-LP", CHOICES)["lam"] == 0.95
    mc_lp = study.arm_options("MC-LP", CHOICES)
    assert mc_lp == {"termination": "low_prob", "termination_options": {"threshold": 0.9, "interval": 1,
                                                                        "min_tokens": None, "max_tokens": None},
                     "advantage": "mc_segment", "advantage_options": {"mc_samples": 4, "max_boundaries": 4}}
    assert study.arm_options("TEMPO", CHOICES)["advantage_options"] == {"normalize_std": True}


def test_the_token_budget_pairs_each_run_with_tok():
    assert study.budget_job(("tuning", "task3", "gold_sft", "MA5+lam1", 0, 1), CHOICES) == (
        "tuning", "task3", "gold_sft", "TOK+lam1", 0, 1)
    assert study.budget_job(("confirmation", "task4", "rm_rm", "MC5", 2, 12), CHOICES) == (
        "confirmation", "task4", "rm_rm", "TOK", 2, 12)
    assert study.budget_job(("confirmation", "task4", "rm_rm", "TOK", 2, 12), CHOICES) is None
    assert study.budget_job(("equal_steps", "task4", "rm_rm", "MC5", 1, 12), CHOICES) is None
    mc = study.job_options(("confirmation", "task3", "rm_rm", "MC-LP", 1, 10), study.DESIGN, CHOICES, 5000)
    assert (mc["min_generated_tokens"], mc["max_generated_tokens"], mc["kl_target"]) == (5000, 5000, 11.0)
    later = study.job_options(("confirmation", "task3", "rm_rm", "GRPO", 1, 10), study.DESIGN, CHOICES, 5000)
    assert later["min_generated_tokens"] == 5000 and "max_generated_tokens" not in later  # and max_steps 50
    tuning = study.job_options(("tuning", "task3", "gold_sft", "MA5+lam1", 0, 0), study.DESIGN, CHOICES, 5000)
    assert tuning["max_generated_tokens"] == 5000 and tuning["lam"] == 1.0
    tok = study.job_options(("confirmation", "task3", "gold_sft", "TOK", 1, 10), study.DESIGN, CHOICES, None)
    assert "min_generated_tokens" not in tok and tok["kl_horizon"] == 160
    assert study.generated_tokens({"curves": {"rollout/tokens": [10, 12], "rollout/mc_tokens": [30, None]}}) == 52


def _run(arm, task, seed, gold, sft=0.1):
    return {"evaluations": [{"step": 50, "budget": False, "gold_reward": gold, "kl": 1.0}],
            "sft_held_out": {"gold_reward": sft}}


def test_the_tuning_rule_takes_the_best_mean_gain_and_the_first_on_ties():
    design = study.DESIGN
    results = {}
    for job in study.tuning_stages(design)[0]:
        gain = {"lam0.95": 0.2, "lam1": 0.3}[job[3].split("+")[1]] if job[1] == "task3" else 0.1
        results[job] = _run(job[3], job[1], job[5], 0.1 + gain)
    assert study.choose(design, results, "TOK") == "lam1"
    for job in study.tuning_stages(design)[1]:
        results[job] = _run(job[3], job[1], job[5], 0.3)  # a tie
    assert study.choices_so_far(design, results)["settings"] == {"TOK": "lam1", "MA5": "lam0.95"}
    del results[study.tuning_stages(design)[1][0]]
    assert study.choose(design, results, "MA5") is None


def test_the_findings():
    base = {"mean": 0.0, "p_holm": 0.5, "tost_ci": (-0.01, 0.02), "simultaneous_ci": (-0.012, 0.025)}
    assert study.finding({**base, "mean": 0.04, "p_holm": 0.01}, 0.03) == "ahead"
    assert study.finding({**base, "mean": -0.04, "p_holm": 0.049}, 0.03) == "behind"
    assert study.finding(base, 0.03) == "equivalent within the margin"
    assert study.finding(base, 0.015) == "no difference detected; differences beyond ±0.025 excluded"
    test = study.paired_test([0.01, -0.02, 0.03, 0.0, 0.01, 0.02, -0.01, 0.0, 0.02, 0.01, 0.0, 0.01], 6)
    assert test["simultaneous_ci"][0] < test["tost_ci"][0] < test["ci"][0]  # 99.2 % > 98.3 % > 95 %


def test_a_dirty_tree_and_results_inside_it_are_refused(tmp_path):
    repo = tmp_path / "code"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    assert study.check_provenance(tmp_path / "results", False, root=repo)["clean"]
    with pytest.raises(SystemExit, match="inside the code's worktree"):
        study.check_provenance(repo / "results", False, root=repo)
    (repo / "b.py").write_text("untracked code counts\n")
    with pytest.raises(SystemExit, match="dirty"):
        study.check_provenance(tmp_path / "results", False, root=repo)
    assert not study.check_provenance(tmp_path / "results", True, root=repo)["clean"]  # --quick runs anyway


def test_summarize_refuses_confirmation_files_of_two_commits(tmp_path):
    for seed, commit in ((10, "a" * 40), (11, "b" * 40)):
        _write(tmp_path, ("confirmation", "task4", "gold_sft", "TOK", 1, seed), commit)
    with pytest.raises(SystemExit, match="more than one commit"):
        study.summarize(study.DESIGN, tmp_path)


def test_summarize_refuses_confirmation_files_of_another_commit_than_the_tuning_files(tmp_path):
    """Amendment 1: every run of the study, tuning and confirmation, from one commit."""
    for job, commit in ((("tuning", "task4", "gold_sft", "TOK+lam1", 0, 0), "a" * 40),
                        (("confirmation", "task4", "gold_sft", "TOK", 1, 10), "b" * 40)):
        _write(tmp_path, job, commit)
    with pytest.raises(SystemExit, match="the tuning files from"):
        study.load_results(tmp_path)


def _write(results: Path, job: tuple, commit: str, clean: bool = True) -> None:
    path = study.result_path(results, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"phase": job[0], "task": job[1], "setup": job[2], "arm": job[3], "build": job[4],
                                "seed": job[5], "commit": commit, "clean": clean}))


def test_exploratory_files_come_from_one_later_commit_of_a_clean_tree(tmp_path):
    """Amendment 1: the exploratory arm runs from a later commit than the study's, in a directory of its own."""
    _write(tmp_path, ("tuning", "task4", "gold_sft", "TOK+lam1", 0, 0), "a" * 40)
    _write(tmp_path, ("confirmation", "task4", "gold_sft", "TOK", 1, 10), "a" * 40)
    _write(tmp_path, ("exploratory", "task4", "gold_sft", "MC5", 1, 10), "b" * 40)
    assert len(study.load_results(tmp_path)) == 3
    _write(tmp_path, ("exploratory", "task4", "gold_sft", "MC5", 1, 11), "c" * 40)
    with pytest.raises(SystemExit, match="exploratory result files must come from one commit"):
        study.load_results(tmp_path)


def test_the_exploratory_runs_wait_for_every_confirmation_run_and_plan_their_own_steps(tmp_path):
    _write(tmp_path, ("confirmation", "task4", "gold_sft", "TOK", 1, 10), "a" * 40)
    with pytest.raises(SystemExit, match="after every confirmation run: 575 of 576 are missing"):
        study.run_exploratory(study.DESIGN, tmp_path / "work", tmp_path, 1, None)
    jobs = study.exploratory_jobs(study.DESIGN)
    assert len(jobs) == 24 and {j[3] for j in jobs} == {"MC5"} and {j[4] for j in jobs} == {1}
    job = ("exploratory", "task3", "rm_rm", "MC5", 1, 12)
    results = {("confirmation", "task3", "rm_rm", "MC5", 1, 12): {"curves": _curves([9] * 8, [0.05] * 8, [5] * 8)}}
    assert study.own_steps(job, results) == 8
    options = study.job_options(job, study.DESIGN, CHOICES, 1000, study.own_steps(job, results))
    assert options["max_steps"] == 8 and options["max_generated_tokens"] == options["min_generated_tokens"] == 1000
    assert options["advantage"] == "mc_segment" and options["advantage_options"]["mc_samples"] == 4  # CHOICES' K4


def _curves(lengths, coefs, tokens, mc=None):
    return {"objective/response_length": lengths, "objective/kl_coef": coefs, "rollout/tokens": tokens,
            "rollout/mc_tokens": mc or [None] * len(tokens)}


def test_the_schedule_audit_reads_steps_overshoot_continuations_and_learning_rate():
    assert study.learning_rate_multiplier(0, 50) == 0.0 and study.learning_rate_multiplier(5, 50) == 1.0
    assert study.learning_rate_multiplier(50, 50) == study.learning_rate_multiplier(70, 50) == 0.0  # held at 0
    mc = {"budget": 100, "curves": _curves([10] * 8, [0.05] * 8, [5] * 8, [10] * 8),  # 120 tokens, 8 steps
          "evaluations": [{"step": 8, "budget": True, "generated_tokens": 120}]}
    late = {"budget": 100, "curves": _curves([10] * 60, [0.05] * 60, [2] * 60),  # 60 steps: 10 past the plan
            "evaluations": [{"step": 50, "budget": False, "generated_tokens": 100 - 10},
                            {"step": 55, "budget": True, "generated_tokens": 110},
                            {"step": 60, "budget": False, "generated_tokens": 120}]}
    results = {("confirmation", "task3", "gold_sft", "MC5", 1, 10): mc,
               ("confirmation", "task3", "gold_sft", "GRPO", 1, 10): late}
    audit = study.schedules(study.DESIGN, results)
    assert audit["MC5"]["steps"]["mean"] == 8 and audit["MC5"]["over_budget"]["mean"] == pytest.approx(0.2)
    assert audit["GRPO"]["steps"]["mean"] == 55 and audit["GRPO"]["run_steps"]["mean"] == 60
    assert audit["GRPO"]["over_budget"]["mean"] == pytest.approx(0.1)
    assert audit["MC5"]["mc_share"]["mean"] == pytest.approx(80 / 120)
    assert audit["MC5"]["warmup_share"]["mean"] == pytest.approx(5 / 8)
    assert audit["MC5"]["last_learning_rate"]["mean"] == pytest.approx(study.learning_rate_multiplier(7, 50))
    assert audit["GRPO"]["frozen_steps"]["max"] == 5 and audit["GRPO"]["last_learning_rate"]["max"] == 0.0


def test_a_collapsed_run_is_listed_with_its_kl_coefficient():
    healthy = {"curves": _curves([100] * 10, [0.05] * 10, [1] * 10), "run_seconds": 1.0,
               "evaluations": [{"step": 10, "budget": False, "gold_reward": 0.3}]}
    shrunk = {"curves": {**_curves([180, 150] + [10] * 58, [0.24] + [1e3] * 58 + [7.8e7], [1] * 60),
                         "time/step_seconds": [1.0] * 50 + [2.0] * 10},  # 10 steps past the 50-step plan
              "run_seconds": 70.0, "evaluations": [{"step": 60, "budget": True, "gold_reward": 0.017}]}
    found = study.collapsed(study.DESIGN, {("tuning", "task1_long", "gold_sft", "MA-LP+threshold0.5", 0, 1): shrunk,
                                           ("tuning", "task1_long", "gold_sft", "MA-LP+threshold0.5", 0, 0): healthy})
    assert [c["run"] for c in found] == ["tuning/task1_long/gold_sft/MA-LP+threshold0.5/0/1"]
    assert found[0]["kl_coef_max"] == 7.8e7 and found[0]["gold"] == 0.017
    assert found[0]["frozen_steps"] == 10 and found[0]["frozen_seconds"] == 20.0


@pytest.mark.slow  # a whole tiny study: `pytest -m slow` (CI runs it)
def test_the_tiny_study_end_to_end(tmp_path):
    """--quick: tuning stage by stage, choices.json, TOK, the other arms at TOK's budget, the equal-steps runs,
    the summary; a second call runs nothing."""
    args = ["--quick", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "results")]
    assert study.main(args) == 0
    results = tmp_path / "results"
    choices = json.loads((results / "choices.json").read_text())
    assert set(choices["settings"]) == {"TOK", "MA5", "MA-LP", "MC5"}
    files = sorted(results.glob("*/*/*/*/build*-seed*.json"))
    assert len(files) == 8 + 2 + 3 * 2 + 2
    runs = {(r["phase"], r["arm"], r["seed"]): r for r in map(lambda p: json.loads(p.read_text()), files)}
    tok = runs[("confirmation", "TOK", 10)]
    assert tok["budget"] is None and [e["step"] for e in tok["evaluations"]] == [2, 3]
    mc = runs[("confirmation", "MC-LP", 10)]
    assert mc["budget"] == tok["generated_tokens"] and mc["generated_tokens"] >= mc["budget"]
    assert mc["curves"]["rollout/generated_tokens"][-2] < mc["budget"] if len(mc["steps"]) > 1 else True
    assert study.at_budget(mc)["step"] == mc["steps"][-1] and sum(mc["curves"]["rollout/mc_tokens"]) > 0
    grpo = runs[("confirmation", "GRPO", 10)]
    assert grpo["steps"][-1] >= 3 and study.at_step(grpo, 3) is not None  # to the later of the budget and step 3
    assert "right_of_found" in tok["evaluations"][-1] and tok["commit"] and "clean" in tok
    assert (results / "summary.md").exists() and (results / "paired_differences.png").exists()
    assert study.main(args) == 0 and len(sorted(results.glob("*/*/*/*/build*-seed*.json"))) == len(files)
    assert study.main([*args, "--exploratory"]) == 0  # amendment 1's exploratory arm, after the confirmation
    for seed in (10, 11):
        own = json.loads(study.result_path(results, ("exploratory", "task4", "gold_sft", "MC-LP", 1, seed)).read_text())
        confirmation = runs[("confirmation", "MC-LP", seed)]
        assert own["options"]["max_steps"] == len(confirmation["curves"]["rollout/tokens"])
        assert own["budget"] == runs[("confirmation", "TOK", seed)]["generated_tokens"]
    summary = (results / "summary.md").read_bytes()
    assert b"## Exploratory, never decided on: MC-LP" in summary
    assert study.main(["--quick", "--summarize", "--results", str(results)]) == 0
    assert (results / "summary.md").read_bytes() == summary  # regenerated byte for byte from the files


def _timed(started: str, finished: str) -> dict:
    return {"started": f"2026-12-07T{started}+00:00", "finished": f"2026-12-07T{finished}+00:00"}


def test_the_budget_clock_charges_superseded_runs():
    """Amendment 2: runs moved to superseded/ are not used but their time stays charged."""
    results = {("confirmation", "task3", "gold_sft", "TOK", 1, 10): _timed("10:00:00", "11:00:00")}
    superseded = {("confirmation", "task3", "gold_sft", "TOK", 1, 10): _timed("08:00:00", "09:00:00")}
    clock = study.wall_time(results, superseded)
    assert clock["hours"] == pytest.approx(1.0) and clock["superseded_hours"] == pytest.approx(0.5)
    assert clock["span_hours"] == pytest.approx(2.0)
    assert study.wall_time(results)["hours"] == pytest.approx(0.5)


def _side_file(path: Path, sft: str, builds: tuple[str, ...] = ("task3/build1",)) -> None:
    cost = {"forward_tokens_per_rollout_token": 30.0, "forward_tokens_per_budget_token": 5.0,
            "parts": {"mc_prefix_reencoding": {"tokens": 20}}, "forward": {"tokens": 100}}
    setup = {"boundaries": {"responses": 64, "low_prob_segments_before_keeping": {"mean": 40.0},
                            "overlap_without_token0": {"share_identical": 0.2, "mean_distance": 1.5}},
             "cost": {"MC5": cost}}
    path.write_text(json.dumps({"commit": "c" * 40, "clean": True, "builds": {
        b: {"sft_sha256": sft, "reward_sha256": "r", "setups": {"gold_sft": setup}} for b in builds}}))


def test_the_side_measurement_is_read_only_from_the_studys_models(tmp_path):
    results = {("confirmation", "task3", "gold_sft", "TOK", 1, 10): {"task": "task3", "build": 1,
                                                                     "sft_sha256": "s", "reward_sha256": "r"}}
    _side_file(tmp_path / "side_measurements.json", "s")
    side = study.side_measurements(tmp_path, results)
    assert side["boundaries"]["task3/build1"]["share_identical"] == 0.2
    assert side["forward"]["MC5"]["task3/build1"]["prefix_reencoding_share"] == pytest.approx(0.2)
    _side_file(tmp_path / "side_build1_again.json", "s")
    with pytest.raises(SystemExit, match="two side files"):
        study.side_measurements(tmp_path, results)
    (tmp_path / "side_build1_again.json").unlink()
    _side_file(tmp_path / "side_measurements.json", "other")
    with pytest.raises(SystemExit, match="other models than the study's"):
        study.side_measurements(tmp_path, results)


def test_a_finding_reached_inside_the_schedule_says_it_may_be_the_schedules():
    table = {"MC5": {"task3/gold_sft": {"budget_step": 8.0}, "task4/gold_sft": {"budget_step": 6.5}},
             "MA5": {"task3/gold_sft": {"budget_step": 50.0}, "task4/gold_sft": {"budget_step": 57.0}},
             "GRPO": {"task3/gold_sft": {"budget_step": 50.0}}}
    lines = study.schedule_notes(table, study.DESIGN)
    assert study.warmup_steps(study.DESIGN) == 5
    assert any(line.startswith("- MC5 reached the budget at steps 6.5-8.0 (group means) of a 50-step plan") for line in lines)
    assert any(line.startswith("- MA5 reached the budget only after step 50") and "57.0" in line for line in lines)
    assert not any("GRPO" in line for line in lines)


def test_the_decision_rule_reads_the_findings():
    def entries(*findings, n=12):
        return {f"group{i}": {"finding": f, "n": n} for i, f in enumerate(findings)}
    excluded = "no difference detected; differences beyond ±0.040 excluded"
    table = {"MC5": entries("ahead", "ahead", "ahead", "equivalent within the margin", excluded, excluded),
             "MA5": entries("ahead", "ahead", "ahead", "behind", excluded, excluded),
             "TEMPO": entries(*[excluded] * 6)}
    rule = study.decision(study.DESIGN, table)
    assert rule["complete"] and rule["arms"]["MC5"]["recommended"] and not rule["arms"]["MA5"]["recommended"]
    assert rule["arms"]["MC5"]["equivalent"] == ["group3"]
    assert rule["arms"]["TEMPO"]["excluded"]["group0"] == "differences beyond ±0.040 excluded"
    assert not rule["no_segment_value_arm_ahead"]  # MC5 is ahead somewhere
    rule = study.decision(study.DESIGN, {"MA5": table["MA5"], "TEMPO": entries(*[excluded] * 5, "ahead", n=11)})
    assert rule["no_segment_value_arm_ahead"] is False and not rule["complete"]
    rule = study.decision(study.DESIGN, {"MA5": table["MA5"], "TEMPO": table["TEMPO"]})
    assert rule["no_segment_value_arm_ahead"] and rule["complete"]
    assert "segment-level values bought nothing" in "\n".join(study.decision_lines(rule))
    provisional = study.decision(study.DESIGN, {"MC5": entries("ahead", n=3)})
    assert "Provisional" in "\n".join(study.decision_lines(provisional))


def test_a_runs_forward_tokens_are_estimated_from_its_task_and_builds_side_ratio():
    def run(task, build, tokens):
        return {"task": task, "build": build, "generated_tokens": tokens, "run_seconds": 1.0,
                "curves": {"rollout/tokens": [tokens], "rollout/mc_tokens": [None], "time/generation": [1.0],
                           "time/advantages": [1.0], "time/step_seconds": [0.25, 0.5]}}
    results = {("confirmation", "task3", "gold_sft", "TOK", 2, 10): run("task3", 2, 100),
               ("confirmation", "task3", "rm_rm", "TOK", 2, 10): run("task3", 2, 300),
               ("confirmation", "task4", "gold_sft", "TOK", 1, 10): run("task4", 1, 1000)}  # build 1 not measured
    side = {"forward": {"TOK": {"task3/build2": {"per_budget_token": 9.0}}}}
    cost = study.costs(study.DESIGN, results, side)["TOK"]
    assert cost["forward_tokens_estimate"] == pytest.approx(9.0 * 200) and cost["forward_estimate_runs"] == 2
    assert cost["step_seconds"] == 0.75 and cost["run_seconds"] == 1.0 and cost["step_seconds_vs_tok"] == 1.0
    mc5 = {**run("task3", 2, 100), "curves": {**run("task3", 2, 100)["curves"], "time/step_seconds": [3.0]}}
    paired = study.costs(study.DESIGN, {**results, ("confirmation", "task3", "gold_sft", "MC5", 2, 10): mc5,
                                        ("confirmation", "task3", "gold_sft", "MC5", 3, 10): mc5})  # build 3: no TOK
    assert paired["MC5"]["step_seconds_vs_tok"] == pytest.approx(4.0) and paired["MC5"]["runs"] == 2
    assert math.isnan(study.costs(study.DESIGN, results)["TOK"]["forward_tokens_estimate"])


def test_task4s_clue_share_is_nan_without_a_warning_where_no_run_found_a_clue_word():
    import warnings

    def run(found, right):
        return {"evaluations": [{"step": 50, "budget": False, "clue_words_of_found": found, "right_of_found": right}]}
    results = {("confirmation", "task4", "gold_sft", "TOK", 1, 10): run(0, 0),
               ("confirmation", "task4", "rm_rm", "TOK", 1, 10): run(4, 3),
               ("confirmation", "task4", "rm_rm", "TOK", 1, 11): run(0, 0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shares = study.clue_shares(study.DESIGN, results)
    assert math.isnan(shares["task4/gold_sft/TOK"]) and shares["task4/rm_rm/TOK"] == 0.75
