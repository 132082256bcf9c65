"""Study III side measurement (issue 45): what the runner's result files do not hold, measured on the study's own
models without touching the study.

    python benchmarks/credit_segments_side.py --work /work/s3work            # every task and build whose models exist
    python benchmarks/credit_segments_side.py --work W --tasks task4 --builds 2 --out /tmp/side.json

For each task and build whose models exist in WORK/models/<task>/build<b> (the runner's; a missing one is skipped
with a line, never built), it runs ONE real PPO step of each arm with the study's options (`job_options` of the
confirmation job, its set-up, its seed; the run stops after step 1 by max_generated_tokens=1) through the demo's
`run_method`, from the SFT policy, and measures:

(a) boundaries: on the same responses (MC5's and MC-LP's step 1 of one seed sample the same rollout: same SFT
    policy, prompts and row seeds; checked), the kept boundaries each arm actually continued from (the (row, prefix
    length) pairs its estimator passed to the trainer's `continue_and_score`), the share of MC-LP's kept positions
    identical to one of MC5's, the mean distance from each to the nearest MC5 kept position, and how many
    `low_prob` segments a response had before `keep_boundaries` kept 4 (the segment ids MC-LP's `macro_actions`
    stage returned, from the trainer's own log-probs);
(b) forward tokens of one step per arm, counted by forward pre-hooks on the run's models (policy, reference,
    critic, the demo reward function's reward model) while each trainer stage runs: generation (prefill + one
    position per decoded token), scoring, the estimator's Monte-Carlo continuations (prefix re-encoding = their
    prefill, their decoding, their scoring) and the update (forwards with gradients; each is followed by a
    backward over the same positions). `positions` are the tensor positions a forward processed (padding
    included: the compute); `tokens` those whose attention mask is set.

The models are copied to a temporary directory first, so nothing is written under WORK. Writes one JSON file with
the code's commit and clean flag (as the study's result files), the models' sha256 (sft_sha256/reward_sha256, as
in the study's files) and every setting. Step 1 is the SFT policy's step: later steps' responses (and so their
costs) change as the policy trains.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import credit_assignment as study_one  # noqa: E402  (demo_config, _sha256)
import credit_segments as study  # noqa: E402  (TASKS, SETUPS, DESIGN, job_options, git_state, ...)

from marlhf.segments import keep_boundaries, num_segments, segment_first_token  # noqa: E402

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "credit_segments" / "side" / "side_measurements.json"
DEFAULT_CHOICES = ROOT / "results" / "credit_segments" / "choices.json"
DEFAULT_STUDY_RESULTS = Path("/work/s3results/benchmarks/results/credit_segments")  # read only: a cross-check
STAGES = {"sample": "generation", "score": "scoring", "macro_actions": "segments",
          "estimate_advantages": "advantages", "ppo_update": "update"}  # marlhf.trainers.ppo's stage functions


# ---------------------------------------------------------------------------------------------- (a) boundaries
def kept_positions(segment_ids: torch.Tensor, max_boundaries: int) -> list[list[int]]:
    """Per row, the first-token positions of the segments `keep_boundaries` keeps (what mc_segment continues
    from). segment_ids: long [B, T], -1 on padding."""
    first = segment_first_token(keep_boundaries(segment_ids, max_boundaries))
    return [torch.nonzero(row).flatten().tolist() for row in first]


def boundaries_by_row(rows: list[int], starts: list[int], num_rows: int) -> list[list[int]]:
    """The (row, prefix length) pairs of continue_and_score calls as sorted positions per row (K copies count
    once)."""
    out: list[set[int]] = [set() for _ in range(num_rows)]
    for row, start in zip(rows, starts):
        out[row].add(int(start))
    return [sorted(s) for s in out]


def overlap(reference: list[list[int]], other: list[list[int]], skip_first: bool = False) -> dict:
    """How `other`'s kept positions (MC-LP's) sit against `reference`'s (MC5's), row by row: pooled share of
    identical positions, the per-row mean of that share, and the mean distance to the nearest reference position
    (identical ones count 0). `skip_first`: leave out position 0, which both always keep."""
    identical = total = 0
    shares, distances = [], []
    for ref, oth in zip(reference, other, strict=True):
        oth = [p for p in oth if not (skip_first and p == 0)]
        if not oth:
            continue
        hits = sum(p in set(ref) for p in oth)
        identical, total = identical + hits, total + len(oth)
        shares.append(hits / len(oth))
        distances += [min(abs(p - r) for r in ref) for p in oth] if ref else []
    return {"positions": total, "identical": identical,
            "share_identical": identical / total if total else float("nan"),
            "mean_row_share": float(np.mean(shares)) if shares else float("nan"),
            "mean_distance": float(np.mean(distances)) if distances else float("nan"),
            "median_distance": float(np.median(distances)) if distances else float("nan")}


def spread(values: list[float]) -> dict:
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def boundary_summary(mc5: list[list[int]], lp: list[list[int]], lp_segments: list[int], lengths: list[int],
                     max_boundaries: int) -> dict:
    """Part (a) for a set of responses: MC-LP's kept positions against MC5's, all and without token 0, and how
    many low_prob segments the responses had before keeping `max_boundaries`."""
    return {"responses": len(lengths), "response_tokens": spread(lengths),
            "mc5_kept": spread([len(r) for r in mc5]), "mc_lp_kept": spread([len(r) for r in lp]),
            "overlap": overlap(mc5, lp), "overlap_without_token0": overlap(mc5, lp, skip_first=True),
            "low_prob_segments_before_keeping": spread(lp_segments),
            "share_rows_over_max": float(np.mean([n > max_boundaries for n in lp_segments]))}


# ---------------------------------------------------------------------------------------------- (b) forward tokens
def forward_kind(stage: str, role: str, width: int, grad: bool) -> str:
    """What a forward is: `train` (with gradients: a backward follows), the policy's `prefill` (a generate call's
    first forward over prompt or prefix: in the advantages stage, the continuations' prefix re-encoding) and
    `decode` (one position per row per sampled token), or a plain scoring `forward`."""
    if grad:
        return "train"
    if role == "policy" and stage in ("generation", "advantages"):
        return "prefill" if width > 1 else "decode"
    return "forward"


@dataclasses.dataclass
class ForwardCounter:
    """Forwards, positions (padding included) and tokens (attention mask set) by "stage/model/kind", from
    forward pre-hooks on the run's top-level models; counts only while a trainer stage runs."""
    stage: str | None = None
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def hook(self, role: str) -> Callable:
        def pre_hook(module, args, kwargs):
            if self.stage is None:
                return None
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            if ids is None:  # these runs always pass input_ids; anything else would go uncounted
                raise ValueError(f"a forward of the {role} without input_ids")
            width = ids.shape[1]
            key = f"{self.stage}/{role}/{forward_kind(self.stage, role, width, torch.is_grad_enabled())}"
            entry = self.counts.setdefault(key, {"forwards": 0, "positions": 0, "tokens": 0})
            entry["forwards"] += 1
            entry["positions"] += ids.numel()
            # with a KV cache the mask covers the cached columns too: the new positions are its last `width`
            entry["tokens"] += int(mask[:, -width:].sum()) if mask is not None else ids.numel()
            return None
        return pre_hook


