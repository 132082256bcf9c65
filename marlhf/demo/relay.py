"""`marlhf demo --task relay`: the demo's multi-turn task (marlhf.demo.env) end to end, on CPU, with no downloads.

    tokenizer -> pretrain (the single-turn demo's) -> SFT on relay demonstrations (`relay_demonstrations`) -> on
    every seed, four methods trained on the environment's rewards (`train_ppo` with `env="relay"`, no reward model):
    turn-level MA-PPO, token-level PPO, GRPO and GiGPO over episodes -> gold return of held-out episodes ->
    summary.json, curves.png, report.md

The gold outcome is the episode's return (the share of right turns), so the training curve is the trainer's own
`objective/rm_score` (the episodes' mean return) and no reward model is trained.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from marlhf.demo.config import MAX_PROMPT_TOKENS, SAMPLES_PER_PROMPT, DemoConfig
from marlhf.demo.env import RelayEnv, RelayOptions, relay_demonstrations
from marlhf.demo.pretrain import pretrained_base
from marlhf.demo.report import (GOLD_FILE, SMOKE_TEST_NOTE, comparison_sentences, describe_method, load_method_runs,
                                plot_curves, results_table, seed_sentences, start_run, summarize, write_jsonl)
from marlhf.engines import HFEngine, model_positions
from marlhf.logging_utils import read_metrics
from marlhf.multiturn import EngineSampler, MultiTurnOptions, rollout_episodes
from marlhf.rollout import response_logprobs
from marlhf.trainers.ppo import PPOConfig, train_ppo
from marlhf.trainers.sft import SFTConfig, train_sft

TURN_TOKENS = 16  # a turn's budget: demonstrated turns are 3 words, about 10 tokens and EOS
REPLY_TOKENS = 8  # a reply is one word (up to 5 tokens) and the separator
EVAL_EPISODE_SEED = 10**6  # held-out episodes are seeds 10**6, 10**6 + 1, ...: none of training's row seeds
# Critic-free methods keep token-level ratios, as in the single-turn demo, so the estimator is the only difference.
RELAY_METHODS: dict[str, dict[str, Any]] = {
    "ma_ppo_turn": {"termination": "turn", "advantage": "gae", "value_weighting": "first"},  # GAE over turns
    "ppo": {"termination": "fixed", "ngram": 1, "advantage": "gae"},  # GAE over action tokens
    "grpo": {"termination": "fixed", "ngram": 1, "advantage": "grpo", "num_samples_per_prompt": SAMPLES_PER_PROMPT},
    "gigpo": {"termination": "fixed", "ngram": 1, "advantage": "gigpo",
              "num_samples_per_prompt": SAMPLES_PER_PROMPT},
}


def relay_options(config: DemoConfig) -> RelayOptions:
    """The environment's options of a demo configuration (3 turns, 4 relay words)."""
    return RelayOptions(task_seed=config.task_seed)


def multi_turn_options(turns: int) -> MultiTurnOptions:
    """The rollout's limits: TURN_TOKENS per turn, room for every turn and reply."""
    return MultiTurnOptions(max_turns=turns, max_turn_tokens=TURN_TOKENS,
                            max_response_tokens=turns * TURN_TOKENS + (turns - 1) * REPLY_TOKENS)


