"""Study III: what segments buy beyond a lambda. Segment-level values and boundaries against tuned token-level PPO
at an equal budget of generated tokens.

    python benchmarks/credit_segments.py --work W --results R   # tuning, choices.json, then confirmation and the
                                                                # equal-steps secondary (resumes where it stopped)
    python benchmarks/credit_segments.py --max_runs 20 ...      # part of it, in several sittings
    python benchmarks/credit_segments.py --summarize --results R  # tables and figures from the result files only
    python benchmarks/credit_segments.py --quick --work W --results R   # the tiny version (the test's)
    python benchmarks/credit_segments.py --exploratory --work W --results R  # amendment 1's exploratory arm, last

The design is pre-registered in benchmarks/results/credit_segments/README.md (design commit c8158f4; also
docs/studies/segments.md) and fixed here in `DESIGN`, `ARMS`, `KL_TARGETS` and `MARGINS`. In short: tasks task1_long,
task3 and task4 (the demo's, at their defaults) x set-ups gold_sft and rm_rm; builds (the demo's task_seed 1234 + b):
tuning on build 0 (seeds 0, 1, gold_sft only), confirmation on builds 1-3 x seeds 10-13; arms TOK, MA5, MA-LP, MC5,
MC-LP, TEMPO, GRPO, RLOO, each sampling 32 responses a step; every run adapts its KL coefficient from 0.05 towards its
group's target (horizon 160 responses).

The budget of generated tokens (the primary endpoint): a run of an arm other than TOK is paired with TOK's run of the
same task, set-up, build and seed (TOK's chosen setting in tuning), which trains 50 steps; its budget is the tokens
that run generated (every sampled response token, Monte-Carlo continuations included: the sums of the trainer's
per-step rollout/tokens and rollout/mc_tokens). The trainer stops on it (PPOConfig.max_generated_tokens, and
min_generated_tokens to go on past max_steps): the Monte-Carlo arms and every tuning run end at the first step whose
tokens so far reach it; the other confirmation arms run to whichever comes later, that step or step 50. The policy is
evaluated on the held-out prompts (the demo's 128, one sample each, as its final evaluation) every 10 steps, at the
budget step and at the end (train_ppo's `after_step` hook; the random states are kept, so evaluating does not change
the run), each evaluation with Task 4's decision shares (benchmarks/task4_learnable.py).

Provenance: every result file records the commit of the code (`git rev-parse HEAD` of this file's worktree) and
whether that worktree was clean: `git status --porcelain` empty, untracked files included. Result files are
therefore written outside the code's worktree (`--results` in another git worktree, where they are committed): the
runner refuses a results directory inside the code's worktree and a dirty code worktree for every run but --quick's,
and `--summarize` refuses confirmation files of more than one commit.

Each finished run writes RESULTS/<phase>/<task>/<setup>/<arm>/build<b>-seed<s>.json and is never run again (phases:
tuning, confirmation, equal_steps); models and run directories live in WORK (not committed). Two runs at a time
(`--workers`), each in its own process with one torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import credit_assignment as study_one  # noqa: E402  (run machinery, set-ups, result writer, process pool)
import credit_assignment_lambda as study_two  # noqa: E402  (t-interval bounds, formatting, result loading)
import task4_learnable  # noqa: E402  (Task 4's decision shares: does the policy read the clue?)

from marlhf.evaluation.stats import holm, paired_t  # noqa: E402

ROOT = Path(__file__).resolve().parent
DEFAULT_RESULTS = ROOT / "results" / "credit_segments"
SETUPS = study_one.SETUPS  # gold_sft: 4 x gold, critic from SFT; rm_rm: reward model, critic from it
TASKS = {"task1_long": study_one.TASKS["task1_long"], "task3": study_two.TASKS["task3"],
         "task4": {"num_words": 20, "gold": "decision"}}  # the demo's decision_rate 0.3 and clue_words 4
FIRST_TASK_SEED = 1234  # build b is task_seed 1234 + b
KL_TARGETS = {("task1_long", "gold_sft"): 4.0, ("task1_long", "rm_rm"): 10.0, ("task3", "gold_sft"): 9.0,
              ("task3", "rm_rm"): 11.0, ("task4", "gold_sft"): 8.0, ("task4", "rm_rm"): 11.0}
KL_HORIZON = 160  # responses
STEPS = 50  # TOK's run, and the equal-steps secondary
EVAL_EVERY = 10  # steps between held-out evaluations (the matched-KL secondary)
MARGINS = {"task1_long": 0.03, "task3": 0.03, "task4": 0.015}  # equivalence margins, each task's gold scale
ALPHA = 0.05
DESIGN_COMMIT = "c8158f4"
AMENDMENT_COMMIT = "a9fe393"  # amendment 1: the budget below, and cut 1 (no equal-steps secondary)
AMENDMENT_2_COMMIT = "0f4d00d"  # amendment 2: one set of models per build, kept; TOK on build 1 run again
BUDGET_HOURS = 28.0  # amendment 1 (the design's 12 h), tuning included, by `wall_time`'s clock
SUPERSEDED = "superseded"  # amendment 2: TOK's first build-1 runs, on models no longer kept
SIDE = "side"  # benchmarks/credit_segments_side.py's files
EXPLORATORY = "exploratory"  # amendment 1's exploratory phase: a later commit, its own directory, never decided on

TOKEN = {"termination": "fixed", "ngram": 1}
FIXED5 = {"termination": "fixed", "ngram": 5}
GROUP = {**TOKEN, "num_samples_per_prompt": 4}  # critic-free group arms: 8 prompts x 4 samples


def low_prob(threshold: float) -> dict:
    """MA-LP's boundaries: a macro action starts at every token sampled with probability below `threshold`
    (interval 1, no min/max)."""
    return {"termination": "low_prob",
            "termination_options": {"threshold": threshold, "interval": 1, "min_tokens": None, "max_tokens": None}}


def mc_segment(samples: int) -> dict:
    return {"advantage": "mc_segment", "advantage_options": {"mc_samples": samples, "max_boundaries": 4}}


@dataclasses.dataclass(frozen=True)
class Arm:
    """An arm: its PPOConfig options, or its settings tuned on build 0 ({setting: options}, the first listed wins
    ties), and whether it makes Monte-Carlo continuations (MA-LP and MC-LP take other arms' choices: arm_options)."""
    options: dict | None = None
    settings: dict | None = None
    monte_carlo: bool = False


ARMS = {
    "TOK": Arm(settings={"lam0.95": {**TOKEN, "lam": 0.95}, "lam1": {**TOKEN, "lam": 1.0}}),
    "MA5": Arm(settings={"lam0.95": {**FIXED5, "value_weighting": "first", "lam": 0.95},
                         "lam1": {**FIXED5, "value_weighting": "first", "lam": 1.0}}),
    "MA-LP": Arm(settings={"threshold0.5": {**low_prob(0.5), "value_weighting": "first"},  # lam: MA5's
                           "threshold0.9": {**low_prob(0.9), "value_weighting": "first"}}),
    "MC5": Arm(settings={"K2": {**FIXED5, **mc_segment(2)}, "K4": {**FIXED5, **mc_segment(4)}}, monte_carlo=True),
    "MC-LP": Arm(options={}, monte_carlo=True),  # MA-LP's threshold, MC5's K
    "TEMPO": Arm(options={**GROUP, "advantage": "prefix_tree", "advantage_options": {"normalize_std": True}}),
    "GRPO": Arm(options={**GROUP, "advantage": "grpo", "grpo_normalize_std": True}),
    "RLOO": Arm(options={**GROUP, "advantage": "rloo"}),
}
TUNED = ("TOK", "MA5", "MA-LP", "MC5")  # in the tuning's order
MC_ARMS = tuple(a for a, arm in ARMS.items() if arm.monte_carlo)


@dataclasses.dataclass(frozen=True)
class Design:
    tasks: tuple[str, ...]
    setups: tuple[str, ...]
    tuning_setups: tuple[str, ...]
    tuning_builds: tuple[int, ...]
    tuning_seeds: tuple[int, ...]
    confirmation_builds: tuple[int, ...]
    confirmation_seeds: tuple[int, ...]
    arms: tuple[str, ...]
    equal_steps_builds: tuple[int, ...]  # the Monte-Carlo arms' 50-step secondary
    exploratory_arm: str = "MC5"  # amendment 1's exploratory arm: its schedule planned over its own steps
    exploratory_builds: tuple[int, ...] = (1,)
    steps: int = STEPS
    eval_every: int = EVAL_EVERY
    quick: bool = False


DESIGN = Design(tasks=tuple(TASKS), setups=tuple(SETUPS), tuning_setups=("gold_sft",), tuning_builds=(0,),
                tuning_seeds=(0, 1), confirmation_builds=(1, 2, 3), confirmation_seeds=(10, 11, 12, 13),
                arms=tuple(ARMS), equal_steps_builds=(1,))
# Seconds per run at the tiny sizes (3 steps of 8 responses): the whole tuning, then one arm of each kind (a macro
# action arm, a Monte-Carlo one on tuned boundaries, a group one) on 2 seeds, and the equal-steps phase.
QUICK_DESIGN = Design(tasks=("task4",), setups=("gold_sft",), tuning_setups=("gold_sft",), tuning_builds=(0,),
                      tuning_seeds=(0,), confirmation_builds=(1,), confirmation_seeds=(10, 11),
                      arms=("TOK", "MA5", "MC-LP", "GRPO"), equal_steps_builds=(1,), exploratory_arm="MC-LP",
                      steps=3, eval_every=2, quick=True)


# ---------------------------------------------------------------------------------------------- jobs
def tuning_stages(design: Design) -> list[list[tuple]]:
    """The tuning runs (phase, task, setup, arm+setting, build, seed) in the README's order, one stage per tuned
    arm: TOK first (its budget pairs the others'), then MA5, MA-LP (at MA5's lam) and MC5."""
    return [[("tuning", task, setup, f"{arm}+{setting}", build, seed) for seed in design.tuning_seeds
             for build in design.tuning_builds for task in design.tasks for setup in design.tuning_setups
             for setting in ARMS[arm].settings] for arm in TUNED]


def confirmation_stages(design: Design) -> list[list[tuple]]:
    """TOK's runs first (every other run's budget); then build by build all arms and groups; then the Monte-Carlo
    arms' equal-steps secondary."""
    def jobs(phase, builds, arms):
        return [(phase, task, setup, arm, build, seed) for build in builds for seed in design.confirmation_seeds
                for task in design.tasks for setup in design.setups for arm in arms]

    others = [a for a in design.arms if a != "TOK"]
    return [jobs("confirmation", design.confirmation_builds, ["TOK"]),
            *[jobs("confirmation", [b], others) for b in design.confirmation_builds],
            jobs("equal_steps", design.equal_steps_builds, [a for a in design.arms if a in MC_ARMS])]


def exploratory_jobs(design: Design) -> list[tuple]:
    """Amendment 1's exploratory runs (never decided on, after every confirmation run): the exploratory arm on its
    builds, every group and confirmation seed, each paired with the confirmation's TOK run and budget."""
    return [(EXPLORATORY, task, setup, design.exploratory_arm, build, seed) for build in design.exploratory_builds
            for seed in design.confirmation_seeds for task in design.tasks for setup in design.setups]


def own_steps(job: tuple, results: dict) -> int:
    """An exploratory run's planned steps: the steps its arm's confirmation run of the same group, build and seed
    took to reach TOK's budget (a run that needs more goes on at the schedule's last learning rate, 0)."""
    return len(results[("confirmation", *job[1:])]["curves"]["rollout/tokens"])


def result_path(results: Path, job: tuple) -> Path:
    phase, task, setup, arm, build, seed = job
    return results / phase / task / setup / arm / f"build{build}-seed{seed}.json"


def budget_job(job: tuple, choices: dict | None) -> tuple | None:
    """The TOK run whose generated tokens are `job`'s budget (None: no budget, TOK's own runs and the equal-steps
    secondary). In tuning, TOK's chosen setting's run of the same task and seed."""
    phase, task, setup, arm, build, seed = job
    if arm.startswith("TOK") or phase == "equal_steps":
        return None
    if phase == "tuning":
        return ("tuning", task, setup, f"TOK+{choices['settings']['TOK']}", build, seed)
    return ("confirmation", task, setup, "TOK", build, seed)


def arm_options(arm: str, choices: dict | None) -> dict:
    """PPOConfig options of an arm (`arm` or `arm+setting` in tuning) under the tuning's choices."""
    name, _, setting = arm.partition("+")
    spec = ARMS[name]
    if spec.settings is not None:
        options = dict(spec.settings[setting or choices["settings"][name]])
    else:
        options = dict(spec.options)
    if name == "MA-LP":
        options["lam"] = ARMS["MA5"].settings[choices["settings"]["MA5"]]["lam"]
    if name == "MC-LP":
        threshold = ARMS["MA-LP"].settings[choices["settings"]["MA-LP"]]["termination_options"]["threshold"]
        mc = {k: v for k, v in ARMS["MC5"].settings[choices["settings"]["MC5"]].items() if k not in FIXED5}
        options = {**low_prob(threshold), **mc}
    return options


def job_options(job: tuple, design: Design, choices: dict | None, budget: int | None,
                planned_steps: int | None = None) -> dict:
    """The run's PPOConfig options: its arm's, the adaptive KL controller, and the token budget: the Monte-Carlo arms
    and tuning runs end at the step that reaches it, the other confirmation arms at that step or step 50, whichever
    comes later. `planned_steps` (exploratory runs): the learning-rate schedule's plan instead of 50 steps."""
    phase, task, setup, arm, _, _ = job
    options = {**arm_options(arm, choices), "kl_target": KL_TARGETS[(task, setup)], "kl_horizon": KL_HORIZON}
    if planned_steps is not None:
        options["max_steps"] = planned_steps
    if budget is not None:
        options["min_generated_tokens"] = budget
        if phase == "tuning" or arm.partition("+")[0] in MC_ARMS:
            options["max_generated_tokens"] = budget
    return options


def generated_tokens(result: dict) -> int:
    """The tokens a run generated: its rollouts' and Monte-Carlo continuations', summed over its steps."""
    curves = result["curves"]
    return int(sum(curves["rollout/tokens"]) + sum(x or 0 for x in curves.get("rollout/mc_tokens") or []))


# ---------------------------------------------------------------------------------------------- provenance
def git_state(root: Path = ROOT) -> dict:
    """The commit of the code and whether its worktree is clean: `git status --porcelain` empty, untracked files
    included (result files are written in another worktree, so they never count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "clean": git("status", "--porcelain", "--untracked-files=all") == ""}


def check_provenance(results: Path, quick: bool, root: Path = ROOT) -> dict:
    """Refuse (SystemExit, one line) a results directory inside the code's worktree and a dirty code worktree, but
    for --quick; return the git state."""
    state = git_state(root)
    if quick:
        return state
    top = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()).resolve()
    if results.resolve().is_relative_to(top):
        raise SystemExit(f"--results {results} is inside the code's worktree {top}: its result files would make the "
                         "tree dirty; write them into another worktree (git worktree add) and commit them there")
    if not state["clean"]:
        raise SystemExit(f"the code's worktree {top} is dirty (git status --porcelain, untracked files included): "
                         "commit or remove the changes first; runs record the commit of the code that made them")
    return state


# ---------------------------------------------------------------------------------------------- one run
def run_job(job: tuple, options: dict, budget: int | None, work: str, results: str, design: Design) -> str:
    """One run in its own process with one torch thread: evaluated on the held-out prompts every `eval_every`
    steps, at the budget step and at the end; writes its result file."""
    phase, task, setup, arm, build, seed = job
    state = git_state()
    if not design.quick and not state["clean"]:
        raise RuntimeError("the code's worktree is dirty: no run is made from uncommitted code")
    config = study_one.demo_config(task, setup, design.quick, tasks=TASKS, task_seed=FIRST_TASK_SEED + build)
    evaluations: list[dict] = []

    def evaluator(models, eval_prompts):
        from marlhf.demo.pipeline import evaluate_policy

        def after_step(done: int, policy, tokens: int | None) -> None:
            at_budget = budget is not None and tokens >= budget and not any(e["budget"] for e in evaluations)
            if done % design.eval_every and not at_budget and done != design.steps:
                return
            metrics, samples = evaluate_policy(policy, models.sft, models.reward_model, models.tokenizer, models.task,
                                               eval_prompts, seed=seed)  # as the demo's final evaluation
            if models.task.config.gold == "decision":
                metrics.update(task4_learnable.decision_shares(models.task, samples))
            evaluations.append({"step": done, "generated_tokens": tokens, "budget": at_budget, **metrics})
        return after_step

    started = datetime.now(timezone.utc)
    result = study_one.execute_run(config, Path(work) / "models" / task / f"build{build}", f"{task}/build{build}",
                                   options, seed, Path(work) / "runs" / Path(*map(str, job)), arm,
                                   curve_keys=("rollout/tokens", "rollout/mc_tokens", "rollout/generated_tokens",
                                               "time/generation", "time/advantages", "time/step_seconds"),
                                   after_step=evaluator)
    result = {"phase": phase, "task": task, "setup": setup, "arm": arm, "build": build, "seed": seed,
              "task_options": TASKS[task], "setup_options": SETUPS[setup], **state, "quick": design.quick,
              "budget": budget, "evaluations": evaluations, "started": started.isoformat(),
              "finished": datetime.now(timezone.utc).isoformat(), **result}
    result["generated_tokens"] = generated_tokens(result)
    return str(study_one.write_result(result_path(Path(results), job), result))


# ---------------------------------------------------------------------------------------------- endpoints
def at_budget(result: dict) -> dict:
    """The evaluation of the primary endpoint: at the budget step (TOK and the equal-steps runs: the last)."""
    marked = [e for e in result["evaluations"] if e["budget"]]
    return marked[0] if marked else result["evaluations"][-1]


def at_step(result: dict, step: int) -> dict | None:
    return next((e for e in result["evaluations"] if e["step"] == step), None)


def at_kl(result: dict, kl: float) -> dict:
    """The evaluation closest in held-out KL to `kl` (ties: the earliest)."""
    return min(result["evaluations"], key=lambda e: (abs(e["kl"] - kl), e["step"]))


def right_clue_share(evaluation: dict) -> float:
    """Task 4: right clue words among the clue words after markers (nan where there are none)."""
    clue = evaluation.get("clue_words_of_found", math.nan)
    return evaluation["right_of_found"] / clue if clue and not math.isnan(clue) else math.nan


# ---------------------------------------------------------------------------------------------- tuning rule
def _gain(result: dict, evaluation: dict) -> float:
    return evaluation["gold_reward"] - result["sft_held_out"]["gold_reward"]


def choose(design: Design, results: dict, arm: str) -> str | None:
    """The tuning rule for one arm: the setting with the highest mean over the tasks of (final held-out gold -
    SFT's held-out gold), each task the mean over its seeds; ties to the first listed. None until all are in."""
    stage = tuning_stages(design)[TUNED.index(arm)]
    if any(job not in results for job in stage):
        return None
    scores = tuning_scores(design, results, arm)
    settings = list(ARMS[arm].settings)
    return max(settings, key=lambda s: (scores[s], -settings.index(s)))


def tuning_scores(design: Design, results: dict, arm: str) -> dict[str, float]:
    stage = tuning_stages(design)[TUNED.index(arm)]
    scores = {}
    for setting in ARMS[arm].settings:
        per_task = [[_gain(results[j], at_budget(results[j])) for j in stage
                     if j[3] == f"{arm}+{setting}" and j[1] == task and j in results] for task in design.tasks]
        scores[setting] = float(np.mean([np.mean(t) for t in per_task])) if all(per_task) else math.nan
    return scores


def choices_so_far(design: Design, results: dict) -> dict:
    """{"settings": {arm: setting}} of the tuned arms whose stage is complete, with their scores."""
    settings = {}
    for arm in TUNED:
        chosen = choose(design, results, arm)
        if chosen is None:
            break
        settings[arm] = chosen
    return {"settings": settings, "scores": {arm: tuning_scores(design, results, arm) for arm in settings}}


def record_choices(results: Path, choices: dict) -> None:
    """choices.json, written once before the first confirmation run; later it must agree with the tuning files."""
    path = results / "choices.json"
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded["settings"] != choices["settings"]:
            raise SystemExit(f"{path} disagrees with the tuning results: {recorded['settings']} vs {choices['settings']}")
        return
    path.write_text(json.dumps(choices, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- statistics
def finding(test: dict, margin: float) -> str:
    """Exactly one of the README's findings from a group's paired test (p_holm, mean, tost_ci, simultaneous_ci)."""
    p, mean = test["p_holm"], test["mean"]
    if not math.isnan(p) and p < ALPHA:
        return "ahead" if mean > 0 else "behind"
    low, high = test["tost_ci"]
    if not math.isnan(low) and -margin < low and high < margin:
        return "equivalent within the margin"
    low, high = test["simultaneous_ci"]
    return f"no difference detected; differences beyond ±{max(abs(low), abs(high)):.3f} excluded"


def paired_test(diffs: list[float], groups: int) -> dict:
    """Mean and 95 % t-interval and p of paired differences, the TOST interval (1 - 2 alpha / groups) and the
    simultaneous 95 % interval (1 - alpha / groups)."""
    test = paired_t(diffs)
    test["tost_ci"] = paired_t(diffs, 1 - 2 * ALPHA / groups)["ci"]
    test["simultaneous_ci"] = paired_t(diffs, 1 - ALPHA / groups)["ci"]
    return test


def compare(design: Design, results: dict) -> dict:
    """Per arm other than TOK and group: the primary endpoint's paired differences against TOK (by build and
    seed), their test, Holm over the groups within the arm and the finding; the matched-KL secondary beside them
    (amendment 1 cut the equal-steps secondary)."""
    groups = [(task, setup) for task in design.tasks for setup in design.setups]
    pairs = [(b, s) for b in design.confirmation_builds for s in design.confirmation_seeds]
    table = {}
    for arm in [a for a in design.arms if a != "TOK"]:
        entries = {}
        for task, setup in groups:
            def run(a, b, s, phase="confirmation"):
                return results.get((phase, task, setup, a, b, s))
            common = [(b, s) for b, s in pairs if run(arm, b, s) and run("TOK", b, s)]
            diffs = [at_budget(run(arm, b, s))["gold_reward"] - at_budget(run("TOK", b, s))["gold_reward"]
                     for b, s in common]
            entry = {"n": len(common), "vs_tok": paired_test(diffs, len(groups)),
                     "by_build": {b: float(np.mean([d for d, (bb, _) in zip(diffs, common) if bb == b]))
                                  if any(bb == b for bb, _ in common) else math.nan
                                  for b in design.confirmation_builds},
                     "gold": float(np.mean([at_budget(run(arm, b, s))["gold_reward"] for b, s in common]))
                     if common else math.nan,
                     "tok_gold": float(np.mean([at_budget(run("TOK", b, s))["gold_reward"] for b, s in common]))
                     if common else math.nan}
            entry["matched_kl"] = paired_t([
                at_kl(run(arm, b, s), at_budget(run("TOK", b, s))["kl"])["gold_reward"]
                - at_budget(run("TOK", b, s))["gold_reward"] for b, s in common])
            entry["budget_step"] = float(np.mean([at_budget(run(arm, b, s))["step"] for b, s in common])) \
                if common else math.nan
            entries[f"{task}/{setup}"] = entry
        adjusted = holm([e["vs_tok"]["p"] for e in entries.values()])
        for (name, entry), p in zip(entries.items(), adjusted):
            entry["vs_tok"]["p_holm"] = p
            entry["finding"] = finding(entry["vs_tok"], MARGINS[name.split("/")[0]]) if entry["n"] >= 2 else "-"
        table[arm] = entries
    return table


def decision(design: Design, table: dict) -> dict:
    """The README's decision rule applied to the findings: per arm the groups where it is ahead of TOK, behind it,
    equivalent to it, and the rest with what they exclude (rule 1); whether it becomes the documented recommendation,
    ahead in at least 3 groups and behind in none (rule 2); whether no Monte-Carlo or prefix-tree arm is ahead in any
    group (rule 3). `complete`: every group of every arm has all its pairs (until then nothing is decided)."""
    pairs = len(design.confirmation_builds) * len(design.confirmation_seeds)
    arms = {}
    for arm, entries in table.items():
        found = {"ahead": [], "behind": [], "equivalent": [], "excluded": {}}
        for group, e in entries.items():
            if e["finding"].startswith("no difference"):
                found["excluded"][group] = e["finding"].split("; ")[1]
            elif e["finding"].startswith("equivalent"):
                found["equivalent"].append(group)
            elif e["finding"] in ("ahead", "behind"):
                found[e["finding"]].append(group)
        arms[arm] = {**found, "recommended": len(found["ahead"]) >= 3 and not found["behind"]}
    segment_values = [a for a in arms if a in MC_ARMS or a == "TEMPO"]  # Monte-Carlo and prefix-tree values
    return {"complete": bool(table) and all(e["n"] == pairs for entries in table.values() for e in entries.values()),
            "arms": arms, "no_segment_value_arm_ahead": not any(arms[a]["ahead"] for a in segment_values)}


def costs(design: Design, results: dict, side: dict | None = None) -> dict:
    """Per arm over its confirmation runs: mean run seconds (held-out evaluations included: every 10 steps and at
    the budget), seconds in the trainer's steps alone, generated tokens and Monte-Carlo tokens, and the
    Monte-Carlo continuations' tokens/s against the main rollout's (time/advantages holds the continuations); with
    the side measurement, an estimate of a run's forward tokens (its generated tokens times its task and build's
    step-1 forward tokens per budget token) over the runs whose task and build were measured. `step_seconds_vs_tok`:
    the mean ratio of a run's step seconds to its TOK pair's (same group, build and seed), free of the task mix."""
    ratios = (side or {}).get("forward", {})
    out = {}

    def step_seconds(r: dict) -> float:
        return sum(r["curves"]["time/step_seconds"])
    for arm in design.arms:
        keys = [k for k in results if k[0] == "confirmation" and k[3] == arm]
        rs = [results[k] for k in keys]
        if not rs:
            continue
        pairs = [(results[k], results.get((*k[:3], "TOK", *k[4:]))) for k in keys]
        mc = sum(sum(x or 0 for x in r["curves"].get("rollout/mc_tokens") or []) for r in rs)
        rollout = sum(sum(r["curves"]["rollout/tokens"]) for r in rs)
        out[arm] = {"runs": len(rs), "run_seconds": float(np.mean([r["run_seconds"] for r in rs])),
                    "step_seconds": float(np.mean([step_seconds(r) for r in rs])),
                    "step_seconds_vs_tok": float(np.mean([step_seconds(r) / step_seconds(t) for r, t in pairs if t]))
                    if any(t for _, t in pairs) else math.nan,
                    "generated_tokens": float(np.mean([r["generated_tokens"] for r in rs])),
                    "mc_tokens": mc / len(rs),
                    "rollout_tokens_per_s": rollout / sum(sum(r["curves"]["time/generation"]) for r in rs),
                    "mc_tokens_per_s": mc / sum(sum(r["curves"]["time/advantages"]) for r in rs) if mc else math.nan}
        measured = [r["generated_tokens"] * ratios[arm][f"{r['task']}/build{r['build']}"]["per_budget_token"]
                    for r in rs if f"{r['task']}/build{r['build']}" in ratios.get(arm, {})]
        out[arm]["forward_tokens_estimate"] = float(np.mean(measured)) if measured else math.nan
        out[arm]["forward_estimate_runs"] = len(measured)
    return out


def learning_rate_multiplier(step: int, planned: int) -> float:
    """The learning rate's multiplier at 0-based optimizer step `step` of a run planned over `planned` steps, as
    the trainer's scheduler gives it (the demo's: warm-up then cosine, held at its last value past the plan)."""
    from marlhf.run_config import TrainingConfig
    from marlhf.trainers.common import make_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return float(make_scheduler(optimizer, TrainingConfig(), planned).lr_lambdas[0](step))


def warmup_steps(design: Design) -> int:
    """The steps before the learning rate's peak in a run planned over the design's steps."""
    multipliers = [learning_rate_multiplier(i, design.steps) for i in range(design.steps)]
    return multipliers.index(max(multipliers))


def _spread(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def schedules(design: Design, results: dict) -> dict:
    """Per arm over its confirmation runs, what the audit asked beside the findings, at the primary endpoint (the
    budget step; TOK's: step 50): the steps to it, the tokens then over TOK's budget (stopping at the first step
    that reaches it overshoots), the share of its tokens in Monte-Carlo continuations, the share of those steps in
    warm-up, the learning rate's multiplier at the last update before it, and the steps before it past the plan
    (learning rate 0: the policy is frozen); and the steps the run took (the other arms go on to step 50)."""
    warmup = warmup_steps(design)
    out = {}
    for arm in design.arms:
        rs = [r for k, r in results.items() if k[0] == "confirmation" and k[3] == arm]
        if not rs:
            continue
        steps = [at_budget(r)["step"] for r in rs]
        out[arm] = {
            "runs": len(rs), "steps": _spread(steps),
            "run_steps": _spread([len(r["curves"]["rollout/tokens"]) for r in rs]),
            "over_budget": _spread([at_budget(r)["generated_tokens"] / r["budget"] - 1 for r in rs])
            if rs[0]["budget"] else None,
            "mc_share": _spread([sum(x or 0 for x in r["curves"].get("rollout/mc_tokens") or []) / generated_tokens(r)
                                 for r in rs]),
            "warmup_share": _spread([min(n, warmup) / n for n in steps]),
            "last_learning_rate": _spread([learning_rate_multiplier(n - 1, design.steps) for n in steps]),
            "frozen_steps": _spread([max(0, n - design.steps) for n in steps])}
    return out


def exploratory(design: Design, results: dict) -> dict:
    """Amendment 1's exploratory arm per group (never decided on): its held-out gold at the budget against TOK's and
    against its arm's confirmation run (paired by build and seed), its planned and taken steps, and the learning
    rate's multiplier at its last update under its own plan."""
    out = {}
    for task in design.tasks:
        for setup in design.setups:
            runs = [(r, results.get(("confirmation", task, setup, "TOK", b, s)),
                     results.get(("confirmation", task, setup, design.exploratory_arm, b, s)))
                    for (phase, t, u, _, b, s), r in sorted(results.items(), key=lambda item: str(item[0]))
                    if (phase, t, u) == (EXPLORATORY, task, setup)]
            runs = [(own, tok, arm) for own, tok, arm in runs if tok and arm]
            if not runs:
                continue

            def gold(r):
                return at_budget(r)["gold_reward"]
            planned = [r["options"]["max_steps"] for r, _, _ in runs]
            taken = [len(r["curves"]["rollout/tokens"]) for r, _, _ in runs]
            out[f"{task}/{setup}"] = {
                "n": len(runs), "gold": float(np.mean([gold(r) for r, _, _ in runs])),
                "vs_tok": paired_t([gold(r) - gold(tok) for r, tok, _ in runs]),
                "vs_confirmation": paired_t([gold(r) - gold(arm) for r, _, arm in runs]),
                "planned_steps": _spread(planned), "steps": _spread(taken),
                "last_learning_rate": _spread([learning_rate_multiplier(n - 1, p) for n, p in zip(taken, planned)])}
    return out


def collapsed(design: Design, results: dict, shrink: float = 0.25) -> list[dict]:
    """Every run (tuning included) whose responses shrank below `shrink` of their first step's length over its last
    5 steps: its length, its steps past the plan and their seconds (learning rate 0: frozen) and its adaptive KL
    coefficient (which can only climb while the policy cannot move)."""
    out = []
    for key, r in sorted(results.items(), key=lambda item: str(item[0])):
        lengths, coefs = r["curves"]["objective/response_length"], r["curves"]["objective/kl_coef"]
        if np.mean(lengths[-5:]) < shrink * lengths[0]:
            out.append({"run": "/".join(map(str, key)), "first_length": lengths[0],
                        "last_length": float(np.mean(lengths[-5:])), "steps": len(lengths),
                        "kl_coef_first": coefs[0], "kl_coef_max": max(coefs), "run_seconds": r["run_seconds"],
                        "frozen_steps": max(0, len(lengths) - design.steps),
                        "frozen_seconds": float(sum(r["curves"].get("time/step_seconds", [])[design.steps:])),
                        "gold": at_budget(r)["gold_reward"]})
    return out


def clue_shares(design: Design, results: dict) -> dict:
    """Task 4: each arm's share of right clue words among clue words after markers at the primary endpoint."""
    out = {}
    for setup in design.setups:
        for arm in design.arms:
            rs = [r for k, r in results.items() if k[:4] == ("confirmation", "task4", setup, arm)]
            shares = [x for x in (right_clue_share(at_budget(r)) for r in rs) if not math.isnan(x)]
            if rs:  # nan where no run found a clue word after its markers
                out[f"task4/{setup}/{arm}"] = float(np.mean(shares)) if shares else math.nan
    return out


def wall_time(results: dict, superseded: dict | None = None, workers: int = 2) -> dict:
    """The budget's clock. The study runs in sittings (sessions of a few hours), so the span from the first result
    file to the last includes the time between sittings; the budget counts the runs' own time at two at a time
    (the sum of each run's finished - started, over 2), and both are reported. `superseded` runs (amendment 2) are
    charged and their share is reported."""
    superseded = superseded or {}
    runs = [r for r in [*results.values(), *superseded.values()] if "finished" in r]
    if not runs:
        return {"hours": 0.0, "span_hours": 0.0, "superseded_hours": 0.0}

    def hours(rs) -> float:
        return sum((datetime.fromisoformat(r["finished"]) - datetime.fromisoformat(r["started"])).total_seconds()
                   for r in rs if "finished" in r) / workers / 3600
    times = sorted(datetime.fromisoformat(r["finished"]) for r in runs)
    return {"first": times[0].isoformat(), "last": times[-1].isoformat(), "hours": hours(runs),
            "superseded_hours": hours(superseded.values()), "span_hours": (times[-1] - times[0]).total_seconds() / 3600}


def side_measurements(side_dir: Path, results: dict) -> dict:
    """The side measurement's files (benchmarks/credit_segments_side.py: one step from the SFT policy on the study's
    own models), per task and build: MC-LP's kept boundaries against MC5's (token 0, which both keep, left out) and
    each arm's forward tokens of the step (every model: policy, reference, critic, reward model; Monte-Carlo prefix
    re-encoding included) per token the policy sampled and per token of the budget. A build measured on other models
    than the study's runs used is an error."""
    models = {(r["task"], r["build"]): (r["sft_sha256"], r["reward_sha256"]) for k, r in results.items()
              if k[0] == "confirmation" and "sft_sha256" in r}
    out = {"files": {}, "boundaries": {}, "forward": {}}
    for path in sorted(side_dir.glob("*.json")):
        side = json.loads(path.read_text())
        out["files"][path.name] = {"commit": side["commit"][:7], "clean": side["clean"], "builds": list(side["builds"])}
        for name, build in side["builds"].items():
            task, number = name.split("/build")
            hashes = (build["sft_sha256"], build["reward_sha256"])
            if models.get((task, int(number)), hashes) != hashes:
                raise SystemExit(f"{path}: {name} was measured on other models than the study's runs of that build")
            if name in out["boundaries"]:
                raise SystemExit(f"{path}: {name} is measured in two side files")
            setup = build["setups"]["gold_sft"]
            bounds = setup["boundaries"]
            out["boundaries"][name] = {"responses": bounds["responses"],
                                       "low_prob_segments": bounds["low_prob_segments_before_keeping"]["mean"],
                                       **{k: bounds["overlap_without_token0"][k]
                                          for k in ("share_identical", "mean_distance")}}
            for arm, cost in setup["cost"].items():
                out["forward"].setdefault(arm, {})[name] = {
                    "per_sampled_token": cost["forward_tokens_per_rollout_token"],
                    "per_budget_token": cost["forward_tokens_per_budget_token"],
                    "prefix_reencoding_share": cost["parts"]["mc_prefix_reencoding"]["tokens"] / cost["forward"]["tokens"]}
    return out


# ---------------------------------------------------------------------------------------------- summary
def load_results(results: Path) -> dict[tuple, dict]:
    """Every result file (Study II's loader: one build's runs must share their models); confirmation files
    (confirmation, equal_steps) must all come from one commit of a clean tree, the tuning files' (amendment 1)."""
    out = study_two.load_results(results)
    commits = {(r["commit"], r["clean"]) for k, r in out.items()
               if k[0] not in ("tuning", EXPLORATORY) and not r.get("quick")}
    if len(commits) > 1:
        raise SystemExit(f"confirmation result files come from more than one commit: {sorted(commits)}")
    tuning = {(r["commit"], r["clean"]) for k, r in out.items() if k[0] == "tuning" and not r.get("quick")}
    if commits and tuning and commits != tuning:
        raise SystemExit(f"confirmation result files come from {sorted(commits)}, the tuning files from "
                         f"{sorted(tuning)}: every run of the study must come from one commit of a clean tree")
    exploratory = {(r["commit"], r["clean"]) for k, r in out.items() if k[0] == EXPLORATORY and not r.get("quick")}
    if len(exploratory) > 1 or any(not clean for _, clean in exploratory):
        raise SystemExit(f"exploratory result files must come from one commit of a clean tree: {sorted(exploratory)}")
    return out


def load_superseded(results: Path) -> dict[tuple, dict]:
    """Amendment 2's files, moved unchanged to RESULTS/superseded/: listed and charged to the budget, never used."""
    return study_two.load_results(results / SUPERSEDED)


def summarize(design: Design, results_dir: Path) -> dict:
    results = load_results(results_dir)
    superseded = load_superseded(results_dir)
    choices = choices_so_far(design, results)
    table = compare(design, results) if len(choices["settings"]) == len(TUNED) else {}
    side = side_measurements(results_dir / SIDE, results)
    summary = {"choices": choices, "comparison": table, "decision": decision(design, table),
               "costs": costs(design, results, side),
               "clue_shares": clue_shares(design, results), "schedules": schedules(design, results),
               "collapsed": collapsed(design, results), "side": side,
               "exploratory": exploratory(design, results),
               "superseded": sorted("/".join(map(str, k)) for k in superseded),
               "wall_time": wall_time(results, superseded), "runs": len(results)}
    clock = summary["wall_time"]
    lines = ["# Study III: segments against a tuned token-level PPO at an equal token budget", "",
             "Generated by `python benchmarks/credit_segments.py --summarize` from the result files; do not edit. "
             f"Design: README.md (design commit {DESIGN_COMMIT}; amendment 1, commit {AMENDMENT_COMMIT}; "
             f"amendment 2, commit {AMENDMENT_2_COMMIT}).", "",
             f"Result files: {len(results)}, and {len(superseded)} superseded (amendment 2: charged, not used). "
             f"Run time at two runs at a time: {clock['hours']:.2f} h, superseded runs' {clock['superseded_hours']:.2f} h "
             f"included (budget {BUDGET_HOURS:g} h{'; overrun' if clock['hours'] > BUDGET_HOURS else ''}); "
             f"from the first result file to the last, sittings and the time between them: {clock['span_hours']:.1f} h.",
             "Commits: " + ", ".join(sorted({f"{r['commit'][:7]} ({'clean' if r['clean'] else 'dirty'})"
                                              for r in [*results.values(), *superseded.values()]})), "",
             "## Tuning (build 0, gold_sft)", "", f"Chosen: {choices['settings']}; scores {choices['scores']}", ""]
    lines += comparison_lines(table) + schedule_notes(table, design) + decision_lines(summary["decision"])
    lines += cost_lines(summary, design) + side_lines(summary["side"])
    lines += exploratory_lines(summary["exploratory"], design)
    lines += ["## Superseded runs (amendment 2)", ""]
    lines += [f"- {run}" for run in summary["superseded"]] or ["- none"]
    (results_dir / "summary.md").write_text("\n".join(lines) + "\n")
    (results_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if table:
        plot(table, results_dir)
    return summary


def comparison_lines(table: dict) -> list[str]:
    """The primary endpoint's table, every cell (empty until tuning is complete)."""
    if not table:
        return []
    f = study_two._f
    lines = ["## Primary: held-out gold at TOK's budget of generated tokens", "",
             "Arm - TOK paired by (build, seed): mean [95 % t], p (Holm over the 6 groups), TOST interval "
             f"({100 * (1 - 2 * ALPHA / 6):.1f} %), finding; secondary: matched KL (amendment 1 cut the "
             "equal-steps secondary). Figure: `paired_differences.png`.", "",
             "| arm | group | pairs | arm | TOK | arm - TOK | by build | p (Holm) | TOST interval | finding "
             "| matched KL | budget step |", "|---" * 12 + "|"]
    for arm, entries in table.items():
        for group, e in entries.items():
            t = e["vs_tok"]
            lines.append(f"| {arm} | {group} | {e['n']} | {f(e['gold'])} | {f(e['tok_gold'])} | {study_two._ci(t)} "
                         f"| {', '.join(f(v) for v in e['by_build'].values())} | {f(t['p'])} ({f(t['p_holm'])}) "
                         f"| [{f(t['tost_ci'][0])}, {f(t['tost_ci'][1])}] | {e['finding']} "
                         f"| {study_two._ci(e['matched_kl'])} | {f(e['budget_step'], 1)} |")
    return lines + [""]


def decision_lines(rule: dict) -> list[str]:
    """The decision rule's reading of the findings, stated as provisional until every pair exists."""
    if not rule["arms"]:
        return []
    lines = ["## Decision rule (README), applied to the findings above", "",
             "Every pair is in." if rule["complete"] else "**Provisional: not every pair is in; nothing is decided.**",
             ""]
    for arm, found in rule["arms"].items():
        listed = {k: ", ".join(found[k]) or "none" for k in ("ahead", "behind", "equivalent")}
        excluded = "; ".join(f"{group}: {text}" for group, text in found["excluded"].items()) or "none"
        lines.append(f"- {arm}: ahead in {listed['ahead']}; behind in {listed['behind']}; equivalent in "
                     f"{listed['equivalent']}; no difference detected in {excluded}. Recommendation (rule 2): "
                     f"{'yes' if found['recommended'] else 'no'}.")
    if not rule["complete"]:
        lines.append("- Rule 3: applied once every pair is in.")
    elif rule["no_segment_value_arm_ahead"]:
        lines.append("- Rule 3: no Monte-Carlo or prefix-tree arm is ahead in any group: on these tasks segment-level "
                     "values bought nothing at an equal token budget.")
    else:
        lines.append("- Rule 3: a Monte-Carlo or prefix-tree arm is ahead in at least one group.")
    return lines + [""]


def schedule_notes(table: dict, design: Design) -> list[str]:
    """Under the primary table, a line per arm whose runs reached the budget before the learning-rate plan ended
    (or only after it, frozen): where a finding could be the schedule's rather than the estimator's."""
    warmup = warmup_steps(design)
    lines = []
    for arm, entries in table.items():
        steps = [e["budget_step"] for e in entries.values() if not math.isnan(e["budget_step"])]
        if not steps:
            continue
        low, high = min(steps), max(steps)
        if high < design.steps:
            lines.append(f"- {arm} reached the budget at steps {low:.1f}-{high:.1f} (group means) of a {design.steps}-step "
                         f"plan whose warm-up is {warmup} steps: its findings may be its schedule's as much as its "
                         "estimator's.")
        elif high > design.steps:
            lines.append(f"- {arm} reached the budget only after step {design.steps} in some groups (up to {high:.1f}): "
                         "its policy was frozen (learning rate 0) past the plan, so there it had no more updates than "
                         "TOK.")
    return (["Schedule against estimator:", "", *lines, ""]) if lines else []


def _spread_text(x: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    f = study_two._f
    return "-" if x is None else f"{f(x['mean'] * scale, digits)} ({f(x['min'] * scale, digits)}-{f(x['max'] * scale, digits)})"


def cost_lines(summary: dict, design: Design) -> list[str]:
    """Cost per arm, the schedule audit, the collapsed runs and Task 4's clue shares."""
    f, spread = study_two._f, _spread_text
    lines = ["## Cost", "", "Means over each arm's confirmation runs. Run seconds include the held-out evaluations "
             "(every 10 steps and at the budget: fewer for the Monte-Carlo arms); the steps' own seconds do not. "
             "Seconds depend on the sitting's machine, and a pair's runs may come from different sittings (TOK's "
             "first). "
             "Forward tokens: an estimate, a run's generated tokens "
             "times the side measurement's forward tokens per budget token for its task and build (step 1; every "
             "model, prefix re-encoding included), over the runs whose task and build were measured.", "",
             "| arm | runs | run seconds | of them in steps | steps' seconds / TOK's (paired) | generated tokens "
             "| MC tokens | rollout tokens/s | MC tokens/s | forward tokens (estimate, runs) |", "|---" * 10 + "|"]
    lines += [f"| {arm} | {c['runs']} | {f(c['run_seconds'], 0)} | {f(c['step_seconds'], 0)} "
              f"| {f(c['step_seconds_vs_tok'], 2)} "
              f"| {f(c['generated_tokens'], 0)} | {f(c['mc_tokens'], 0)} "
              f"| {f(c['rollout_tokens_per_s'], 0)} | {f(c['mc_tokens_per_s'], 0)} "
              f"| {f(c['forward_tokens_estimate'], 0)} ({c['forward_estimate_runs']}) |"
              for arm, c in summary["costs"].items()]
    lines += ["", "## Steps, budget and schedule at the primary endpoint (confirmation runs: mean, min-max)", "",
              "A Monte-Carlo arm that stops within a few steps trains mostly in warm-up: its result may be its "
              f"schedule's as much as its estimator's. Warm-up and cosine are planned over {design.steps} steps; past "
              "them the learning rate is 0.", "",
              "| arm | runs | steps to the budget | tokens over TOK's budget | share in continuations | steps in warm-up "
              "| last learning rate (x peak) | frozen steps | steps run |", "|---" * 9 + "|"]
    lines += [f"| {arm} | {c['runs']} | {spread(c['steps'], digits=1)} | {spread(c['over_budget'], 100, 1)} % "
              f"| {spread(c['mc_share'], 100, 1)} % | {spread(c['warmup_share'], 100, 1)} % "
              f"| {spread(c['last_learning_rate'])} | {spread(c['frozen_steps'], digits=1)} "
              f"| {spread(c['run_steps'], digits=1)} |"
              for arm, c in summary["schedules"].items()]
    lines += ["", "## Collapsed runs (responses below a quarter of their first step's length; every phase)", ""]
    lines += [f"- {c['run']}: length {f(c['first_length'], 1)} -> {f(c['last_length'], 1)} over {c['steps']} steps, "
              f"{c['frozen_steps']} of them frozen past the plan ({f(c['frozen_seconds'], 0)} s), "
              f"KL coefficient {c['kl_coef_first']:.3g} -> {c['kl_coef_max']:.3g}, {f(c['run_seconds'], 0)} s, "
              f"gold {f(c['gold'])}" for c in summary["collapsed"]] or ["- none"]
    lines += ["", "## Task 4: right clue words among clue words after markers (primary endpoint)", ""]
    return lines + [f"- {k}: {f(v)}" for k, v in summary["clue_shares"].items()] + [""]


def exploratory_lines(table: dict, design: Design) -> list[str]:
    """Amendment 1's exploratory arm, every group (nothing is decided on it)."""
    if not table:
        return []
    f = study_two._f
    lines = [f"## Exploratory, never decided on: {design.exploratory_arm} with its schedule planned over its own steps "
             f"(builds {', '.join(map(str, design.exploratory_builds))})", "",
             "Planned steps: the steps its confirmation run of the same group, build and seed took; mean [95 % t] of "
             "paired differences at TOK's budget.", "",
             "| group | pairs | gold | - TOK | - its confirmation run | planned steps | steps | last learning rate (x peak) |",
             "|---" * 8 + "|"]
    lines += [f"| {group} | {e['n']} | {f(e['gold'])} | {study_two._ci(e['vs_tok'])} | "
              f"{study_two._ci(e['vs_confirmation'])} | {_spread_text(e['planned_steps'], digits=1)} "
              f"| {_spread_text(e['steps'], digits=1)} | {_spread_text(e['last_learning_rate'])} |"
              for group, e in table.items()]
    return lines + [""]


def side_lines(side: dict) -> list[str]:
    """The side measurement: MC-LP's boundaries against MC5's, and forward tokens per arm (one step from SFT)."""
    f = study_two._f
    files = ", ".join(f"{name} ({v['commit']}, {'clean' if v['clean'] else 'dirty'})" for name, v in side["files"].items())
    lines = ["## Side measurement: one step from the SFT policy on the study's models (gold_sft)", "",
             f"Files: {files or 'none'} (benchmarks/credit_segments_side.py). Step 1 only: trained policies' responses, "
             "and so their boundaries and costs, change over a run.", "",
             "MC-LP's kept boundaries against MC5's on the same responses (token 0, which both keep, left out):", "",
             "| task/build | responses | low_prob segments before keeping 4 | identical to an MC5 position "
             "| mean distance to the nearest (tokens) |", "|---" * 5 + "|"]
    lines += [f"| {name} | {b['responses']} | {f(b['low_prob_segments'], 1)} | {f(100 * b['share_identical'], 1)} % "
              f"| {f(b['mean_distance'], 2)} |" for name, b in sorted(side["boundaries"].items())]
    lines += ["", "Forward tokens of one step (policy, reference, critic and reward model; mean (min-max) over the "
              "task/builds measured):", "",
              "| arm | task/builds | per token the policy sampled | per token of the budget (with continuations) "
              "| share re-encoding Monte-Carlo prefixes |", "|---" * 5 + "|"]
    for arm, builds in side["forward"].items():
        column = {k: _spread([b[k] for b in builds.values()])
                  for k in ("per_sampled_token", "per_budget_token", "prefix_reencoding_share")}
        lines.append(f"| {arm} | {len(builds)} | {_spread_text(column['per_sampled_token'], digits=1)} "
                     f"| {_spread_text(column['per_budget_token'], digits=1)} "
                     f"| {_spread_text(column['prefix_reencoding_share'], 100, 1)} % |")
    return lines + [""]


FINDING_COLORS = {"ahead": "tab:green", "behind": "tab:red", "equivalent within the margin": "tab:blue"}


def plot(table: dict, results_dir: Path) -> Path:
    """Per group, each arm's paired difference against TOK at the budget (95 % t-interval), coloured by its finding,
    over the group's equivalence margin (shaded)."""
    from marlhf.evaluation.plots import pyplot

    plt = pyplot()
    groups = list(next(iter(table.values())))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.4 * len(groups), 3.6), squeeze=False, layout="constrained")
    for ax, group in zip(axes[0], groups):
        for y, arm in enumerate(table):
            t = table[arm][group]["vs_tok"]
            low, high = t["ci"]
            color = FINDING_COLORS.get(table[arm][group]["finding"], "tab:gray")
            ax.errorbar([t["mean"]], [y], xerr=None if math.isnan(low) else [[t["mean"] - low], [high - t["mean"]]],
                        fmt="o", color=color)
        margin = MARGINS[group.split("/")[0]]
        ax.axvspan(-margin, margin, color="tab:blue", alpha=0.1, lw=0)
        ax.axvline(0.0, color="black", lw=0.8)
        ax.set_yticks(range(len(table)), list(table) if ax is axes[0][0] else [""] * len(table))
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("gold minus TOK at TOK's token budget")
    fig.suptitle("arm minus TOK, 95 % t-interval; green ahead, red behind, blue equivalent (findings: Holm and TOST, "
                 "summary.md); shaded: the equivalence margin", fontsize=9)
    path = results_dir / "paired_differences.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- main
def _run(jobs: list[tuple], design: Design, choices: dict | None, work: Path, results: Path, workers: int) -> int:
    done = load_results(results)
    calls = {}
    for job in jobs:
        source = budget_job(job, choices)
        budget = generated_tokens(done[source]) if source is not None else None
        planned = own_steps(job, done) if job[0] == EXPLORATORY else None
        calls[job] = (run_job, (job, job_options(job, design, choices, budget, planned), budget, str(work),
                                str(results), design))
    return study_one.run_in_pool(calls, workers, "study III runs")


def run_exploratory(design: Design, work: Path, results: Path, workers: int, max_runs: int | None) -> int:
    """Amendment 1's exploratory runs, refused until every confirmation run exists (cut 1: no equal-steps runs)."""
    done = load_results(results)
    confirmation = [j for stage in confirmation_stages(design) for j in stage if j[0] == "confirmation"]
    missing = [j for j in confirmation if j not in done]
    if missing:
        raise SystemExit(f"the exploratory runs start after every confirmation run: {len(missing)} of "
                         f"{len(confirmation)} are missing")
    todo = [j for j in exploratory_jobs(design) if j not in done][:max_runs]
    print(f"study III exploratory: {len(exploratory_jobs(design))} runs, {len(todo)} to run", flush=True)
    failed = _run(todo, design, choices_so_far(design, done), work, results, workers) if todo else 0
    summarize(design, results)
    print(f"wrote {results / 'summary.md'}" + (f"; {failed} runs failed (they run again next time)" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench_credit_segments", help="models and run directories")
    parser.add_argument("--results", default=str(DEFAULT_RESULTS),
                        help="one JSON per finished run, choices.json, summary.md, summary.json, figures; outside the "
                             "code's worktree (another git worktree) for every run but --quick's")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--max_runs", type=int, default=None, help="stop after starting this many new runs")
    parser.add_argument("--summarize", action="store_true", help="only write the tables and figures")
    parser.add_argument("--quick", action="store_true", help="the tiny design with tiny sizes (the test's)")
    parser.add_argument("--exploratory", action="store_true",
                        help="only amendment 1's exploratory runs (after every confirmation run, from a later commit)")
    arguments = parser.parse_args(argv)
    if arguments.workers < 1:
        parser.error("--workers must be >= 1")
    design = QUICK_DESIGN if arguments.quick else DESIGN
    work, results = Path(arguments.work), Path(arguments.results)
    if arguments.summarize:
        if not results.is_dir():
            parser.error(f"--results {results}: no such directory")
        summarize(design, results)
        print(f"wrote {results / 'summary.md'}")
        return 0
    check_provenance(results, arguments.quick)
    results.mkdir(parents=True, exist_ok=True)
    if arguments.exploratory:
        return run_exploratory(design, work, results, arguments.workers, arguments.max_runs)
    budget = math.inf if arguments.max_runs is None else arguments.max_runs
    failed = 0
    stages = tuning_stages(design)
    for index in range(len(stages) + len(confirmation_stages(design))):
        done = load_results(results)
        choices = choices_so_far(design, done)
        if index < len(stages):
            if len(choices["settings"]) < index:
                break  # an earlier tuning stage is incomplete: its choice is needed
            jobs = stages[index]
        else:
            if len(choices["settings"]) < len(TUNED):
                break  # tuning incomplete
            record_choices(results, choices)
            jobs = confirmation_stages(design)[index - len(stages)]
        todo = [j for j in jobs if j not in done]
        print(f"study III stage {index + 1}: {len(jobs)} runs, {len(jobs) - len(todo)} done, {len(todo)} to run",
              flush=True)
        todo = todo[: int(min(budget, len(todo)))]
        if not todo:
            if len(todo) < len([j for j in jobs if j not in done]):
                break  # --max_runs spent
            continue
        budget -= len(todo)
        failed += _run(todo, design, choices, work, results, arguments.workers)
        if failed:
            break  # a later stage needs this one's runs
    summarize(design, results)
    print(f"wrote {results / 'summary.md'}" + (f"; {failed} runs failed (they run again next time)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