@contextlib.contextmanager
def instrumented(counter: ForwardCounter, capture: dict, reward_model: torch.nn.Module) -> Iterator[None]:
    """Within: marlhf's PPO stages set `counter.stage` and leave their Experience in `capture[stage function]`;
    the run's models get the counter's hooks as build_models makes them (the demo reward function's reward model
    as `reward_model`); continue_and_score's (rows, prefix lengths, k) go to capture["continue"]; the demo's
    held-out evaluation after training is skipped (not part of a step)."""
    import marlhf.demo.pipeline as pipeline
    import marlhf.trainers.continuations as continuations
    import marlhf.trainers.ppo as ppo

    saved = {name: getattr(ppo, name) for name in (*STAGES, "build_models")}
    saved_call, saved_eval = continuations.PrefixContinuations.__call__, pipeline.evaluate_run
    hooked: dict[int, str] = {id(reward_model): "reward_model"}
    handles = [reward_model.register_forward_pre_hook(counter.hook("reward_model"), with_kwargs=True)]

    def staged(name: str) -> Callable:
        def run_stage(*args, **kwargs):
            counter.stage = STAGES[name]
            try:
                capture[name] = out = saved[name](*args, **kwargs)
            finally:
                counter.stage = None
            return out
        return run_stage

    def build_models(*args, **kwargs):
        models = saved["build_models"](*args, **kwargs)
        for role in ("policy", "ref", "critic", "reward_model"):
            model = getattr(models, role)
            if isinstance(model, torch.nn.Module) and id(model) not in hooked:
                hooked[id(model)] = role
                handles.append(model.register_forward_pre_hook(counter.hook(role), with_kwargs=True))
        return models

    def continue_and_score(self, rows, prefix_lengths, k):
        capture.setdefault("continue", []).append((rows.tolist(), prefix_lengths.tolist(), int(k)))
        return saved_call(self, rows, prefix_lengths, k)

    for name in STAGES:
        setattr(ppo, name, staged(name))
    ppo.build_models, continuations.PrefixContinuations.__call__ = build_models, continue_and_score
    pipeline.evaluate_run = lambda *args, **kwargs: {}
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ppo, name, fn)
        continuations.PrefixContinuations.__call__, pipeline.evaluate_run = saved_call, saved_eval
        for handle in handles:
            handle.remove()


