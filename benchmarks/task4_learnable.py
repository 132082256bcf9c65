"""Is Task 4 (`gold="decision"`) learnable? Token-level PPO's gain in held-out gold over the SFT model in 50 steps.

    python benchmarks/task4_learnable.py                   # every run without a result file (resumes), two at a time
    python benchmarks/task4_learnable.py --summarize       # the table, from the result files only
    python benchmarks/task4_learnable.py --quick --work W --results R   # seconds: the pipeline on a toy size

Measured as Task 3's learnability was (marlhf/demo/README.md): the demo's models built once per design (tokenizer,
pre-training, SFT, reward model), then `run_method` with token-level PPO (`termination="fixed"`, `ngram=1`) per seed
and held-out gold on the demo's 128 evaluation prompts; the demo's hyper-parameters otherwise (50 steps of 32
responses, lam 1, KL 0.05). Set-ups: gold_sft = PPO optimises 4 x the gold reward, critic from the SFT model (the
primary measurement); rm_rm = PPO optimises the reward model, critic from it. A design is a `decision_rate` (the
chance an SFT demonstration's word after a marker is the clue) and a `clue_words` (how many words a prompt's
last word, the clue, is drawn from); every design tried stays in the results.

Each finished run writes RESULTS/<design>/<setup>/seed<k>.json (held-out gold of the SFT model and of the policy,
the share of right decisions and of markers, the reward model's pairwise accuracy on fresh pairs, the per-step
training gold, the git commit and whether the tree was clean) and is never run again; models and run directories
live in WORK (not committed).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import credit_assignment as study_one  # noqa: E402  (its model cache, result writer and process pool)

from marlhf.evaluation.stats import t_quantile  # noqa: E402

# Every design tried, in the order tried. rate0.3 (commit 6ac3d2e, before clue_words existed): the clue is any of the
# 48 words; its SFT model did not copy it (held-out gold 0.02, chance 1/48). clues4_rate0.3: its SFT model put clue
# words after markers but not the prompt's (held-out gold 0.086, about 0.3 / 4 + 0.7 / 48); PPO gained 0.04-0.11.
# Its seeds 2-3 were first recorded as from a dirty tree (seeds 0-1's result files, untracked, counted) and rerun.
DESIGNS = {"rate0.3": {"decision_rate": 0.3, "clue_words": None},
           "clues4_rate0.3": {"decision_rate": 0.3, "clue_words": 4},
           "clues4_rate0.6": {"decision_rate": 0.6, "clue_words": 4}}
SETUPS = study_one.SETUPS  # gold_sft (gold reward, critic from SFT), rm_rm (reward model, critic from it)
SEEDS = (0, 1, 2, 3)
TOKEN_PPO = {"termination": "fixed", "ngram": 1}
ROOT = Path(__file__).parent
DEFAULT_RESULTS = ROOT / "results" / "task4_learnable"
RM_CHECK_PAIRS = 512  # fresh preference pairs (seed 1) for the reward model's pairwise accuracy


def demo_config(design: str, setup: str, quick: bool):
    """The demo's configuration of a design and set-up (Task 4, 20-word responses, gold x 4 where PPO optimises it)."""
    from marlhf.demo.config import DemoConfig

    options = dict(out="unused", seeds=(0,), gold="decision", num_words=20, gold_reward_scale=4.0,
                   **DESIGNS[design], **SETUPS[setup])
    if quick:
        return DemoConfig.quick(**options, pretrain_texts=256, sft_records=64, preference_records=128, ppo_steps=3,
                                ppo_batch_size=8, eval_prompts=8)
    return DemoConfig(**options)


