"""`marlhf demo`: the whole MA-RLHF pipeline on the synthetic task, on CPU, in minutes, with no downloads.

    tokenizer -> pretrain -> SFT -> reward model -> PPO (n=1) and MA-PPO (n=5, more with `terminations`),
    with `methods` also RLOO / GRPO / REINFORCE (the PPO loop without a critic) and DPO (on the reward model's
    preference pairs), on every seed -> gold and reward-model reward on held-out prompts -> summary.json,
    curves.png, report.md

PPO is the repository's `train_ppo`. It is given a reward function that scores with the trained reward
model (what PPO optimises, exactly as `marlhf evaluate` scores; `reward="gold"`: the gold reward itself,
scaled) and, on the side, records the gold reward of the same responses (what we judge by): that is where the
per-step gold curves come from. `build_models` and `run_method` are the two halves, also used by
`benchmarks/credit_assignment.py`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from marlhf.demo.config import GROUP_METHODS, MAX_PROMPT_TOKENS, SAMPLES_PER_PROMPT, DemoConfig, parse_termination
from marlhf.demo.pretrain import pretrained_base
from marlhf.demo.relay import run_relay_demo
from marlhf.demo.report import (GOLD_FILE, SMOKE_TEST_NOTE, comparison_sentences, load_method_runs, plot_curves, results_table,
                                 start_run, summarize, write_jsonl, write_report)
from marlhf.demo.task import SyntheticTask, TaskConfig
from marlhf.evaluation.evaluate import reward_model_scores, sampled_batches
from marlhf.modeling import ScalarHeadModel, load_causal_lm, load_tokenizer
from marlhf.rollout import response_logprobs
from marlhf.trainers.dpo import DPOConfig, train_dpo
from marlhf.trainers.ppo import PPOConfig, train_ppo
from marlhf.trainers.reward import RewardConfig, train_reward_model
from marlhf.trainers.sft import SFTConfig, train_sft

TOKENS_PER_WORD = 4.8  # response budget per word: 20-word demonstrations are 49-79 tokens (64 on average)


def max_response_tokens(num_words: int) -> int:
    """Sampling budget for responses of `num_words` words (96 for the demo's 20)."""
    return round(TOKENS_PER_WORD * num_words)


class RewardWithGold:
    """`reward_fn` for train_ppo: returns the reward model's scores (`gold_scale` None) or the gold reward times
    `gold_scale`, and keeps, per PPO step, the mean gold and reward-model reward of the step's responses: of its
    first call in the step, the rollout's (Monte-Carlo continuations are scored by later calls); `end_step()` after
    each step."""

    def __init__(self, reward_model: ScalarHeadModel, tokenizer, task: SyntheticTask,
                 gold_scale: float | None = None) -> None:
        self.reward_model, self.tokenizer, self.task, self.gold_scale = reward_model, tokenizer, task, gold_scale
        self.max_response_tokens = max_response_tokens(task.config.num_words)
        self.rows: list[dict[str, float]] = []
        self.in_step = False  # the step's rollout has been scored

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        scores = reward_model_scores(self.reward_model, self.tokenizer, prompts, responses,
                                     batch_size=len(prompts), max_prompt_length=MAX_PROMPT_TOKENS,
                                     max_length=MAX_PROMPT_TOKENS + self.max_response_tokens + 1)
        gold = self.task.gold_rewards(prompts, responses)
        if not self.in_step:
            self.rows.append({"step": len(self.rows) + 1, "gold_reward": sum(gold) / len(gold),
                              "rm_reward": sum(scores) / len(scores)})
            self.in_step = True
        return scores if self.gold_scale is None else [self.gold_scale * g for g in gold]

    def end_step(self, *_) -> None:
        self.in_step = False


@torch.no_grad()
def evaluate_policy(policy, ref, reward_model: ScalarHeadModel, tokenizer, task: SyntheticTask, prompts: list[str],
                    *, seed: int, temperature: float = 0.8,
                    batch_size: int = 64) -> tuple[dict[str, float], list[dict]]:
    """Mean gold reward, reward-model score and KL(policy || ref) (summed over each response's tokens) of one
    sampled response per prompt, plus the samples themselves."""
    torch.manual_seed(seed)
    policy.eval()
    samples, kls = [], []
    for batch, responses in sampled_batches(policy, tokenizer, prompts, batch_size=batch_size,
                                            max_prompt_length=MAX_PROMPT_TOKENS,
                                            max_new_tokens=max_response_tokens(task.config.num_words),
                                            temperature=temperature, top_k=50, top_p=1.0):
        log_ratio = (response_logprobs(policy, *batch, temperature=temperature)
                     - response_logprobs(ref, *batch, temperature=temperature))
        kls += log_ratio.sum(1).tolist()
        samples += [{"prompt": p, "response": r} for p, r in zip(prompts[len(samples):], responses)]
    responses = [s["response"] for s in samples]
    gold = task.gold_rewards(prompts, responses)
    scores = reward_model_scores(reward_model, tokenizer, prompts, responses, batch_size=batch_size,
                                 max_prompt_length=MAX_PROMPT_TOKENS,
                                 max_length=MAX_PROMPT_TOKENS + max_response_tokens(task.config.num_words) + 1)
    for sample, g, s in zip(samples, gold, scores):
        sample.update(gold_reward=g, rm_reward=s)
    metrics = {"gold_reward": sum(gold) / len(gold), "rm_reward": sum(scores) / len(scores), "kl": sum(kls) / len(kls)}
    return metrics, samples


def critic_free_options(method: str) -> dict[str, Any]:
    """PPOConfig options of a critic-free baseline: its advantage estimator, groups of SAMPLES_PER_PROMPT
    responses for rloo and grpo, and token-level ratios (ngram=1) as the ppo method, so that the advantage
    estimator is the only difference."""
    samples = SAMPLES_PER_PROMPT if method in GROUP_METHODS else 1
    return {"termination": "fixed", "ngram": 1, "advantage": method, "num_samples_per_prompt": samples}


def evaluate_run(policy, sft, reward_model: ScalarHeadModel, tokenizer, task: SyntheticTask, prompts: list[str],
                 run_dir: Path, method: str, seed: int) -> dict[str, float]:
    """Held-out evaluation of a trained policy; writes its samples to RUN_DIR/eval_samples.jsonl."""
    metrics, samples = evaluate_policy(policy, sft, reward_model, tokenizer, task, prompts, seed=seed)
    write_jsonl(run_dir / "eval_samples.jsonl", samples)
    tqdm.write(f"[demo] {method} seed {seed}: gold {metrics['gold_reward']:.3f}, "
               f"RM {metrics['rm_reward']:.3f}, KL {metrics['kl']:.2f}")
    return metrics


def write_data(config: DemoConfig, task: SyntheticTask, preference_records: list[dict], rl_prompts: list[dict],
               eval_prompts: list[str], data_dir: Path) -> None:
    """The demo's records as the commands read them (`--dataset DIR/sft.jsonl` ...): SFT demonstrations,
    preference pairs (reward model, DPO), PPO prompts and the held-out prompts, in the stages' schemas."""
    data_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(data_dir / "sft.jsonl", task.sft_records(config.sft_records, seed=0))
    write_jsonl(data_dir / "preferences.jsonl", preference_records)
    write_jsonl(data_dir / "prompts.jsonl", rl_prompts)
    write_jsonl(data_dir / "eval_prompts.jsonl", [{"prompt": prompt} for prompt in eval_prompts])


def run_demo(config: DemoConfig) -> dict:
    """Run the demo into `config.out` and return the summary (also written to summary.json)."""
    threads = torch.get_num_threads()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        return (run_relay_demo if config.task == "relay" else _run_demo)(config)
    finally:
        torch.set_num_threads(threads)


@dataclasses.dataclass
class DemoModels:
    """What every PPO run of a task starts from: the task, tokenizer, SFT model and frozen reward model (with
    their directories) and the reward model's preference pairs (also DPO's)."""

    task: SyntheticTask
    tokenizer: Any
    sft: Any
    reward_model: ScalarHeadModel
    sft_dir: Path
    reward_dir: Path
    preference_records: list[dict]


def demo_task(config: DemoConfig) -> SyntheticTask:
    """The synthetic task of a demo configuration."""
    return SyntheticTask(TaskConfig(seed=config.task_seed, num_words=config.num_words, gold=config.gold,
                                    decision_rate=config.decision_rate, clue_words=config.clue_words))


def build_models(config: DemoConfig, models_dir: Path, stage_done=None) -> DemoModels:
    """Tokenizer -> pretrain -> SFT -> reward model, saved under MODELS_DIR/{base,sft,reward}.
    `stage_done(name, since) -> now` is called after each stage (timing and a line of progress)."""
    stage_done = stage_done or (lambda name, since: time.perf_counter())
    clock = time.perf_counter()
    task = demo_task(config)
    response_tokens = max_response_tokens(config.num_words)
    tokenizer, base = pretrained_base(task.pretraining_texts(config.pretrain_texts, seed=0), config.task_seed,
                                      max(256, MAX_PROMPT_TOKENS + response_tokens + 1), models_dir / "base")
    clock = stage_done("pretrain", clock)

    common = dict(seed=config.task_seed, save_steps=0, max_prompt_length=MAX_PROMPT_TOKENS,
                  max_length=MAX_PROMPT_TOKENS + response_tokens + 1, per_device_batch_size=32)
    sft_dir, reward_dir = models_dir / "sft", models_dir / "reward"
    sft = train_sft(SFTConfig(model_name_or_path=str(models_dir / "base"), output_dir=str(sft_dir),
                              overwrite_output_dir=True,
                              learning_rate=1e-3, **common),
                    task.sft_records(config.sft_records, seed=0), model=base, tokenizer=tokenizer)
    clock = stage_done("sft", clock)
    preference_records = task.preference_records(config.preference_records, seed=0)
    reward_model = train_reward_model(
        RewardConfig(model_name_or_path=str(sft_dir), output_dir=str(reward_dir), overwrite_output_dir=True,
                     learning_rate=1e-3, eval_steps=0,
                     **common),
        preference_records, tokenizer=tokenizer)
    reward_model.requires_grad_(False).eval()
    stage_done("reward model", clock)
    return DemoModels(task, tokenizer, sft, reward_model, sft_dir, reward_dir, preference_records)


def load_models(config: DemoConfig, models_dir: Path) -> DemoModels:
    """The models `build_models(config, models_dir)` saved, read back."""
    task = demo_task(config)
    sft_dir, reward_dir = models_dir / "sft", models_dir / "reward"
    tokenizer = load_tokenizer(str(sft_dir), "left")
    sft = load_causal_lm(str(sft_dir)).eval()
    reward_model = ScalarHeadModel.from_pretrained(reward_dir).requires_grad_(False).eval()
    preference_records = task.preference_records(config.preference_records, seed=0)
    return DemoModels(task, tokenizer, sft, reward_model, sft_dir, reward_dir, preference_records)


def run_method(config: DemoConfig, models: DemoModels, options: dict[str, Any], seed: int, run_dir: Path,
               rl_prompts: list[dict], eval_prompts: list[str], method: str, after_step=None) -> dict[str, float]:
    """One PPO run (`options`: PPOConfig options of the method) into RUN_DIR, then its held-out evaluation.
    Writes metrics.jsonl, config.yaml, gold.jsonl and eval_samples.jsonl; returns the held-out metrics.
    `after_step`: train_ppo's hook after each step (evaluations during training)."""
    reward_fn = RewardWithGold(models.reward_model, models.tokenizer, models.task,
                               config.gold_reward_scale if config.reward == "gold" else None)
    # Responses per step are the same for every method: groups of k samples take ppo_batch_size / k prompts.
    prompts_per_step = config.ppo_batch_size // options.get("num_samples_per_prompt", 1)
    response_tokens = max_response_tokens(config.num_words)
    ppo_config = PPOConfig(
        model_name_or_path=str(models.sft_dir), reward_model_name_or_path=str(models.reward_dir),
        output_dir=str(run_dir), overwrite_output_dir=True, seed=seed, save_steps=0,
        per_device_batch_size=prompts_per_step, mini_batch_size=config.ppo_batch_size // 2,
        learning_rate=config.ppo_learning_rate, critic_learning_rate=config.critic_learning_rate,
        kl_coef=config.kl_coef,
        critic_model_name_or_path=str(models.sft_dir if config.critic_init == "sft" else models.reward_dir),
        max_prompt_length=MAX_PROMPT_TOKENS, max_response_length=response_tokens,
        max_length=MAX_PROMPT_TOKENS + response_tokens,
        **{"max_steps": config.ppo_steps, "lam": config.lam, "value_weighting": config.value_weighting,
           "segment_weighting": config.segment_weighting, **options})  # a method's options win
    def step_done(*state) -> None:
        reward_fn.end_step()
        if after_step is not None:
            after_step(*state)

    policy = train_ppo(ppo_config, rl_prompts, tokenizer=models.tokenizer, reward_fn=reward_fn, after_step=step_done)
    write_jsonl(run_dir / GOLD_FILE, reward_fn.rows)
    return evaluate_run(policy, models.sft, models.reward_model, models.tokenizer, models.task, eval_prompts,
                        run_dir, method, seed)


def _run_demo(config: DemoConfig) -> dict:
    start = time.perf_counter()
    out, stage_seconds, stage_done = start_run(config)

    # ---- data, tokenizer, base model, SFT and reward model (the repository's trainers) ---------------
    models = build_models(config, out / "models", stage_done)
    task, tokenizer, sft, reward_model = models.task, models.tokenizer, models.sft, models.reward_model
    preference_records = models.preference_records  # also DPO's pairs
    clock = time.perf_counter()

    # ---- PPO, MA-PPO and the PPO-loop baselines on every seed -----------------------------------
    methods = {"ppo": {"termination": "fixed", "ngram": 1}, "ma_ppo": {"termination": "fixed", "ngram": 5}}
    methods.update(parse_termination(spec) for spec in config.terminations)
    methods.update((name, critic_free_options(name)) for name in config.methods if name != "dpo")
    rl_prompts = task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)
    eval_prompts = [r["prompt"] for r in task.prompts(config.eval_prompts, seed=2)]
    write_data(config, task, preference_records, rl_prompts, eval_prompts, out / "data")
    sft_metrics, sft_samples = evaluate_policy(sft, sft, reward_model, tokenizer, task, eval_prompts, seed=0)
    write_jsonl(out / "models" / "sft" / "eval_samples.jsonl", sft_samples)
    finals: dict[str, list[dict]] = {method: [] for method in methods}
    runs = [(method, seed) for method in methods for seed in config.seeds]
    for method, seed in tqdm(runs, desc="demo runs", leave=True):
        finals[method].append(run_method(config, models, methods[method], seed, out / "runs" / method / f"seed{seed}",
                                         rl_prompts, eval_prompts, method))
    clock = stage_done("ppo", clock)

    if "dpo" in config.methods:
        finals["dpo"] = _run_dpo(config, models, eval_prompts, out)
        clock = stage_done("dpo", clock)

    # ---- summary, plot, report -------------------------------------------------------------
    runs_by_method = {method: load_method_runs(out / "runs" / method, config.seeds, GOLD_FILE) for method in methods}
    summary = summarize(runs_by_method, finals, list(config.seeds), config.curve_smoothing,
                        wall_seconds=round(time.perf_counter() - start, 1))
    summary["sft"] = sft_metrics
    summary["stage_seconds"] = stage_seconds
    summary["value_weighting"] = config.value_weighting  # MA-PPO's segment values: not the paper's by default
    summary["lam"] = config.lam  # GAE lambda: not the paper's by default either
    summary["smoke_test"] = config.smoke_test
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_report(config, out, summary, runs_by_method, sft_samples, task)
    return summary


