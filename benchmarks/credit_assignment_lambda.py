"""Study II: do macro actions add anything beyond a longer GAE horizon? MA-PPO against tuned token-level PPO.

    python benchmarks/credit_assignment_lambda.py                  # tuning, then confirmation and the fixed-KL
                                                                   # secondary (resumes where it stopped)
    python benchmarks/credit_assignment_lambda.py --max_runs 20    # part of it, in several sittings
    python benchmarks/credit_assignment_lambda.py --summarize      # tables and figures from the result files only
    python benchmarks/credit_assignment_lambda.py --quick --work W --results R   # the tiny version (the test's)

The design is pre-registered: it is fixed in this file (`DESIGN`) and in the README ("Study II") and was
committed before the first run. In short:

- Tasks (`marlhf/demo/README.md`): task1 (20-word responses, mean word score), task1_long (60 words), task3
  (alternation: a word's credit depends on its neighbour's class, not a sum of per-word scores). Set-ups as in the
  first study (benchmarks/credit_assignment.py): gold_sft (PPO optimises 4 x the gold reward, critic from the SFT
  model) and rm_rm (the reward model, critic from it: the paper's). The demo's hyper-parameters otherwise.
- Builds: a build is the demo's task_seed (lexicon, data sets, model initialisation, hence the base, SFT and
  reward models): build b uses task_seed 1234 + b. Tuning runs on build 0; confirmation on builds 1 and 2.
- Arm families and their free settings (`FAMILIES`): token-level PPO (lam 0.95 / 0.99 / 1); VC-PPO (lam_critic 1,
  actor lam 0.95 / 0.99, critic warm-up of 5 steps off / on); VAPO (length-adaptive actor lambda, alpha 0.02 /
  0.05 / 0.1, lam_critic 1); MA-PPO n = 5 with `first` (lam 0.9 / 0.95 / 1). Without a free setting
  (`FIXED_ARMS`): MA-PPO n = 5 with the paper's `equal`, the whole response as one macro action, RLOO.
- KL: every tuning and confirmation run adapts its KL coefficient (start 0.05) towards one target per task and
  set-up (`KL_TARGETS`, horizon 160 responses). The fixed-KL secondary reruns the best token-level arm and MA-PPO
  with the demo's fixed kl_coef 0.05.
- Tuning (`choose_settings`): each family's setting with the highest tuning score, the mean over the four
  task1/task1_long x set-up groups of (final held-out gold - the SFT model's held-out gold), each group's value
  the mean over 2 tuning seeds; ties go to the setting listed first. The best token-level arm (`TOK`) is the
  token-level family (ppo, vcppo, vapo) whose chosen setting scores highest. Tuning runs never enter the
  confirmation statistics.
- Confirmation: every arm (the four families at their chosen settings, and the fixed arms) on all three tasks
  and both set-ups, 4 seeds on each of builds 1 and 2 (8 per cell, seeds 10-13).
- Primary metric: final held-out gold (128 held-out prompts after the last step). Statistics: paired differences
  against TOK per (build, seed), t-interval (95 %), two-sided paired t-test, Holm-corrected over the 6 task x
  set-up groups within each arm; builds reported apart.
- Decision rule (`decide`): see `DECISION_RULE`, written before any run.

Each finished run writes RESULTS/<phase>/<task>/<setup>/<arm>/build<b>-seed<s>.json and is never run again;
models and run directories live in WORK (not committed). Two runs at a time (`--workers`), one torch thread each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import credit_assignment as study_one  # noqa: E402  (its run machinery, set-ups and curve helpers)

from marlhf.evaluation.stats import holm, paired_t, t_quantile  # noqa: E402

SETUPS = study_one.SETUPS
TASKS = {"task1": study_one.TASKS["task1"], "task1_long": study_one.TASKS["task1_long"],
         "task3": {"num_words": 20, "gold": "alternation"}}
FIRST_TASK_SEED = 1234  # the demo's default task_seed: build 0
# One KL target per task and set-up: the mean final KL of token-level PPO (n1) and n = 5 + `first` in the first
# study (benchmarks/results/credit_assignment/summary.md), rounded; task3 (20 words, new) takes task1's.
KL_TARGETS = {("task1", "gold_sft"): 9.0, ("task1", "rm_rm"): 11.0, ("task1_long", "gold_sft"): 4.0,
              ("task1_long", "rm_rm"): 10.0, ("task3", "gold_sft"): 9.0, ("task3", "rm_rm"): 11.0}
KL_HORIZON = 160  # responses: at 32 a step the coefficient moves by at most 4 % a step
WARMUP_STEPS = 5  # VC-PPO's critic warm-up, counted in the 50-step budget

TOKEN = {"termination": "fixed", "ngram": 1}
MACRO = {"termination": "fixed", "ngram": 5}
FAMILIES = {  # family -> (token-level?, {setting: PPOConfig options}); the first setting listed wins ties
    "ppo": (True, {"lam0.95": {**TOKEN, "lam": 0.95}, "lam0.99": {**TOKEN, "lam": 0.99},
                   "lam1": {**TOKEN, "lam": 1.0}}),
    "vcppo": (True, {f"lam{lam}{'+warmup' if warmup else ''}": {
        **TOKEN, "lam": lam, "lam_critic": 1.0, **({"critic_warmup_steps": WARMUP_STEPS} if warmup else {})}
        for lam in (0.95, 0.99) for warmup in (False, True)}),
    "vapo": (True, {f"alpha{alpha}": {**TOKEN, "lam_schedule": "length_adaptive", "lam_alpha": alpha,
                                      "lam_critic": 1.0} for alpha in (0.02, 0.05, 0.1)}),
    "ma_first": (False, {f"lam{lam:g}": {**MACRO, "value_weighting": "first", "lam": lam} for lam in (0.9, 0.95, 1.0)}),
}
FIXED_ARMS = {
    "ma_equal": {**MACRO, "value_weighting": "equal", "lam": 0.95},
    "whole": {"termination": "fixed", "ngram": None, "value_weighting": "equal", "lam": 0.95},
    "rloo": {**TOKEN, "advantage": "rloo", "num_samples_per_prompt": 4},  # the demo's rloo (critic_free_options)
}
MA = "ma_first"  # the macro-action arm the decision is about
ALPHA, POWER = 0.05, 0.8  # familywise level of the simultaneous intervals; power of the detectable difference
DESIGN_COMMIT = "12b60e3"  # the pre-registration: no run before it
BUDGET_HOURS = 12.0  # of wall time, from the first runs (the design's budget)
KL_NEAR = 0.1  # a final KL within 10 % of its target counts as reaching it
SECONDARY = ("tok_fixed_kl", "ma_first_fixed_kl")  # TOK and MA at their chosen settings, fixed kl_coef

DECISION_RULE = """\
Primary comparison, per task x set-up group g (6 groups): d = final held-out gold of MA-PPO (n = 5, `first`, its
tuned lam) minus that of TOK, paired by (build, seed), 8 pairs; two-sided paired t-test, Holm-corrected over the
6 groups. MA is ahead in g if its adjusted p < 0.05 and mean d > 0; TOK is ahead if adjusted p < 0.05 and mean
d < 0; otherwise no difference is detected.
1. TOK ahead in no group: PPOConfig and `marlhf demo` keep macro actions (ngram 5, value_weighting first), with
   lam set to MA-PPO's tuned lam.