def build_relay_models(config: DemoConfig, models_dir: Path, stage_done) -> tuple[Any, Any, list[dict]]:
    """Tokenizer and base model as the single-turn demo's (same texts, same seed), then SFT on one record per turn of
    sft_records demonstration episodes. Returns (tokenizer, SFT model, SFT records)."""
    options = relay_options(config)
    clock = time.perf_counter()
    texts = RelayEnv(options).task.pretraining_texts(config.pretrain_texts, seed=0)
    tokenizer, base = pretrained_base(texts, config.task_seed, 256, models_dir / "base")
    clock = stage_done("pretrain", clock)
    records = relay_demonstrations(options, config.sft_records, seed=0, right_rate=config.relay_rate,
                                   eos=tokenizer.eos_token)
    context = MAX_PROMPT_TOKENS + multi_turn_options(options.turns).max_response_tokens
    sft = train_sft(SFTConfig(model_name_or_path=str(models_dir / "base"), output_dir=str(models_dir / "sft"),
                              overwrite_output_dir=True, learning_rate=1e-3, seed=config.task_seed, save_steps=0,
                              max_prompt_length=context, max_length=context + TURN_TOKENS + 1,
                              per_device_batch_size=32),
                    records, model=base, tokenizer=tokenizer)
    stage_done("sft", clock)
    return tokenizer, sft, records