def _run_dpo(config: DemoConfig, models, eval_prompts: list[str], out: Path) -> list[dict]:
    """DPO on the reward model's preference pairs, one run per seed: as many optimizer updates as a PPO run (two per
    step), each on ppo_batch_size / 2 pairs. Returns each run's final evaluation."""
    finals = []
    for seed in tqdm(config.seeds, desc="dpo runs", leave=True):
        run_dir = out / "runs" / "dpo" / f"seed{seed}"
        dpo_config = DPOConfig(
            model_name_or_path=str(models.sft_dir), output_dir=str(run_dir), overwrite_output_dir=True,
            seed=seed, save_steps=0,
            max_steps=2 * config.ppo_steps, per_device_batch_size=config.ppo_batch_size // 2,
            learning_rate=config.dpo_learning_rate, max_prompt_length=MAX_PROMPT_TOKENS,
            max_length=MAX_PROMPT_TOKENS + max_response_tokens(config.num_words) + 1)
        policy = train_dpo(dpo_config, models.preference_records, tokenizer=models.tokenizer)
        finals.append(evaluate_run(policy, models.sft, models.reward_model, models.tokenizer, models.task,
                                   eval_prompts, run_dir, "dpo", seed))
    return finals


def _write_report(config: DemoConfig, out: Path, summary: dict, runs_by_method: dict, sft_samples: list[dict],
                  task) -> None:
    """The curves, report.md and the results table on the terminal."""
    held_out_gold = {"SFT": summary["sft"]["gold_reward"]}  # methods without training rollouts: their held-out gold
    if "dpo" in summary["methods"]:
        held_out_gold["dpo"] = summary["methods"]["dpo"]["gold_reward_final"]
    plot_curves(runs_by_method, out / "curves.png", config.curve_smoothing, held_out_gold=held_out_gold,
                parity_gold=summary["parity_target_gold_reward"])
    examples = {"sft": sft_samples[0], **{m: _first_sample(out, m, config.seeds[0]) for m in summary["methods"]}}
    write_report(summary, out / "report.md", "curves.png", examples=examples, task=task)
    tqdm.write("\n".join(["", *results_table(summary), "", *comparison_sentences(summary), ""]))
    if config.smoke_test:
        tqdm.write(f"[demo] {SMOKE_TEST_NOTE}")
    tqdm.write(f"[demo] wrote {out / 'report.md'} ({summary['wall_seconds']:.0f} s)")


def _first_sample(out: Path, method: str, seed: int) -> dict:
    return json.loads((out / "runs" / method / f"seed{seed}" / "eval_samples.jsonl").read_text().splitlines()[0])