def cost_summary(counts: dict[str, dict[str, int]], rollout_tokens: int, mc_tokens: int) -> dict:
    """One step's forward positions and tokens by stage (generation, scoring, Monte-Carlo continuations split into
    prefix re-encoding, decoding and scoring, update) and in all; backward = the update's positions; per token of
    the rollout (policy-sampled) and per token of the study's budget (rollout + continuations)."""
    def total(match: Callable[[str, str, str], bool]) -> dict:
        keys = [k for k in counts if match(*k.split("/"))]
        return {m: sum(counts[k][m] for k in keys) for m in ("forwards", "positions", "tokens")}

    parts = {"generation": total(lambda s, r, k: s == "generation"),
             "scoring": total(lambda s, r, k: s == "scoring"),
             "mc_prefix_reencoding": total(lambda s, r, k: s == "advantages" and k == "prefill"),
             "mc_decoding": total(lambda s, r, k: s == "advantages" and k == "decode"),
             "mc_scoring": total(lambda s, r, k: s == "advantages" and k == "forward"),
             "update_forward": total(lambda s, r, k: s == "update")}
    every = total(lambda s, r, k: True)
    backward = total(lambda s, r, k: k == "train")
    budget = rollout_tokens + mc_tokens
    return {"rollout_tokens": rollout_tokens, "mc_tokens": mc_tokens, "parts": parts,
            "forward": every, "backward": backward,
            "forward_positions_per_rollout_token": every["positions"] / rollout_tokens,
            "forward_tokens_per_rollout_token": every["tokens"] / rollout_tokens,
            "forward_positions_per_budget_token": every["positions"] / budget,
            "forward_tokens_per_budget_token": every["tokens"] / budget,
            "backward_positions_per_rollout_token": backward["positions"] / rollout_tokens}


# ---------------------------------------------------------------------------------------------- one step
def one_step(config, models, job: tuple, choices: dict, run_dir: Path) -> dict:
    """Step 1 of `job`'s run (the runner's options, no token budget, stopped after one step), instrumented:
    its options, seconds, costs and what part (a) needs (responses, the rule's segment ids, the kept
    boundaries the estimator continued from)."""
    from marlhf.demo.pipeline import run_method

    phase, task, setup, arm, build, seed = job
    options = {**study.job_options(job, study.DESIGN, choices, None), "max_generated_tokens": 1}
    counter, capture = ForwardCounter(), {}
    rl_prompts = models.task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)  # as execute_run
    start = time.perf_counter()
    with instrumented(counter, capture, models.reward_model):
        run_method(config, models, options, seed, run_dir, rl_prompts, [], arm)
    seconds = time.perf_counter() - start
    shutil.rmtree(run_dir, ignore_errors=True)
    experience = capture["estimate_advantages"]
    segments = capture["macro_actions"].segment_ids
    calls = capture.get("continue", [])
    rows = [r for c in calls for r in c[0]]
    starts = [s for c in calls for s in c[1]]
    return {"job": list(job), "options": options, "step_seconds": round(seconds, 2), "counts": counter.counts,
            "cost": cost_summary(counter.counts, int(experience.actions.sum()),
                                 int(experience.continuation_tokens or 0)),
            "segments_per_response": spread(num_segments(segments).tolist()),
            "mc_samples": sorted({c[2] for c in calls}),
            "_response_ids": experience.response_ids, "_response_mask": experience.response_mask,
            "_segment_ids": segments,
            "_kept": boundaries_by_row(rows, starts, segments.shape[0]) if calls else None}