2. TOK ahead in at least one group and MA ahead in none: PPOConfig's and the demo's defaults become TOK's
   setting (ngram 1 with its lam, lam_critic, lam_schedule, critic warm-up); macro actions stay an option.
3. Both ahead somewhere: defaults as in 1; the README states in which groups each is ahead.
In every case the demo's `ppo` method takes TOK's setting and `ma_ppo` MA-PPO's, and its report states their
comparison; the README claims for macro actions exactly the groups where MA is ahead, says "no difference
detected" for the others and names the groups where TOK is ahead. If MA is ahead in no group, the README says
plainly that on these tasks macro actions add nothing beyond a tuned lambda. The fixed-KL secondary (steps to
80 % of TOK's gain, gold at TOK's final KL) and the other arms' differences are reported, never decided on."""


@dataclasses.dataclass(frozen=True)
class Design:
    tasks: tuple[str, ...]
    tuning_tasks: tuple[str, ...]
    setups: tuple[str, ...]
    tuning_builds: tuple[int, ...]
    tuning_seeds: tuple[int, ...]
    confirmation_builds: tuple[int, ...]
    confirmation_seeds: tuple[int, ...]  # on each confirmation build
    families: dict
    fixed_arms: dict
    quick: bool = False


DESIGN = Design(tasks=tuple(TASKS), tuning_tasks=("task1", "task1_long"), setups=tuple(SETUPS), tuning_builds=(0,),
                tuning_seeds=(0, 1), confirmation_builds=(1, 2), confirmation_seeds=(10, 11, 12, 13),
                families=FAMILIES, fixed_arms=FIXED_ARMS)
# Seconds per run: two settings of two families, one fixed arm, two confirmation seeds on one build.
QUICK_DESIGN = Design(tasks=("task1",), tuning_tasks=("task1",), setups=("gold_sft",), tuning_builds=(0,),
                      tuning_seeds=(0,), confirmation_builds=(1,), confirmation_seeds=(10, 11),
                      families={"ppo": (True, {k: FAMILIES["ppo"][1][k] for k in ("lam0.95", "lam1")}),
                                "ma_first": (False, {k: FAMILIES["ma_first"][1][k] for k in ("lam0.95", "lam1")})},
                      fixed_arms={"rloo": FIXED_ARMS["rloo"]}, quick=True)


# ---------------------------------------------------------------------------------------------- jobs
def tuning_jobs(design: Design) -> list[tuple]:
    """(phase, task, setup, arm, build, seed) of every tuning run; arm = family+setting."""
    return [("tuning", task, setup, f"{family}+{setting}", build, seed)
            for seed in design.tuning_seeds for build in design.tuning_builds for task in design.tuning_tasks
            for setup in design.setups for family, (_, settings) in design.families.items() for setting in settings]


def confirmation_jobs(design: Design) -> list[tuple]:
    """The primary runs, then the fixed-KL secondary; seed by seed, so a grid stopped midway has every cell on some
    seeds rather than some cells on all."""
    arms = [*design.families, *design.fixed_arms]
    jobs = []
    for phase, phase_arms in (("confirmation", arms), ("secondary", SECONDARY)):
        jobs += [(phase, task, setup, arm, build, seed) for seed in design.confirmation_seeds
                 for build in design.confirmation_builds for task in design.tasks for setup in design.setups
                 for arm in phase_arms]
    return jobs


def result_path(results: Path, job: tuple) -> Path:
    phase, task, setup, arm, build, seed = job
    return results / phase / task / setup / arm / f"build{build}-seed{seed}.json"