def git_state() -> dict:
    """The commit of the code that makes a result, and whether the tree had changes (untracked files included; the
    result files of this benchmark are not code, and a run's earlier results must not count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    results = DEFAULT_RESULTS.relative_to(ROOT.parent)
    changes = git("status", "--porcelain", "--", ":/", f":(top,exclude){results}")
    return {"commit": git("rev-parse", "HEAD"), "clean": changes == ""}


def decision_shares(task, samples: list[dict]) -> dict:
    """Of the responses' first 3 markers' words: the share that are the clue and the share that are any clue word
    (right / clue words near 1 / clue_words: the clue is not read from the prompt); the mean share of markers found."""
    from marlhf.demo.task import DECISIONS, decision_clue

    decisions = [(task.decision_words(s["response"]), decision_clue(s["prompt"])) for s in samples]
    found = sum(len(words) for words, _ in decisions)
    right = sum(word == clue for words, clue in decisions for word in words)
    clue_words = sum(word in task.clue_words for words, _ in decisions for word in words)
    return {"right_of_found": right / found if found else 0.0,
            "clue_words_of_found": clue_words / found if found else 0.0,
            "markers_found": found / len(samples) / DECISIONS}


def reward_model_accuracy(models, config) -> float:
    """Share of fresh preference pairs (not the reward model's) where it scores the gold-preferred response higher."""
    from marlhf.demo.pipeline import MAX_PROMPT_TOKENS, max_response_tokens
    from marlhf.evaluation.evaluate import reward_model_scores

    pairs = models.task.preference_records(RM_CHECK_PAIRS, seed=1)
    prompts = [p["prompt"] for p in pairs] * 2
    responses = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    scores = reward_model_scores(models.reward_model, models.tokenizer, prompts, responses, batch_size=64,
                                 max_prompt_length=MAX_PROMPT_TOKENS,
                                 max_length=MAX_PROMPT_TOKENS + max_response_tokens(config.num_words) + 1)
    gold = models.task.gold_rewards(prompts, responses)
    n = len(pairs)
    right = [(scores[i] > scores[n + i]) == (gold[i] > gold[n + i]) for i in range(n)]
    return sum(right) / n


def run_one(design: str, setup: str, seed: int, work: str, results: str, quick: bool) -> str:
    """One PPO run in its own process, one torch thread; writes its result file."""
    import torch

    from marlhf.demo.pipeline import GOLD_FILE, evaluate_policy, load_models, run_method

    torch.set_num_threads(1)
    state = git_state()
    config = demo_config(design, setup, quick)
    models_dir = Path(work) / "models" / design
    info = study_one.ensure_models(models_dir, config, design)
    models = load_models(config, models_dir)
    run_dir = Path(work) / "runs" / design / setup / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a run cut off midway starts again
    rl_prompts = models.task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)
    eval_prompts = [r["prompt"] for r in models.task.prompts(config.eval_prompts, seed=2)]
    # The SFT model's held-out samples exactly as the build's (seed 0), for its decision shares.
    sft_metrics, sft_samples = evaluate_policy(models.sft, models.sft, models.reward_model, models.tokenizer,
                                               models.task, eval_prompts, seed=0)
    start = time.perf_counter()
    held_out = run_method(config, models, TOKEN_PPO, seed, run_dir, rl_prompts, eval_prompts, "ppo")
    samples = study_one._read_jsonl(run_dir / "eval_samples.jsonl")
    result = {
        "design": design, "setup": setup, "seed": seed, "design_options": DESIGNS[design],
        "setup_options": SETUPS[setup], "options": TOKEN_PPO, **state,
        "hyper_parameters": {k: v for k, v in config.to_dict().items() if k not in ("out", "seeds")},
        "sft_sha256": info["sft_sha256"], "reward_sha256": info["reward_sha256"],
        "sft_held_out": {**sft_metrics, **decision_shares(models.task, sft_samples)},
        "held_out": {**held_out, **decision_shares(models.task, samples)},
        "gain": held_out["gold_reward"] - sft_metrics["gold_reward"],
        "reward_model_accuracy": reward_model_accuracy(models, config),
        "train_gold": [row["gold_reward"] for row in study_one._read_jsonl(run_dir / GOLD_FILE)],
        "run_seconds": round(time.perf_counter() - start, 1), "build_seconds": info["build_seconds"],
        "torch": torch.__version__, "quick": quick,
    }
    shutil.rmtree(run_dir)  # the policy weights are not needed again
    return str(study_one.write_result(Path(results) / design / setup / f"seed{seed}.json", result))


def interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and its t-interval (nan bounds with fewer than 2 values)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float(x.mean()), math.nan, math.nan
    half = t_quantile(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def summarize(results: Path) -> list[str]:
    """The table of every design and set-up with results, from the result files alone."""
    rows = [json.loads(path.read_text()) for path in sorted(results.glob("*/*/seed*.json"))]
    if not rows:
        raise ValueError(f"no result files under {results}")
    commits = sorted({(r["commit"][:7], r["clean"]) for r in rows})
    lines = ["| design | set-up | seeds | SFT held-out gold | PPO held-out gold (per seed) | gain [95 % t-interval] | "
             "right decisions SFT -> PPO | clue words SFT -> PPO | markers found SFT -> PPO | RM pair accuracy | KL |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for design in [d for d in DESIGNS if any(r["design"] == d for r in rows)]:
        for setup in [s for s in SETUPS if any(r["design"] == design and r["setup"] == s for r in rows)]:
            group = sorted((r for r in rows if r["design"] == design and r["setup"] == setup), key=lambda r: r["seed"])
            gain, low, high = interval([r["gain"] for r in group])
            seeds = ",".join(str(r["seed"]) for r in group)
            golds = ", ".join(f"{r['held_out']['gold_reward']:.3f}" for r in group)

            def mean(part: str, key: str) -> str:  # "-" where the files predate the key
                values = [r[part][key] for r in group if key in r[part]]
                return f"{np.mean(values):.2f}" if values else "-"

            lines.append(
                f"| {design} | {setup} | {seeds} | {group[0]['sft_held_out']['gold_reward']:.3f} | {golds} "
                f"| {gain:+.3f} [{low:+.3f}, {high:+.3f}] "
                f"| {mean('sft_held_out', 'right_of_found')} -> {mean('held_out', 'right_of_found')} "
                f"| {mean('sft_held_out', 'clue_words_of_found')} -> {mean('held_out', 'clue_words_of_found')} "
                f"| {mean('sft_held_out', 'markers_found')} -> {mean('held_out', 'markers_found')} "
                f"| {np.mean([r['reward_model_accuracy'] for r in group]):.3f} | {mean('held_out', 'kl')} |")
    lines += ["", "Commits (clean tree?): " + ", ".join(f"{c} ({'clean' if k else 'dirty'})" for c, k in commits),
              f"Mean run seconds: {np.mean([r['run_seconds'] for r in rows]):.0f} (one torch thread)"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--designs", nargs="+", choices=list(DESIGNS), default=list(DESIGNS))
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--work", default="/tmp/marlhf_task4_learnable", help="models and run directories")
    parser.add_argument("--results", default=str(DEFAULT_RESULTS))
    parser.add_argument("--workers", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: checks the pipeline, measures nothing")
    parser.add_argument("--summarize", action="store_true", help="print the table from the result files only")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if not args.summarize:
        jobs = [(design, setup, seed) for design in args.designs for setup in args.setups for seed in args.seeds]
        todo = {job: (run_one, (*job, args.work, str(results), args.quick)) for job in jobs
                if not (results / job[0] / job[1] / f"seed{job[2]}.json").exists()}
        if study_one.run_in_pool(todo, args.workers, "task4 runs"):
            return 1
    print("\n".join(summarize(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