def compare_boundaries(mc5: dict, mc_lp: dict) -> dict:
    """Part (a) from MC5's and MC-LP's step 1 of one seed: same responses (checked), kept positions from their
    continue_and_score calls (checked against keep_boundaries of their segment ids)."""
    same = torch.equal(mc5["_response_ids"], mc_lp["_response_ids"]) and torch.equal(
        mc5["_response_mask"], mc_lp["_response_mask"])
    if not same:
        raise RuntimeError(f"MC5's and MC-LP's step 1 sampled different responses: {mc5['job']} {mc_lp['job']}")
    max_kept = mc_lp["options"]["advantage_options"]["max_boundaries"]
    checks = {name: kept_positions(run["_segment_ids"], max_kept) == run["_kept"]
              for name, run in (("MC5", mc5), ("MC-LP", mc_lp))}
    lengths = mc5["_response_mask"].sum(1).tolist()
    summary = boundary_summary(mc5["_kept"], mc_lp["_kept"], num_segments(mc_lp["_segment_ids"]).tolist(), lengths,
                               max_kept)
    return {**summary, "same_responses": same, "kept_match_keep_boundaries": checks,
            "rows": {"mc5_kept": mc5["_kept"], "mc_lp_kept": mc_lp["_kept"],
                     "low_prob_segments": num_segments(mc_lp["_segment_ids"]).tolist(), "lengths": lengths}}


def public(step: dict) -> dict:
    return {k: v for k, v in step.items() if not k.startswith("_")}


def study_cross_check(study_results: Path, task: str, setup: str, build: int, seed: int, step: dict,
                      info: dict) -> dict | None:
    """The study's own TOK run of this task, set-up, build and seed, if its result file is there: its step 1
    rollout tokens against this step's, and its models' hashes against these."""
    path = study.result_path(study_results, ("confirmation", task, setup, "TOK", build, seed))
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    study_tokens = result["curves"]["rollout/tokens"][0]
    return {"file": str(path), "commit": result["commit"], "study_step1_rollout_tokens": study_tokens,
            "side_step1_rollout_tokens": step["cost"]["rollout_tokens"],
            "rollout_tokens_match": study_tokens == step["cost"]["rollout_tokens"],
            "models_match": (result["sft_sha256"], result["reward_sha256"]) == (info["sft_sha256"],
                                                                                 info["reward_sha256"])}


# ---------------------------------------------------------------------------------------------- per build, main
def model_hashes(models_dir: Path) -> dict:
    """sha256 of the SFT and reward weights (the study's sft_sha256/reward_sha256), checked against the build's
    models.json."""
    info = json.loads((models_dir / "models.json").read_text())
    hashes = {"sft_sha256": study_one._sha256(models_dir / "sft" / "model.safetensors"),
              "reward_sha256": study_one._sha256(models_dir / "reward" / "model.safetensors")}
    if hashes != {k: info[k] for k in hashes}:
        raise RuntimeError(f"{models_dir}: the weights' sha256 differ from models.json's")
    return {**hashes, "sft_held_out": info["sft_held_out"]}


def measure_build(task: str, build: int, models_dir: Path, arguments, choices: dict) -> dict:
    """Every set-up's step 1 of every arm (cost seed), MC5 and MC-LP also at the other seeds (boundaries), on a
    temporary copy of the build's models."""
    from marlhf.demo.pipeline import load_models

    info = model_hashes(models_dir)
    out = {"models_dir": str(models_dir), **info, "setups": {}}
    with tempfile.TemporaryDirectory(prefix="side-") as tmp:
        copy = Path(tmp) / "models"
        for part in ("sft", "reward"):  # nothing is ever written under WORK
            shutil.copytree(models_dir / part, copy / part, ignore=shutil.ignore_patterns(".marlhf.lock"))
        for setup in arguments.setups:
            config = study_one.demo_config(task, setup, False, tasks=study.TASKS,
                                           task_seed=study.FIRST_TASK_SEED + build)
            models = load_models(config, copy)
            steps, boundaries = {}, {}
            for seed in arguments.seeds:
                arms = arguments.arms if seed == arguments.seeds[0] else [a for a in arguments.arms
                                                                           if a in ("MC5", "MC-LP")]
                for arm in arms:
                    job = ("confirmation", task, setup, arm, build, seed)
                    steps[(arm, seed)] = one_step(config, models, job, choices, Path(tmp) / "run")
                    print(f"  {task} build{build} {setup} {arm} seed{seed}: "
                          f"{steps[(arm, seed)]['step_seconds']} s", flush=True)
                if ("MC5", seed) in steps and ("MC-LP", seed) in steps:
                    boundaries[seed] = compare_boundaries(steps[("MC5", seed)], steps[("MC-LP", seed)])
            out["setups"][setup] = setup_summary(steps, boundaries, arguments, task, setup, build, info)
    return out