def job_options(job: tuple, design: Design, choices: dict | None) -> dict:
    """PPOConfig options of a run: its arm's, plus the adaptive KL controller unless it is the fixed-KL secondary."""
    phase, task, setup, arm, _, _ = job
    if phase == "tuning":
        family, setting = arm.split("+", 1)
        options = dict(design.families[family][1][setting])
    elif arm in design.fixed_arms:
        options = dict(design.fixed_arms[arm])
    else:
        family = {"tok_fixed_kl": choices["tok"], "ma_first_fixed_kl": MA}.get(arm, arm)
        options = dict(design.families[family][1][choices["settings"][family]])
    if phase != "secondary":
        options.update(kl_target=KL_TARGETS[(task, setup)], kl_horizon=KL_HORIZON)  # from the demo's kl_coef 0.05
    return options


def run_job(job: tuple, options: dict, work: str, results: str, quick: bool) -> str:
    """One run, in its own process with one torch thread; writes its result file."""
    phase, task, setup, arm, build, seed = job
    work = Path(work)
    config = study_one.demo_config(task, setup, quick, tasks=TASKS, task_seed=FIRST_TASK_SEED + build)
    result = study_one.execute_run(config, work / "models" / task / f"build{build}", f"{task}/build{build}", options,
                                   seed, work / "runs" / Path(*map(str, job)), arm)
    result = {"phase": phase, "task": task, "setup": setup, "arm": arm, "build": build, "seed": seed,
              "task_options": TASKS[task], "setup_options": SETUPS[setup], **result}
    return str(study_one.write_result(result_path(Path(results), job), result))


# ---------------------------------------------------------------------------------------------- analysis
def load_results(results: Path) -> dict[tuple, dict]:
    """{(phase, task, setup, arm, build, seed): result} of every result file. The runs of one task and build must
    share their SFT and reward models (the hashes each file records): a build made again on another machine could
    differ, and its runs would then not be comparable; that is an error naming both."""
    out, models = {}, {}
    for path in sorted(results.glob("*/*/*/*/build*-seed*.json")):
        r = json.loads(path.read_text())
        out[(r["phase"], r["task"], r["setup"], r["arm"], r["build"], r["seed"])] = r
        hashes = (r.get("sft_sha256"), r.get("reward_sha256"))
        first = models.setdefault((r["task"], r["build"]), (hashes, path))
        if first[0] != hashes:
            raise ValueError(f"{path} and {first[1]} come from different models of {r['task']} build {r['build']} "
                             f"({hashes} vs {first[0]}): the build was made again differently")
    return out