@torch.no_grad()
def evaluate_episodes(policy, ref, tokenizer, config: DemoConfig, prompts: list[str],
                      temperature: float = 0.8) -> tuple[dict[str, float], list[dict]]:
    """Held-out episodes, one per prompt (episode seeds EVAL_EPISODE_SEED + i, the same for every method and
    seed): mean gold return, KL(policy || ref) summed over each episode's action tokens, and the share of right
    turns at each turn; plus the episodes (transcript, relayed words, turn rewards)."""
    policy.eval()
    engine = HFEngine()
    engine.sync_weights(policy)
    sampler = EngineSampler(engine, temperature=temperature, top_k=50, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    envs = [RelayEnv(relay_options(config)) for _ in prompts]
    rollout = rollout_episodes(envs, sampler, tokenizer, seeds=[EVAL_EPISODE_SEED + i for i in range(len(prompts))],
                               tasks=[{"prompt": p} for p in prompts],
                               options=multi_turn_options(envs[0].options.turns),
                               max_length=model_positions(policy), env_name="relay")
    batch = (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
    log_ratio = (response_logprobs(policy, *batch, temperature=temperature)
                 - response_logprobs(ref, *batch, temperature=temperature))
    kls = (log_ratio * rollout.action_mask).sum(1)
    returns = rollout.turn_rewards.sum(1)
    right = (rollout.turn_rewards > 0).float().mean(0).tolist()
    metrics = {"gold_reward": returns.mean().item(), "kl": kls.mean().item(),
               **{f"right_turn{k}": share for k, share in enumerate(right)}}
    samples = [{"prompt": prompt, "relayed": env.relayed, "turn_rewards": rollout.turn_rewards[b].tolist(),
                "gold_reward": returns[b].item(),
                "transcript": tokenizer.decode(rollout.response_ids[b][rollout.response_mask[b]].tolist(),
                                               skip_special_tokens=True)}
               for b, (prompt, env) in enumerate(zip(prompts, envs))]
    return metrics, samples


def run_relay_method(config: DemoConfig, sft_dir: Path, tokenizer, sft, options: dict[str, Any], seed: int,
                     run_dir: Path, rl_prompts: list[dict], eval_prompts: list[str], method: str) -> dict[str, float]:
    """One run of a method (`options`: its PPOConfig options) on the relay environment into RUN_DIR, from the SFT
    model (the critic too), then its held-out episodes. Writes metrics.jsonl, config.yaml, gold.jsonl (the training
    episodes' mean return per step) and eval_samples.jsonl; returns the held-out metrics."""
    env_options = relay_options(config)
    limits = multi_turn_options(env_options.turns)
    ppo_config = PPOConfig(
        model_name_or_path=str(sft_dir), critic_model_name_or_path=str(sft_dir), output_dir=str(run_dir),
        overwrite_output_dir=True, seed=seed, save_steps=0, max_steps=config.ppo_steps,
        per_device_batch_size=config.ppo_batch_size // options.get("num_samples_per_prompt", 1),
        mini_batch_size=config.ppo_batch_size // 2, learning_rate=config.ppo_learning_rate,
        critic_learning_rate=config.critic_learning_rate, kl_coef=config.kl_coef,
        max_prompt_length=MAX_PROMPT_TOKENS, max_response_length=limits.max_response_tokens,
        max_length=MAX_PROMPT_TOKENS + limits.max_response_tokens,
        env="relay", env_options=dataclasses.asdict(env_options), multi_turn_options=dataclasses.asdict(limits),
        **{"lam": config.lam, **options})
    policy = train_ppo(ppo_config, rl_prompts, tokenizer=tokenizer)
    write_jsonl(run_dir / GOLD_FILE, [{"step": m["step"], "gold_reward": m["objective/rm_score"]}
                                      for m in read_metrics(run_dir)])
    metrics, samples = evaluate_episodes(policy, sft, tokenizer, config, eval_prompts)
    write_jsonl(run_dir / "eval_samples.jsonl", samples)
    tqdm.write(f"[demo] {method} seed {seed}: gold {metrics['gold_reward']:.3f}, KL {metrics['kl']:.2f}, right turns "
               + ", ".join(f"{metrics[f'right_turn{k}']:.2f}" for k in range(env_options.turns)))
    return metrics


def run_relay_demo(config: DemoConfig) -> dict:
    """`marlhf demo --task relay` into `config.out`; returns the summary (also written to summary.json)."""
    start = time.perf_counter()
    out, stage_seconds, stage_done = start_run(config)
    tokenizer, sft, sft_records = build_relay_models(config, out / "models", stage_done)
    clock = time.perf_counter()
    task = RelayEnv(relay_options(config)).task
    rl_prompts = task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)
    eval_prompts = [r["prompt"] for r in task.prompts(config.eval_prompts, seed=2)]
    for name, rows in (("sft", sft_records), ("prompts", rl_prompts),
                       ("eval_prompts", [{"prompt": p} for p in eval_prompts])):
        (out / "data").mkdir(exist_ok=True)
        write_jsonl(out / "data" / f"{name}.jsonl", rows)
    sft_metrics, sft_samples = evaluate_episodes(sft, sft, tokenizer, config, eval_prompts)
    write_jsonl(out / "models" / "sft" / "eval_samples.jsonl", sft_samples)
    finals: dict[str, list[dict]] = {method: [] for method in RELAY_METHODS}
    runs = [(method, seed) for method in RELAY_METHODS for seed in config.seeds]
    for method, seed in tqdm(runs, desc="demo runs", leave=True):
        finals[method].append(run_relay_method(config, out / "models" / "sft", tokenizer, sft, RELAY_METHODS[method],
                                               seed, out / "runs" / method / f"seed{seed}", rl_prompts, eval_prompts,
                                               method))
    stage_done("ppo", clock)
    runs_by_method = {m: load_method_runs(out / "runs" / m, config.seeds, GOLD_FILE) for m in RELAY_METHODS}
    summary = summarize(runs_by_method, finals, list(config.seeds), config.curve_smoothing,
                        wall_seconds=round(time.perf_counter() - start, 1))
    summary.update(task="relay", sft=sft_metrics, stage_seconds=stage_seconds, lam=config.lam,
                   relay_rate=config.relay_rate, eval_episodes=len(eval_prompts),
                   smoke_test=config.smoke_test)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_curves(runs_by_method, out / "curves.png", config.curve_smoothing,
                held_out_gold={"SFT": sft_metrics["gold_reward"]}, keys=("gold_reward",))
    examples = {"sft": sft_samples[0], **{m: _first_sample(out, m, config.seeds[0]) for m in RELAY_METHODS}}
    (out / "report.md").write_text("\n".join(relay_report(summary, examples)) + "\n")
    tqdm.write("\n".join(["", *results_table(summary), "", *seed_sentences(summary), ""]))
    tqdm.write(f"[demo] {SMOKE_TEST_NOTE}" if config.smoke_test else f"[demo] wrote {out / 'report.md'}")
    return summary


def _first_sample(out: Path, method: str, seed: int) -> dict:
    return json.loads((out / "runs" / method / f"seed{seed}" / "eval_samples.jsonl").read_text().splitlines()[0])


def limits_sentence(summary: dict) -> str:
    """What the seeds cannot tell, in the run's own numbers."""
    seeds = len(summary["seeds"])
    return (f"What these {seeds} seed{'s' if seeds > 1 else ''} cannot tell: every run starts from one build (one "
            "tokenizer, base model and SFT model, from task seed and demonstrations fixed), so the intervals are over "
            "PPO seeds only, not over builds, demonstrations or held-out sets; an interval that holds 0 shows no "
            f"difference either way, and with {seeds} seeds a difference smaller than about the interval's half-width "
            "would not be seen. The task is tiny (a 0.5 M-parameter model, 3 turns, 4 relay words) and says nothing "
            "about large models or other environments.")


def relay_report(summary: dict, examples: dict[str, dict]) -> list[str]:
    """report.md's lines: what was run, per-seed values with intervals, comparisons with PPO, the limits, the plot,
    the table, the share of right turns, one held-out episode per model."""
    methods = summary["methods"]
    turns = sum(key.startswith("right_turn") for key in summary["sft"])
    right = [f"| {name} | " + " | ".join(f"{_mean_right(entry, summary, k):.3f}" for k in range(turns)) + " |"
             for name, entry in [("SFT (start)", None), *methods.items()]]
    return [
        "# marlhf demo --task relay: turn-level MA-PPO, token-level PPO, GRPO and GiGPO on a multi-turn task", "",
        *([f"**{SMOKE_TEST_NOTE[0].upper()}{SMOKE_TEST_NOTE[1:]}.**", ""] if summary.get("smoke_test") else []),
        "## What happened", "",
        f"Gold return of {summary['eval_episodes']} held-out episodes (the share of right turns, "
        f"in [0, 1]); the SFT model, where every method starts: {summary['sft']['gold_reward']:.3f}.", "",
        *seed_sentences(summary), "", "Against token-level PPO (paired by seed):", "",
        *comparison_sentences(summary), "", limits_sentence(summary), "",
        "Methods: " + "; ".join(f"`{m}` is {describe_method(m, 'first')}" for m in methods) + ". All train on the "
        f"environment's turn rewards (no reward model); GAE lambda `lam: {summary['lam']:g}`; grpo and gigpo sample "
        f"{SAMPLES_PER_PROMPT} episodes per prompt with token-level ratios, so a step has as many episodes.",
        f"Seeds {', '.join(str(s) for s in summary['seeds'])}; SFT demonstrations right with chance "
        f"{summary['relay_rate']:g}; wall time {summary['wall_seconds']:.0f} s (stages: "
        f"{', '.join(f'{k} {v:.0f} s' for k, v in summary['stage_seconds'].items())}).", "",
        "![gold return of the training episodes against step](curves.png)", "", "## Table", "",
        "Held-out episodes (one per prompt, temperature 0.8), mean ± std over seeds; KL summed over action tokens:", "",
        *results_table(summary), "", "Share of held-out episodes whose turn k is right (seed mean):", "",
        "| model | " + " | ".join(f"turn {k}" for k in range(turns)) + " |", "|---" * (turns + 1) + "|", *right, "",
        "## Episodes (first held-out episode, first seed)", "",
        *(f"- {name} (gold {s['gold_reward']:.2f}, relayed {' '.join(s['relayed'])}): `{s['transcript']}`"
          for name, s in examples.items()),
    ]


def _mean_right(entry: dict | None, summary: dict, turn: int) -> float:
    if entry is None:
        return summary["sft"][f"right_turn{turn}"]
    return sum(final[f"right_turn{turn}"] for final in entry["per_seed"].values()) / len(entry["per_seed"])