def setup_summary(steps: dict, boundaries: dict, arguments, task: str, setup: str, build: int, info: dict) -> dict:
    """Part (a) pooled over the seeds' responses, per seed beside it; part (b) at the cost seed; every step."""
    pooled = None
    if boundaries:
        rows = [b["rows"] for b in boundaries.values()]
        cat = {k: [x for r in rows for x in r[k]] for k in rows[0]}
        mc_lp = next(s for (a, _), s in steps.items() if a == "MC-LP")
        max_kept = mc_lp["options"]["advantage_options"]["max_boundaries"]
        pooled = boundary_summary(cat["mc5_kept"], cat["mc_lp_kept"], cat["low_prob_segments"], cat["lengths"],
                                  max_kept)
    seed = arguments.seeds[0]
    tok = steps.get(("TOK", seed))
    return {"boundaries": pooled, "boundaries_by_seed": boundaries,
            "cost": {arm: steps[(arm, seed)]["cost"] for arm in arguments.arms if (arm, seed) in steps},
            "cross_check": study_cross_check(Path(arguments.study_results), task, setup, build, seed, tok, info)
            if tok else None,
            "steps": [public(s) for s in steps.values()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="the study's WORK (models read from WORK/models; read only)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--choices", default=str(DEFAULT_CHOICES), help="the study's choices.json")
    parser.add_argument("--study_results", default=str(DEFAULT_STUDY_RESULTS),
                        help="the study's result files, for the step-1 cross-check (read only; skipped if absent)")
    parser.add_argument("--tasks", nargs="+", default=list(study.TASKS))
    parser.add_argument("--builds", nargs="+", type=int, default=list(study.DESIGN.confirmation_builds))
    parser.add_argument("--setups", nargs="+", default=["gold_sft"],
                        help="step 1's responses and counts do not depend on the set-up (see the result's notes)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[10, 11],
                        help="the first: every arm's cost step; all: MC5's and MC-LP's (boundaries, 32 responses each)")
    parser.add_argument("--arms", nargs="+", default=list(study.ARMS))
    arguments = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the study's runs
    state = study.git_state(ROOT)
    choices = json.loads(Path(arguments.choices).read_text())
    builds, started = {}, time.perf_counter()
    for task in arguments.tasks:
        for build in arguments.builds:
            models_dir = Path(arguments.work) / "models" / task / f"build{build}"
            if not (models_dir / "models.json").exists():
                print(f"skipped {task} build{build}: no models in {models_dir}", flush=True)
                continue
            builds[f"{task}/build{build}"] = measure_build(task, build, models_dir, arguments, choices)
    write(arguments, state, choices, builds, time.perf_counter() - started)
    return 0


NOTES = [
    "Step 1 of each arm from the SFT policy (the study's runs' first step): the trained policies' responses, and so "
    "their lengths, boundaries and costs, change over a run.",
    "Forward counts: pre-hooks on the top-level models while each trainer stage runs (marlhf at this file's commit, "
    "not the runner's 1469690; cross_check compares step 1's rollout tokens with the study's TOK file where present).",
    "positions: tensor positions a forward processed, padding included (the compute); tokens: positions whose "
    "attention mask is set. Decoding counts one position per row per generated column, finished rows included.",
    "Update forwards run with gradients: each is followed by a backward over the same positions (`backward`).",
    "The demo's reward function always runs the reward model (gold_sft: for its logged rm_reward; rm_rm: as the "
    "reward), on the rollout and on every Monte-Carlo continuation; the gold reward itself is a Python function.",
    "gold_sft and rm_rm sample the same step-1 responses and run the same forwards (both set-ups have a critic and "
    "run the reward model; checked on task4 build2, TOK, MC5 and GRPO: identical counts); only gold_sft is "
    "measured unless --setups says otherwise.",
    "step_seconds: one step on a core shared with other work, the demo's model loading inside it: indicative only; "
    "the study's result files hold the runs' wall time.",
    "share_identical counts position 0, which MC5 and MC-LP always both keep; overlap_without_token0 leaves it out.",
]


def write(arguments, state: dict, choices: dict, builds: dict, seconds: float) -> Path:
    out = Path(arguments.out)
    config = study_one.demo_config(arguments.tasks[0], arguments.setups[0], False, tasks=study.TASKS)
    result = {**state, "script": "benchmarks/credit_segments_side.py", "argv": sys.argv[1:],
              "settings": {"tasks": arguments.tasks, "builds": arguments.builds, "setups": arguments.setups,
                           "seeds": arguments.seeds, "cost_seed": arguments.seeds[0], "arms": arguments.arms,
                           "choices": choices["settings"], "task_options": {t: study.TASKS[t] for t in arguments.tasks},
                           "demo_hyper_parameters": {k: v for k, v in config.to_dict().items()
                                                     if k not in ("out", "seeds", "task_seed")},
                           "work": arguments.work},
              "notes": NOTES, "builds": builds, "seconds": round(seconds, 1),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "machine": platform.machine(), "torch_threads": torch.get_num_threads()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    sys.exit(main())