def t_test_power(difference: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level `alpha` with `n` pairs when the true mean difference is
    `difference` and the differences' SD is `sd`: the noncentral t's tails, exact up to the quadrature over the
    chi-square law of the sample variance."""
    df = n - 1
    critical = t_quantile(1 - alpha / 2, df)
    shift = difference * math.sqrt(n) / sd
    v = np.linspace(1e-9, df + 20 * math.sqrt(2 * df), 2001)  # chi-square(df) to 20 SDs above its mean
    density = np.exp((df / 2 - 1) * np.log(v) - v / 2 - df / 2 * math.log(2) - math.lgamma(df / 2))
    bound = critical * np.sqrt(v / df)
    normal_cdf = np.vectorize(lambda x: 0.5 * math.erfc(-x / math.sqrt(2)))
    tails = normal_cdf(shift - bound) + normal_cdf(-shift - bound)
    return float(np.sum((tails * density)[1:] + (tails * density)[:-1]) / 2 * (v[1] - v[0]))


def detectable_difference(sd: float, n: int, alpha: float, power: float = POWER) -> float:
    """The smallest true mean difference the paired t-test (two-sided, level `alpha`, `n` pairs, SD `sd`) detects
    with probability `power` (bisection on `t_test_power`)."""
    low, high = 0.0, 20.0 * sd
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if t_test_power(mid, sd, n, alpha) < power else (low, mid)
    return high


def _gain(result: dict) -> float:
    return result["held_out"]["gold_reward"] - result["sft_held_out"]["gold_reward"]


def choose_settings(design: Design, results: dict[tuple, dict]) -> dict | None:
    """The pre-registered tuning rule, from the tuning result files: {"settings": {family: setting}, "tok": family,
    "scores": {arm: score}}; None until every tuning run has a result."""
    jobs = tuning_jobs(design)
    if any(job not in results for job in jobs):
        return None
    scores = {}
    for family, (_, settings) in design.families.items():
        for setting in settings:
            arm = f"{family}+{setting}"
            groups = [[_gain(results[j]) for j in jobs if j[3] == arm and (j[1], j[2]) == group]
                      for group in sorted({(j[1], j[2]) for j in jobs})]
            scores[arm] = float(np.mean([np.mean(g) for g in groups]))
    chosen = {}
    for family, (_, settings) in design.families.items():
        best = max(settings, key=lambda s: (scores[f"{family}+{s}"], -list(settings).index(s)))
        chosen[family] = best
    token_families = [f for f, (token_level, _) in design.families.items() if token_level]
    tok = max(token_families, key=lambda f: (scores[f"{f}+{chosen[f]}"], -token_families.index(f)))
    return {"settings": chosen, "tok": tok, "scores": scores}


def compare(design: Design, results: dict[tuple, dict], choices: dict) -> dict:
    """Per arm and group: final held-out gold (mean, t-interval, per build), final KL, and the paired difference
    against TOK with Holm's correction over the groups; the decision."""
    arms = [*design.families, *design.fixed_arms]
    groups = [(task, setup) for task in design.tasks for setup in design.setups]
    pairs = [(b, s) for b in design.confirmation_builds for s in design.confirmation_seeds]
    table: dict = {"groups": {}, "arms": arms, "tok": choices["tok"], "settings": choices["settings"]}
    for task, setup in groups:
        runs = {arm: {(b, s): results.get(("confirmation", task, setup, arm, b, s)) for b, s in pairs} for arm in arms}
        sft = {b: next((r["sft_held_out"]["gold_reward"] for (bb, _), r in runs[arms[0]].items() if r and bb == b),
                       math.nan) for b in design.confirmation_builds}
        entries = {}
        for arm in arms:
            have = {k: r for k, r in runs[arm].items() if r is not None}
            gold = np.array([r["held_out"]["gold_reward"] for r in have.values()])
            common = [k for k in pairs if runs[arm][k] is not None and runs[choices["tok"]][k] is not None]
            diffs = np.array([runs[arm][k]["held_out"]["gold_reward"] - runs[choices["tok"]][k]["held_out"]["gold_reward"]
                              for k in common])
            entries[arm] = {
                "n": len(have), "gold": paired_t(gold) if len(gold) else {"mean": math.nan, "ci": (math.nan,) * 2},
                "gold_by_build": {b: float(np.mean([r["held_out"]["gold_reward"] for (bb, _), r in have.items()
                                                    if bb == b])) if any(bb == b for bb, _ in have) else math.nan
                                  for b in design.confirmation_builds},
                "final_kl": float(np.mean([r["curves"]["objective/kl"][-1] for r in have.values()])) if have
                else math.nan,
                "final_kl_coef": float(np.mean([r["curves"]["objective/kl_coef"][-1] for r in have.values()]))
                if have and all("objective/kl_coef" in r["curves"] for r in have.values()) else math.nan,
                "vs_tok": {**paired_t(diffs), **_bounds(diffs, len(groups))},
                "vs_tok_by_build": {b: float(np.mean([d for d, (bb, _) in zip(diffs, common) if bb == b]))
                                    if any(bb == b for bb, _ in common) else math.nan
                                    for b in design.confirmation_builds}}
        table["groups"][f"{task}/{setup}"] = {"sft_gold_by_build": sft, "arms": entries}
    for arm in arms:
        names = list(table["groups"])
        adjusted = holm([table["groups"][g]["arms"][arm]["vs_tok"]["p"] if arm != choices["tok"] else math.nan
                         for g in names])
        for name, p in zip(names, adjusted):
            entry = table["groups"][name]["arms"][arm]
            entry["vs_tok"]["p_holm"] = p
            mean = entry["vs_tok"]["mean"]
            entry["verdict"] = ("-" if arm == choices["tok"] or math.isnan(p) else
                                "ahead" if p < 0.05 and mean > 0 else "behind" if p < 0.05 and mean < 0 else
                                "no difference detected")
    table["decision"] = decide(design, table, choices)
    return table


def _bounds(diffs: np.ndarray, groups: int) -> dict:
    """What the paired differences of one group can show: the simultaneous interval over the groups (Bonferroni,
    familywise 95 %), the largest difference it leaves open (`excluded_beyond`: differences beyond +-x are
    excluded), and the smallest difference the test at ALPHA / groups detects with 80 % power at their SD."""
    if len(diffs) < 2:
        return {"simultaneous_ci": (math.nan, math.nan), "excluded_beyond": math.nan, "detectable": math.nan}
    low, high = paired_t(diffs, 1 - ALPHA / groups)["ci"]
    sd = float(np.std(diffs, ddof=1))
    return {"simultaneous_ci": (low, high), "excluded_beyond": max(abs(low), abs(high)),
            "detectable": detectable_difference(sd, len(diffs), ALPHA / groups) if sd > 0 else 0.0}


def finding(vs_tok: dict, verdict: str) -> str:
    """A verdict in words that claim no more than the data show: 'no difference detected' with the differences
    the simultaneous interval excludes."""
    if verdict != "no difference detected":
        return verdict
    return f"no difference detected; differences beyond ±{vs_tok['excluded_beyond']:.3f} excluded"


def decide(design: Design, table: dict, choices: dict) -> dict:
    """`DECISION_RULE` applied to the comparison table: which defaults, and which groups MA / TOK lead."""
    verdicts = {g: entry["arms"][MA]["verdict"] for g, entry in table["groups"].items()}
    complete = all(entry["arms"][MA]["vs_tok"]["n"] == len(design.confirmation_builds) * len(design.confirmation_seeds)
                   for entry in table["groups"].values())
    ma_ahead = [g for g, v in verdicts.items() if v == "ahead"]
    tok_ahead = [g for g, v in verdicts.items() if v == "behind"]
    if not tok_ahead:
        case, defaults = 1, {"family": MA, "setting": choices["settings"][MA]}
    elif not ma_ahead:
        case, defaults = 2, {"family": choices["tok"], "setting": choices["settings"][choices["tok"]]}
    else:
        case, defaults = 3, {"family": MA, "setting": choices["settings"][MA]}
    family = defaults["family"]
    defaults["options"] = design.families[family][1][defaults["setting"]]
    return {"complete": complete, "case": case, "defaults": defaults, "ma_ahead": ma_ahead, "tok_ahead": tok_ahead,
            "no_difference": [g for g in verdicts if g not in ma_ahead and g not in tok_ahead]}


def secondary(design: Design, results: dict[tuple, dict]) -> dict:
    """Fixed kl_coef: final gold, final KL (the last step's), steps to 80 % of TOK's gain over the first step's gold
    and gold at TOK's final KL (both on the smoothed seed-mean curves), per group (descriptive); a group only once
    all its runs have a result."""
    out = {}
    runs = len(design.confirmation_builds) * len(design.confirmation_seeds)
    for task in design.tasks:
        for setup in design.setups:
            rs = {arm: [r for k, r in results.items() if k[:4] == ("secondary", task, setup, arm)] for arm in SECONDARY}
            if any(len(v) < runs for v in rs.values()):
                continue
            gold = {arm: np.array([r["curves"]["gold_reward"] for r in v], dtype=float) for arm, v in rs.items()}
            kl = {arm: np.array([r["curves"]["objective/kl"] for r in v], dtype=float) for arm, v in rs.items()}
            smooth = {arm: study_one._smooth(g, study_one.SMOOTHING).mean(0) for arm, g in gold.items()}
            smooth_kl = {arm: study_one._smooth(k, study_one.SMOOTHING).mean(0) for arm, k in kl.items()}
            start = float(np.mean([g[:, 0].mean() for g in gold.values()]))
            target = start + 0.8 * (smooth["tok_fixed_kl"][-1] - start)
            out[f"{task}/{setup}"] = {arm: {
                "n": len(rs[arm]), "final_gold": float(np.mean([r["held_out"]["gold_reward"] for r in rs[arm]])),
                "final_kl": float(kl[arm][:, -1].mean()),  # the last step's, as the primary's final KL
                "steps_to_80": study_one._first_reaching(smooth[arm], target) if target > start else math.nan,
                "gold_at_tok_kl": study_one._gold_at_kl(smooth_kl[arm], smooth[arm], float(smooth_kl["tok_fixed_kl"][-1]))}
                for arm in SECONDARY}
    return out


# ---------------------------------------------------------------------------------------------- report
def _f(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(stats: dict, digits: int = 3) -> str:
    low, high = stats["ci"]
    return f"{_f(stats['mean'], digits)}" + ("" if math.isnan(low) else f" [{_f(low, digits)}, {_f(high, digits)}]")


def headline(table: dict) -> list[str]:
    """The short table the README carries: per group, TOK's and MA-PPO's final held-out gold, their paired
    difference, its simultaneous interval, the finding it supports and the smallest difference 8 pairs can detect;
    then what that smallest difference is worth, and the decision's case in one sentence."""
    tok, d = table["tok"], table["decision"]
    groups = table["groups"]
    lines = ["## Headline: MA-PPO against the best-tuned token-level arm", "",
             f"MA-PPO: {MA}+{table['settings'][MA]}; TOK: {tok}+{table['settings'][tok]}. Final held-out gold, mean "
             "over (build, seed); difference paired by (build, seed) with its 95 % t-interval and its simultaneous "
             f"95 % interval over the {len(groups)} groups (Bonferroni: each at {100 * (1 - ALPHA / len(groups)):.2f} "
             "%); p Holm-adjusted over the groups; detectable: the smallest true difference the test at alpha "
             f"{ALPHA}/{len(groups)} finds with {100 * POWER:.0f} % power at the group's SD of the paired "
             "differences.", "",
             "| task / set-up | TOK | MA-PPO | MA-PPO - TOK | simultaneous 95 % | p (Holm) | finding | detectable |",
             "|---|---|---|---|---|---|---|---|"]
    worth = {}
    for group, entry in groups.items():
        ma = entry["arms"][MA]
        e = ma["vs_tok"]
        low, high = e["simultaneous_ci"]
        lines.append(f"| {group} | {_f(entry['arms'][tok]['gold']['mean'])} | {_f(ma['gold']['mean'])} "
                     f"| {_ci(e)} | [{_f(low)}, {_f(high)}] | {_f(e.get('p_holm', math.nan))} "
                     f"| {finding(e, ma['verdict'])} | {_f(e['detectable'])} |")
        gain = entry["arms"][tok]["gold"]["mean"] - float(np.mean(list(entry["sft_gold_by_build"].values())))
        worth[group] = (e["detectable"], e["detectable"] / gain if gain > 0 else math.nan)
    smallest, largest = min(worth, key=lambda g: worth[g][0]), max(worth, key=lambda g: worth[g][0])
    share = max(worth, key=lambda g: worth[g][1])
    pairs = next(iter(groups.values()))["arms"][MA]["vs_tok"]["n"]
    conclusion = {1: "TOK is ahead in no group: macro actions stay the default",
                  2: "TOK is ahead in some group and MA-PPO in none: token-level PPO becomes the default",
                  3: "each is ahead somewhere: macro actions stay the default"}[d["case"]]
    lines += ["", f"With {pairs} pairs a group, the smallest difference detectable with {100 * POWER:.0f} % power is "
                  f"{_f(worth[smallest][0])} gold ({smallest}) to {_f(worth[largest][0])} ({largest}), up to "
                  f"{100 * worth[share][1]:.0f} % of TOK's gain over SFT ({share}, gain "
                  f"{_f(worth[share][0] / worth[share][1])}). \"no difference detected\" is therefore not "
                  "equivalence: no margin was set in advance, and each group excludes only the differences beyond its "
                  "simultaneous interval.", "",
              f"{'' if d['complete'] else '**Incomplete, nothing is decided:** '}Case {d['case']} of the rule: "
              f"{conclusion} ({d['defaults']['family']}+{d['defaults']['setting']}). MA-PPO ahead in: "
              f"{', '.join(d['ma_ahead']) or 'none'}; TOK ahead in: {', '.join(d['tok_ahead']) or 'none'}.", ""]
    return lines


def kl_against_target(table: dict) -> list[str]:
    """Final KL of TOK and MA-PPO against each group's target: the controller holds the arms together, which is
    what 'equal KL' means here, but not always at the target."""
    tok = table["tok"]
    lines = ["## KL at the end against the target (adaptive KL)", "",
             "Final KL: the last step's KL of the training rollouts, mean over (build, seed).", "",
             "| task / set-up | target | TOK | MA-PPO | MA-PPO - TOK | TOK / target | MA-PPO / target | final kl_coef "
             "(TOK, MA-PPO; from 0.05) |",
             "|---|---|---|---|---|---|---|---|"]
    off, gaps = {}, []
    for group, entry in table["groups"].items():
        target = KL_TARGETS[tuple(group.split("/"))]
        t, m = entry["arms"][tok]["final_kl"], entry["arms"][MA]["final_kl"]
        gaps.append(abs(m - t))
        coef = ", ".join(_f(entry["arms"][a]["final_kl_coef"]) for a in (tok, MA))
        lines.append(f"| {group} | {target:g} | {_f(t, 1)} | {_f(m, 1)} | {m - t:+.1f} | {t / target:.2f} "
                     f"| {m / target:.2f} | {coef} |")
        ratios = (t / target, m / target)
        if max(abs(r - 1) for r in ratios) > KL_NEAR:
            side = "above" if min(ratios) > 1 else "below" if max(ratios) < 1 else "around"
            off[group] = f"{group} ({side}: aimed at {target:g}, ended {min(t, m):.1f}-{max(t, m):.1f})"
    near = [g for g in table["groups"] if g not in off]
    lines += ["", f"The arms end at about the same KL (MA-PPO - TOK within ±{max(gaps):.1f} in every group), so the "
                  "comparison is at equal KL between the arms. The controller did not always reach the target: within "
                  f"{100 * KL_NEAR:.0f} % of it in {', '.join(near) or 'no group'}; not in "
                  f"{'; '.join(off.values()) or 'none'}. \"Equal KL\" holds between the arms, not at the target.", ""]
    return lines


def fixed_against_adaptive(table: dict, second: dict) -> list[str]:
    """The fixed-KL secondary against the adaptive-KL primary, arm by arm (same builds and seeds): where final KL
    and final gold went, in words read off the numbers."""
    arms = {"tok_fixed_kl": ("TOK", table["tok"]), "ma_first_fixed_kl": ("MA-PPO", MA)}
    lines = ["| group | arm | final KL: adaptive -> fixed | final gold: adaptive -> fixed |", "|---|---|---|---|"]
    kl_moves, gold_moves = {}, {}
    for group, entries in second.items():
        for arm, e in entries.items():
            name, primary_arm = arms[arm]
            p = table["groups"][group]["arms"][primary_arm]
            lines.append(f"| {group} | {name} | {_f(p['final_kl'], 1)} -> {_f(e['final_kl'], 1)} "
                         f"| {_f(p['gold']['mean'])} -> {_f(e['final_gold'])} |")
            kl_moves.setdefault(group, []).append(e["final_kl"] - p["final_kl"])
            gold_moves.setdefault(group, []).append((name, p["gold"]["mean"], e["final_gold"]))

    def sides(moves: dict) -> tuple[list[str], list[str], list[str]]:
        up = [g for g, m in moves.items() if all(x > 0 for x in m)]
        down = [g for g, m in moves.items() if all(x < 0 for x in m)]
        return up, down, [g for g in moves if g not in up and g not in down]

    kl_up, kl_down, kl_mixed = sides(kl_moves)
    gold_up, gold_down, gold_mixed = sides({g: [f - a for _, a, f in v] for g, v in gold_moves.items()})
    mixed = "; ".join(f"{g} ({', '.join(f'{n} {a:.3f} -> {f:.3f}' for n, a, f in gold_moves[g])})" for g in gold_mixed)
    lines += ["", f"With kl_coef fixed at 0.05, final KL is higher than under the adaptive controller for both arms "
                  f"in {', '.join(kl_up) or 'no group'}, lower in {', '.join(kl_down) or 'no group'}"
                  f"{'; mixed in ' + ', '.join(kl_mixed) if kl_mixed else ''} (the adaptive coefficients' end "
                  "values are in the KL table above). Final held-out gold is higher for both arms in "
                  f"{', '.join(gold_up) or 'no group'}, lower for both in {', '.join(gold_down) or 'no group'}"
                  f"{'; mixed in ' + mixed if mixed else ''}. Descriptive: no test, and fixed against adaptive KL is "
                  "not the study's comparison.", ""]
    return lines


def wall_clock(results_dir: Path, secondary_jobs: int) -> list[str]:
    """The budget in wall time, read off the commits that added the result files (the files hold no timestamps):
    from the design commit to the last result, and what ran past BUDGET_HOURS. Nothing when git has no record."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=results_dir, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    start = git("log", "-1", "--format=%ct", DESIGN_COMMIT).strip()
    added, commit = {}, None  # phase -> [commit time of each added result file]
    for line in git("log", "--diff-filter=A", "--format=@%ct", "--name-only", "--", "*/build*-seed*.json").splitlines():
        if line.startswith("@"):
            commit = int(line[1:])
        elif line.strip() and commit is not None:
            added.setdefault(Path(line).parts[-5], []).append(commit)
    if not start or not added:
        return []
    start = int(start)
    hours = {phase: (max(times) - start) / 3600 for phase, times in added.items()}
    first = (min(min(t) for t in added.values()) - start) / 3600
    last = max(hours.values())
    late = sum(t - start > BUDGET_HOURS * 3600 for t in added.get("secondary", []))
    primary = max(hours.get("tuning", 0.0), hours.get("confirmation", 0.0))
    when = datetime.fromtimestamp(start, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [f"Wall time, read off the commits that added the result files (the files record none): the design commit "
            f"{DESIGN_COMMIT} ({when}), the first results {first:.1f} h after it, the last {last:.1f} h after it, "
            f"against a budget of {BUDGET_HOURS:g} h: "
            f"{f'overrun by {last - BUDGET_HOURS:.1f} h' if last > BUDGET_HOURS else 'within it'}. "
            f"Tuning and the primary comparison were in after {primary:.1f} h; {late} of the {secondary_jobs} "
            "fixed-KL secondary runs came after the budget's end, where its rule would have cut the secondary "
            "(descriptive: nothing decided rests on it). The run time summed over runs is below; the rest of the "
            "wall time is the gaps between sittings.", ""]


def write_report(design: Design, results_dir: Path, results: dict[tuple, dict], choices: dict | None,
                 table: dict | None, second: dict) -> None:
    total = len(tuning_jobs(design)) + len(confirmation_jobs(design))
    hours = sum(r["run_seconds"] for r in results.values()) / 3600
    lines = ["# Study II: macro actions against a tuned token-level baseline", "",
             "Generated by `python benchmarks/credit_assignment_lambda.py --summarize` from the result files; do not "
             "edit. Design: the script's docstring and the README's Study II.", "",
             f"Runs with a result: {len(results)} of {total} ({hours:.1f} h of run time summed over the runs, "
             f"{hours / 2:.1f} h at two at a time).", "",
             *wall_clock(results_dir, sum(job[0] == "secondary" for job in confirmation_jobs(design))),
             "## Tuning (build 0, adaptive KL)", "",
             "Score: mean over the groups of (final held-out gold - SFT's held-out gold), each the mean over the tuning "
             "seeds. Chosen: highest score per family (ties: the first listed).", ""]
    tuning = [j for j in tuning_jobs(design)]
    groups = sorted({(j[1], j[2]) for j in tuning}, key=lambda g: (design.tasks.index(g[0]), g[1]))
    lines += ["| family+setting | " + " | ".join(f"{t}/{s} gold (KL)" for t, s in groups) + " | score | chosen |",
              "|---|" + "---|" * (len(groups) + 2)]
    for family, (_, settings) in design.families.items():
        for setting in settings:
            arm = f"{family}+{setting}"
            cells = []
            for group in groups:
                rs = [results[j] for j in tuning if j[3] == arm and (j[1], j[2]) == group and j in results]
                cells.append(f"{_f(np.mean([r['held_out']['gold_reward'] for r in rs]))} "
                             f"({_f(np.mean([r['curves']['objective/kl'][-1] for r in rs]), 1)}, {len(rs)} seeds)"
                             if rs else "-")
            score = choices["scores"][arm] if choices else math.nan
            chosen = "yes" if choices and choices["settings"][family] == setting else ""
            lines.append(f"| {arm} | " + " | ".join(cells) + f" | {_f(score)} | {chosen} |")
    if choices:
        lines += ["", f"Best token-level arm (TOK): **{choices['tok']}+{choices['settings'][choices['tok']]}**.", ""]
    else:
        lines += ["", "Tuning incomplete: no setting is chosen yet.", ""]
    if table:
        lines += headline(table) + kl_against_target(table)
        lines += ["## Confirmation (builds " + ", ".join(map(str, design.confirmation_builds)) + ", adaptive KL)", "",
                  "Final held-out gold: mean [95 % t-interval] over (build, seed); difference vs TOK paired by (build, "
                  "seed), 95 % t-interval, p two-sided, Holm over the groups within each arm.", ""]
        for group, entry in table["groups"].items():
            sft = ", ".join(f"build {b}: {_f(v)}" for b, v in entry["sft_gold_by_build"].items())
            lines += [f"### {group} (KL target {KL_TARGETS[tuple(group.split('/'))]:g}; SFT gold {sft})", "",
                      "| arm | runs | final gold | by build | final KL | vs TOK | by build | p (Holm) | verdict |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for arm, e in entry["arms"].items():
                setting = table["settings"].get(arm, "")
                by_build = ", ".join(_f(v) for v in e["gold_by_build"].values())
                diff_build = ", ".join(_f(v) for v in e["vs_tok_by_build"].values())
                lines.append(f"| {arm}{'+' + setting if setting else ''} | {e['n']} | {_ci(e['gold'])} | {by_build} "
                             f"| {_f(e['final_kl'], 1)} | {_ci(e['vs_tok'])} | {diff_build} "
                             f"| {_f(e['vs_tok']['p'])} ({_f(e['vs_tok'].get('p_holm', math.nan))}) "
                             f"| {finding(e['vs_tok'], e['verdict'])} |")
            lines.append("")
        d = table["decision"]
        lines += ["## Pre-registered decision", "", DECISION_RULE, "",
                  f"{'Complete.' if d['complete'] else '**Not complete: runs are missing; nothing is decided yet.**'} "
                  f"MA ahead in: {', '.join(d['ma_ahead']) or 'none'}; TOK ahead in: {', '.join(d['tok_ahead']) or 'none'}"
                  f"; no difference detected in: {', '.join(d['no_difference']) or 'none'}. Case {d['case']}: defaults "
                  f"{d['defaults']['family']}+{d['defaults']['setting']} ({d['defaults']['options']}).", ""]
    secondary_jobs = [job for job in confirmation_jobs(design) if job[0] == "secondary"]
    done = sum(job in results for job in secondary_jobs)
    if choices:
        lines += ["## Secondary: fixed kl_coef 0.05 (descriptive)", ""]
        if done < len(secondary_jobs):
            lines += [f"Running: {done} of {len(secondary_jobs)} runs; a group is shown once all its runs are in.", ""]
    if second:
        lines += ["| group | arm | runs | final gold | final KL | steps to 80 % of TOK's gain | gold at TOK's final KL "
                  "(smoothed curves) |",
                  "|---|---|---|---|---|---|---|"]
        for group, arms in second.items():
            for arm, e in arms.items():
                lines.append(f"| {group} | {arm} | {e['n']} | {_f(e['final_gold'])} | {_f(e['final_kl'], 1)} "
                             f"| {_f(e['steps_to_80'], 0)} | {_f(e['gold_at_tok_kl'])} |")
        lines.append("")
        if table:
            lines += fixed_against_adaptive(table, second)
    (results_dir / "summary.md").write_text("\n".join(lines) + "\n")
    (results_dir / "summary.json").write_text(json.dumps({"choices": choices, "confirmation": table,
                                                          "secondary": second, "runs": len(results)}, indent=1) + "\n")


def plot(design: Design, results_dir: Path, table: dict) -> Path:
    """The README's figure: per group, each arm's paired difference in final held-out gold against TOK (95 %
    t-interval), and the gold curves of TOK and MA-PPO."""
    from marlhf.evaluation.plots import pyplot

    plt = pyplot()
    groups = list(table["groups"])
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.8), squeeze=False, sharex=True,
                             layout="constrained")
    for ax, group in zip(axes[0], groups):
        arms = [a for a in table["arms"] if a != table["tok"]]
        for y, arm in enumerate(arms):
            e = table["groups"][group]["arms"][arm]["vs_tok"]
            low, high = e["ci"]
            color = {"ahead": "tab:green", "behind": "tab:red"}.get(table["groups"][group]["arms"][arm]["verdict"],
                                                                  "tab:gray")
            ax.errorbar([e["mean"]], [y], xerr=[[e["mean"] - low], [high - e["mean"]]] if not math.isnan(low) else None,
                        fmt="o", color=color)
        ax.axvline(0.0, color="black", lw=0.8)
        ax.set_yticks(range(len(arms)), arms if ax is axes[0][0] else [""] * len(arms))
        ax.set_title(group, fontsize=9)
        ax.set_xlabel(f"final gold minus {table['tok']} (95 % t)")
        ax.grid(alpha=0.3)
    fig.suptitle("Study II: paired difference in final held-out gold against the best-tuned token-level arm "
                 "(green/red: Holm-adjusted p < 0.05)", fontsize=10)
    path = results_dir / "paired_differences.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def summarize(design: Design, results_dir: Path) -> dict:
    results = load_results(results_dir)
    choices = choose_settings(design, results)
    table = compare(design, results, choices) if choices else None
    second = secondary(design, results) if choices else {}
    write_report(design, results_dir, results, choices, table, second)
    if table and any(e["arms"][MA]["vs_tok"]["n"] >= 2 for e in table["groups"].values()):
        plot(design, results_dir, table)
    return {"choices": choices, "table": table, "secondary": second}


# ---------------------------------------------------------------------------------------------- main
def _run(jobs: list[tuple], design: Design, choices: dict | None, work: Path, results: Path, workers: int) -> int:
    calls = {job: (run_job, (job, job_options(job, design, choices), str(work), str(results), design.quick))
             for job in jobs}
    return study_one.run_in_pool(calls, workers, "study II runs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench_credit_assignment_lambda", help="models and run directories")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "credit_assignment_lambda"),
                        help="one JSON per finished run, summary.md, summary.json, choices.json, figures")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--max_runs", type=int, default=None, help="stop after starting this many new runs")
    parser.add_argument("--summarize", action="store_true", help="only write the tables and figures")
    parser.add_argument("--quick", action="store_true", help="the tiny design with tiny sizes (the test's)")
    arguments = parser.parse_args(argv)
    if arguments.workers < 1:
        parser.error("--workers must be >= 1")
    design = QUICK_DESIGN if arguments.quick else DESIGN
    work, results = Path(arguments.work), Path(arguments.results)
    results.mkdir(parents=True, exist_ok=True)
    budget = math.inf if arguments.max_runs is None else arguments.max_runs
    failed = 0
    for phase in ("tuning", "confirmation"):
        done = load_results(results)
        choices = choose_settings(design, done)
        if phase == "confirmation":
            if choices is None:
                break  # tuning incomplete
            _record_choices(results, choices)
        jobs = tuning_jobs(design) if phase == "tuning" else confirmation_jobs(design)
        todo = [j for j in jobs if j not in done]
        print(f"study II {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} done, {len(todo)} to run", flush=True)
        todo = todo[: int(min(budget, len(todo)))]
        if arguments.summarize or not todo:
            continue
        budget -= len(todo)
        failed += _run(todo, design, choices, work, results, arguments.workers)
    summarize(design, results)
    print(f"wrote {results / 'summary.md'}" + (f"; {failed} runs failed (they run again next time)" if failed else ""))
    return 1 if failed else 0


def _record_choices(results: Path, choices: dict) -> None:
    """choices.json: the tuning's outcome, written once; the confirmation runs' options come from it."""
    path = results / "choices.json"
    if path.exists():
        recorded = json.loads(path.read_text())
        if {k: recorded[k] for k in ("settings", "tok")} != {k: choices[k] for k in ("settings", "tok")}:
            raise SystemExit(f"{path} disagrees with the tuning results: {recorded} vs {choices}")
        return
    path.write_text(json.dumps(choices, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
