"""marlhf's PPO (n=1: token-level, the same algorithm) against TRL's PPOTrainer, same model, batch, lengths, steps.

Each side runs in its own subprocess, one after the other, with its own Python environment: marlhf in the
project's .venv, TRL in a separate, git-ignored .venv-trl (TRL is never a marlhf dependency; TRL >= 1.0 has no PPO
trainer, 0.26.0 is the last with one, under trl.experimental.ppo, and it needs transformers 4.x):

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 trl==0.26.0 transformers==4.57.6
    .venv/bin/python benchmarks/vs_trl.py [--batch 16] [--pieces 1] [--prompt-lengths 32 64] [--new-tokens 64]
                                          [--rollout-logprobs recompute] [--kv-cache dynamic] [--steps 6] [--warmup 2]
                                          [--threads N]
    # the paper's PPO shape (32 rows a device, 8 accumulation pieces of 4) with prompts of ragged length:
    .venv/bin/python benchmarks/vs_trl.py --batch 32 --pieces 8 --prompt-lengths 32 256 --steps 4

Workload (both sides): a Llama policy of ~5M parameters built from a config (random weights, no download), a
reference copy, a value model and a reward model of the same shape, a word-level tokenizer of 4,096 words, `batch`
prompts per step with lengths drawn from `prompt-lengths`, up to `new_tokens` sampled tokens per response (TRL
runs without a stop token; marlhf stops at EOS, which a random model rarely samples: the mean response length is
printed), temperature 0.7, no top-k/top-p, one PPO epoch over one mini-batch of the whole rollout split into
`pieces` gradient-accumulation pieces, KL coefficient 0.05, gamma 1, lambda 0.95, AdamW; marlhf uses fixed
n-grams with n=1. How each side works: TRL generates and scores the whole batch at once, every row padded to the
batch's widest, and keeps the policy log-probs of its sampling pass; marlhf scores and updates in length-sorted
pieces with their common padding cut, takes the policy log-probs from a separate forward pass unless
`--rollout-logprobs sampling`, and with one piece reuses the rollout's policy and critic forwards in the update.

Measured: seconds per PPO step after `warmup` steps, median and min (the median resists other processes on a
shared machine; both sides use the same number of torch threads; `--rounds N` runs both sides N times,
alternating which goes first, and prints the median of the rounds' ratios, since a load change between the
two halves of one round moves its ratio). marlhf: its time/step_seconds metric; TRL:
wall time between on_step_end callbacks, which includes its own per-step metric gathering and gc.collect.
Memory: the process's peak resident set size (getrusage ru_maxrss) and that peak minus the resident size just
before training started, i.e. what training adds on top of the loaded models and libraries. The two sides run
different transformers releases (marlhf: 5.x, TRL: 4.57), so the model forward itself may differ in speed.
Device: on a machine with a GPU both sides train on it (marlhf through Accelerate, TRL's Trainer with use_cpu
off), still float32, the clocks synchronize the GPU at each step's end, and the peak GPU memory
(torch.cuda.max_memory_allocated) is printed beside the RSS; `benchmarks/gpu.sh` runs all three comparisons
there when the TRL venvs exist (each made with a CUDA build of torch 2.13.0). Without a GPU, the CPU.

GRPO and RLOO (`--trainer grpo|rloo`): marlhf's `advantage="grpo"|"rloo"` against TRL 1.16's GRPOTrainer and
RLOOTrainer, in another git-ignored venv with the transformers marlhf uses (5.23.0, which TRL 1.16 accepts):

    python3 -m venv .venv-trl116
    .venv-trl116/bin/pip install torch==2.13.0 trl==1.16.0 transformers==5.23.0
    .venv/bin/python benchmarks/vs_trl.py --trainer grpo [--batch 8] [--generations 4] [--new-tokens 64]
                                          [--pieces 1] [--kl-coef 0.05] [--steps 6] [--warmup 2] [--threads 1]

Workload (both sides): the same policy, its frozen reference copy (TRL loads it from the policy saved to a temporary
directory, marlhf deep-copies it), `batch` prompts x `generations` samples per step, up to `new_tokens` sampled
tokens (both stop at EOS), temperature 0.7, no top-k/top-p, a Python reward (count_reward: the number of response
words ending in 7; no reward model), one optimizer step per generation batch of all batch x generations rows in
`pieces` gradient-accumulation pieces (TRL: per_device_train_batch_size = rows / pieces, gradient_accumulation_steps
= pieces, steps_per_generation unset so it defaults to gradient_accumulation_steps and generation_batch_size to
all rows, num_iterations 1), clip 0.2, AdamW at 1e-5 with a linear schedule, float32, no gradient checkpointing, no
vLLM, no logging, evaluation, saving or completion printing. Pinned per algorithm (what is printed as `options`):
  grpo: group-std-scaled advantages (TRL scale_rewards="group", marlhf grpo_normalize_std), per-token ratios
        (marlhf ngram=1), loss averaged over all tokens of the update (TRL loss_type="dapo", marlhf token-mean).
  rloo: leave-one-out baseline, no advantage normalisation, one sequence-level ratio (marlhf ngram=None), loss
        averaged over sequences (marlhf loss_agg_mode="seq-mean-token-mean"), KL summed into the reward (k1) on both.
Both keep a reference with KL coefficient `kl_coef` (TRL beta); at `--kl-coef 0` (TRL's default) both drop it
(marlhf's fixed n-grams do not read it), and each side prints whether it kept one.
Remaining differences: GRPO's KL is k1 in the reward in marlhf but TRL's k3 term in the loss (the same reference
forward either way); TRL's RLOO always runs a no-grad policy forward for the old log-probs, which marlhf with one
piece takes from the update's own forward (with more pieces marlhf recomputes them too); both sample with
transformers' `generate`, marlhf with its own Gumbel noise from one generator per row, and marlhf scores in
length-sorted pieces with their common padding cut; TRL takes log-probs with its chunked float32 lm-head kernel,
also computes per-token entropies, and gathers its per-step metrics; the prompt pipelines (tokenisation,
datasets and RepeatSampler in TRL) are each side's own.
Measured as for PPO; TRL's mean response length is its completions/mean_length metric.

`--async` adds a third side, marlhf with bounded staleness (docs/async.md): max_staleness 1, one rollout worker
process of `--threads` torch threads generating the next step's batch while the trainer (`--threads` threads)
trains, the loss's decoupled-PPO correction; its line gives its throughput against TRL's (the issue's target:
2x). It uses twice the threads of the other two sides, as the synchronous run with 2 threads would.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 4096
LLAMA = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
TEMPERATURE = 0.7
KL_COEF = 0.05
LEARNING_RATE = 1e-5
VENVS = {"marlhf": ".venv", "ppo": ".venv-trl", "grpo": ".venv-trl116", "rloo": ".venv-trl116"}


def count_reward(prompts, completions, **_):
    """The same cheap reward on both sides (TRL's reward-function convention, which marlhf also takes): the number
    of response words ending in 7, so samples of one prompt differ and the group baselines are not all zero."""
    return [float(sum(word.endswith("7") for word in completion.split())) for completion in completions]


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def peak_gpu_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(VOCAB_SIZE - len(specials))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")


def llama_config(tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(**LLAMA, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, **extra)


def prompt_texts(count: int, lengths: tuple[int, int]) -> list[str]:
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(VOCAB_SIZE - 3)}" for _ in range(rng.randint(*lengths))) for _ in range(count)]


def environment(policy) -> dict:
    """What decides a side's speed besides the code: library versions, threads, attention kernel, dtype."""
    import platform

    import torch
    import transformers

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl_version, "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "attention": getattr(policy.config, "_attn_implementation", None), "dtype": str(policy.dtype),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}}


def group_options(args) -> dict:
    """The marlhf PPOConfig fields that make its GRPO / RLOO the algorithm TRL's trainer runs."""
    rows = args.batch * args.generations
    per_trainer = {"grpo": dict(ngram=1, loss_agg_mode="token-mean", grpo_normalize_std=True),
                   "rloo": dict(ngram=None, loss_agg_mode="seq-mean-token-mean")}[args.trainer]
    return dict(advantage=args.trainer, num_samples_per_prompt=args.generations, mini_batch_size=rows,
                kl_coef=args.kl_coef, whiten_advantages=False, clip_range=0.2, **per_trainer)


def run_marlhf(args) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from marlhf.logging_utils import read_metrics
    from marlhf.modeling import ScalarHeadModel
    from marlhf.trainers.ppo import PPOConfig, train_ppo

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(tokenizer))
    if args.trainer == "ppo":
        torch.manual_seed(1)
        scorer = dict(reward_model=ScalarHeadModel(LlamaForCausalLM(llama_config(tokenizer)).model))
        options = dict(mini_batch_size=args.batch, ngram=1, kl_coef=KL_COEF)
    else:  # critic-free: no reward model or critic, the Python reward
        scorer, options = dict(reward_fn=count_reward), group_options(args)
    if args.side == "marlhf-async":  # a rollout worker one step ahead (docs/async.md)
        options.update(max_staleness=1, rollout_workers=1, rollout_worker_threads=args.threads)
    prompts = [{"prompt": text} for text in prompt_texts(args.batch * (args.warmup + args.steps), args.prompt_lengths)]
    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOConfig(output_dir=output_dir, model_name_or_path="benchmark", per_device_batch_size=args.batch,
                           gradient_accumulation_steps=args.pieces,
                           max_prompt_length=args.prompt_lengths[1], max_response_length=args.new_tokens,
                           max_length=args.prompt_lengths[1] + args.new_tokens, max_steps=args.warmup + args.steps, termination="fixed",
                           temperature=TEMPERATURE, top_k=0, top_p=1.0, gamma=1.0, lam=0.95,
                           ppo_epochs=1, save_steps=0, learning_rate=LEARNING_RATE, critic_learning_rate=1e-5,
                           warmup_ratio=0.0, lr_scheduler="linear", seed=0, rollout_logprobs=args.rollout_logprobs,
                           kv_cache=args.kv_cache, **options)
        rss_before = rss_mib()
        train_ppo(config, prompts, policy=policy, tokenizer=tokenizer, **scorer)
        metrics = read_metrics(output_dir)
    step_seconds = [m["time/step_seconds"] for m in metrics][args.warmup:]
    return {"step_seconds": step_seconds, "rss_before_mib": rss_before, "peak_rss_mib": peak_rss_mib(), "peak_gpu_mib": peak_gpu_mib(),
            "response_length": statistics.mean(m["objective/response_length"] for m in metrics),
            "environment": {**environment(policy), "kv_cache": config.plugin_options("rollout_engine").kv_cache,
                            "max_staleness": config.async_rollout.max_staleness,
                            "rollout_workers": config.async_rollout.rollout_workers} if args.trainer == "ppo" else {
                **environment(policy), "mixed_precision": config.mixed_precision,
                "gradient_checkpointing": config.gradient_checkpointing, "reference": config.uses_reference,
                "options": {**options, "rollout_logprobs": config.old_logprobs_from,
                            "kv_cache": config.plugin_options("rollout_engine").kv_cache,
                            "gradient_accumulation_steps": config.gradient_accumulation_steps,
                            "temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p}}}


def train_timed(trainer, on_step=None) -> tuple[list[float], float]:
    """Train a transformers Trainer; return the seconds of each optimizer step (between on_step_end callbacks,
    the first from the start of train()) and the resident size just before training. `on_step()` runs after
    each step's clock reading."""
    import torch
    from transformers import TrainerCallback

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels are done (marlhf's clock syncs the same way)
            step_ends.append(time.perf_counter())
            if on_step is not None:
                on_step()

    trainer.add_callback(StepClock())
    rss_before = rss_mib()
    start = time.perf_counter()
    trainer.train()
    ticks = [start] + step_ends
    return [b - a for a, b in zip(ticks, ticks[1:])], rss_before


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(tokenizer))
    torch.manual_seed(1)
    reward_model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1))
    value_model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1))
    value_model.load_state_dict(reward_model.state_dict())  # the critic starts from the reward model, as in marlhf
    texts = prompt_texts(args.batch * (args.warmup + args.steps), args.prompt_lengths)
    dataset = Dataset.from_dict({"input_ids": [tokenizer(text)["input_ids"] for text in texts]})
    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOConfig(output_dir=output_dir, per_device_train_batch_size=args.batch // args.pieces,
                           gradient_accumulation_steps=args.pieces,
                           num_mini_batches=1, local_rollout_forward_batch_size=args.batch,
                           total_episodes=args.batch * (args.warmup + args.steps), response_length=args.new_tokens,
                           temperature=TEMPERATURE, num_ppo_epochs=1, kl_coef=KL_COEF, kl_estimator="k1", gamma=1.0,
                           lam=0.95, cliprange=0.2, cliprange_value=0.2, stop_token=None, missing_eos_penalty=None,
                           num_sample_generations=0, learning_rate=1e-5, lr_scheduler_type="linear", report_to="none",
                           save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                           use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
                           # TRL 0.26's PPOConfig defaults to bf16 autocast and gradient checkpointing; marlhf runs
                           # float32 without checkpointing, so both are pinned off (on this CPU bf16 alone is ~10x)
                           bf16=False, fp16=False, gradient_checkpointing=False)
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                             reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                             eval_dataset=dataset.select(range(args.batch)))
        step_seconds, rss_before = train_timed(trainer)
    return {"step_seconds": step_seconds[args.warmup:], "rss_before_mib": rss_before, "peak_rss_mib": peak_rss_mib(), "peak_gpu_mib": peak_gpu_mib(),
            "response_length": float(args.new_tokens),
            "environment": {**environment(policy), "bf16": config.bf16, "fp16": config.fp16,
                            "gradient_checkpointing": config.gradient_checkpointing}}


def run_trl_group(args) -> dict:
    """TRL 1.16's GRPOTrainer or RLOOTrainer on the workload marlhf's run_marlhf gets (see the docstring)."""
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(tokenizer))
    rows = args.batch * args.generations
    texts = prompt_texts(args.batch * (args.warmup + args.steps), args.prompt_lengths)
    dataset = Dataset.from_dict({"prompt": texts})
    common = dict(per_device_train_batch_size=rows // args.pieces, gradient_accumulation_steps=args.pieces,
                  num_generations=args.generations, max_completion_length=args.new_tokens, num_iterations=1,
                  temperature=TEMPERATURE, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, beta=args.kl_coef,
                  epsilon=0.2, mask_truncated_completions=False, use_vllm=False, log_completions=False,
                  learning_rate=LEARNING_RATE, lr_scheduler_type="linear", warmup_steps=0,
                  max_steps=args.warmup + args.steps, seed=0, use_cpu=not torch.cuda.is_available(),
                  dataloader_num_workers=0,
                  report_to="none", save_strategy="no", logging_strategy="no", eval_strategy="no",
                  disable_tqdm=True,
                  # TRL's configs default to bf16 autocast and gradient checkpointing; marlhf runs float32 without
                  # checkpointing (on this CPU bf16 alone made the PPO comparison ~10x off)
                  bf16=False, fp16=False, gradient_checkpointing=False)
    per_trainer = {"grpo": dict(scale_rewards="group", loss_type="dapo", importance_sampling_level="token"),
                   "rloo": dict(normalize_advantages=False, reward_clip_range=None)}[args.trainer]
    config_class, trainer_class = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[args.trainer]
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as output_dir:
        # TRL builds the reference with from_pretrained(policy.config._name_or_path): give it the policy's weights
        policy.save_pretrained(model_dir)
        policy.config._name_or_path = model_dir
        config = config_class(output_dir=output_dir, **common, **per_trainer)
        trainer = trainer_class(model=policy, reward_funcs=count_reward, args=config, train_dataset=dataset,
                                processing_class=tokenizer)
        # TRL clears its metrics when it logs at the end of train(): copy each step's mean completion length
        lengths: list[float] = []
        step_seconds, rss_before = train_timed(
            trainer, on_step=lambda: lengths.append(trainer._metrics["train"]["completions/mean_length"][-1]))
    pinned = {name: getattr(config, name) for name in
              ("generation_batch_size", "steps_per_generation", "num_iterations", "gradient_accumulation_steps",
               "per_device_train_batch_size", "num_generations", "max_completion_length", "beta", "epsilon",
               "temperature", "top_k", "top_p", "use_vllm", *per_trainer)}
    return {"step_seconds": step_seconds[args.warmup:], "rss_before_mib": rss_before, "peak_rss_mib": peak_rss_mib(), "peak_gpu_mib": peak_gpu_mib(),
            "response_length": statistics.mean(lengths),
            "environment": {**environment(policy), "bf16": config.bf16, "fp16": config.fp16,
                            "gradient_checkpointing": config.gradient_checkpointing,
                            "reference": trainer.ref_model is not None, "options": pinned}}


def where(threads: int) -> str:
    """The device both sides train on: the GPU when there is one (marlhf through Accelerate, TRL through its
    Trainer), else the CPU."""
    import torch

    if torch.cuda.is_available():
        return f"GPU ({torch.cuda.get_device_name()}), float32"
    return f"CPU ({os.cpu_count()} cores, {threads} torch threads)"


def child(side: str, args) -> dict:
    """Run one side in a fresh process with its own interpreter; return what it printed as JSON."""
    python = REPO_ROOT / VENVS["marlhf" if side.startswith("marlhf") else args.trainer] / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: create it as the docstring of {Path(__file__).name} says")
    command = [str(python), __file__, "--side", side, "--batch", str(args.batch), "--pieces", str(args.pieces),
               "--prompt-lengths", *map(str, args.prompt_lengths), "--rollout-logprobs", args.rollout_logprobs,
               "--new-tokens",
               str(args.new_tokens), "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads",
               str(args.threads), "--trainer", args.trainer, "--generations", str(args.generations),
               "--kl-coef", str(args.kl_coef), "--kv-cache", args.kv_cache]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRL_EXPERIMENTAL_SILENCE": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{side} run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=("ppo", "grpo", "rloo"), default="ppo",
                        help="ppo: against TRL 0.26's PPOTrainer; grpo/rloo: against TRL 1.16's GRPO/RLOOTrainer")
    parser.add_argument("--batch", type=int, help="prompts per step (default: 16 for ppo, 8 for grpo/rloo)")
    parser.add_argument("--generations", type=int, default=4, help="grpo/rloo: samples per prompt")
    parser.add_argument("--kl-coef", type=float, default=KL_COEF,
                        help="grpo/rloo: KL coefficient of both sides (TRL beta); 0 drops the reference on both")
    parser.add_argument("--pieces", type=int, default=1,
                        help="gradient-accumulation pieces the update splits each step's rows into")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                        help="prompt lengths in tokens, drawn uniformly")
    parser.add_argument("--rollout-logprobs", choices=("recompute", "sampling"), default="recompute",
                        help="marlhf's rollout_logprobs (TRL always keeps those of its sampling pass)")
    parser.add_argument("--kv-cache", choices=("dynamic", "static", "static_compiled"), default="dynamic",
                        help="marlhf's kv_cache (TRL generates with transformers' dynamic cache)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each side (1: stable figures on a shared machine)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run both sides this many times, alternating which goes first, and print the median of "
                             "the rounds' throughput ratios (a load change on a shared machine then hits both sides)")
    parser.add_argument("--async", dest="run_async", action="store_true",
                        help="also marlhf with max_staleness 1 and one rollout worker of --threads threads")
    parser.add_argument("--side", choices=("marlhf", "marlhf-async", "trl"),
                        help=argparse.SUPPRESS)  # internal: one child run
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 16 if args.trainer == "ppo" else 8
    rows = args.batch * (1 if args.trainer == "ppo" else args.generations)
    if rows % args.pieces:
        parser.error(f"--pieces ({args.pieces}) must divide the rows per step ({rows})")

    if args.side is not None:
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(args.threads)
        hf_logging.set_verbosity_error()
        trl_side = run_trl if args.trainer == "ppo" else run_trl_group
        print(json.dumps((run_marlhf if args.side.startswith("marlhf") else trl_side)(args), default=str))
        return

    rounds = []
    for index in range(args.rounds):
        order = ("marlhf", "trl") if index % 2 == 0 else ("trl", "marlhf")
        order += ("marlhf-async",) if args.run_async else ()
        rounds.append({side: child(side, args) for side in order})
    if args.trainer != "ppo":
        print(f"{args.trainer.upper()} step, Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']} (~5M params, "
              f"policy{' + reference' if args.kl_coef else ', no reference'}), {args.batch} prompts x "
              f"{args.generations} samples, prompts "
              f"{args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, up to {args.new_tokens} new tokens, Python "
              f"reward, KL {args.kl_coef}, 1 update in {args.pieces} piece(s), {args.steps} steps after "
              f"{args.warmup} warm-up, {where(args.threads)}")
    else:
        print(f"PPO step, Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']} (~5M params, x4 models), batch "
              f"{args.batch}, prompts {args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, {args.new_tokens} new "
              f"tokens, 1 epoch x 1 mini-batch in {args.pieces} piece(s), marlhf rollout_logprobs="
              f"{args.rollout_logprobs}, {args.steps} steps after {args.warmup} warm-up, {where(args.threads)}")
    ratios, async_ratios = [], []
    for number, results in enumerate(rounds, start=1):
        if args.rounds > 1:
            print(f"  round {number} ({' then '.join(results)}):")
        for side in [side for side in ("marlhf", "trl", "marlhf-async") if side in results]:
            result = results[side]
            seconds = result["step_seconds"]
            result["steps_per_second"] = 1 / statistics.median(seconds)
            result["train_mib"] = result["peak_rss_mib"] - result["rss_before_mib"]
            if number == 1:
                print(f"  {side:7s} environment {json.dumps(result['environment'], sort_keys=True)}")
            gpu = f", peak GPU memory {result['peak_gpu_mib']:.0f} MiB" if result.get("peak_gpu_mib") else ""
            print(f"  {side:7s} {result['steps_per_second']:.3f} steps/s (median {statistics.median(seconds):.3f} s, "
                  f"min {min(seconds):.3f} s)  peak RSS {result['peak_rss_mib']:.0f} MiB, +{result['train_mib']:.0f} "
                  f"MiB during training{gpu}  mean response {result['response_length']:.1f} tokens")
        marlhf, trl = results["marlhf"], results["trl"]
        ratios.append(marlhf["steps_per_second"] / trl["steps_per_second"])
        gpu = (f", peak GPU memory ratio {marlhf['peak_gpu_mib'] / trl['peak_gpu_mib']:.2f}"
               if marlhf.get("peak_gpu_mib") and trl.get("peak_gpu_mib") else "")
        print(f"  marlhf / TRL throughput: {ratios[-1]:.2f}x (median), "
              f"{min(trl['step_seconds']) / min(marlhf['step_seconds']):.2f}x (min); "
              f"peak RSS ratio {marlhf['peak_rss_mib'] / trl['peak_rss_mib']:.2f}, "
              f"training-memory ratio {marlhf['train_mib'] / max(trl['train_mib'], 1e-9):.2f}{gpu}")
        if "marlhf-async" in results:
            asynchronous = results["marlhf-async"]
            async_ratios.append(asynchronous["steps_per_second"] / trl["steps_per_second"])
            print(f"  marlhf async (max_staleness 1, 1 rollout worker + trainer, {args.threads} thread(s) each) / TRL "
                  f"throughput: {async_ratios[-1]:.2f}x (median); / marlhf sync: "
                  f"{asynchronous['steps_per_second'] / marlhf['steps_per_second']:.2f}x")
    if args.rounds > 1 and async_ratios:
        print(f"  median over {args.rounds} rounds of the async / TRL throughput ratio: "
              f"{statistics.median(async_ratios):.2f}x")
    if args.rounds > 1:
        print(f"  median over {args.rounds} rounds of the throughput ratio: {statistics.median(ratios):.2f}x "
              f"(rounds: {', '.join(f'{r:.2f}x' for r in ratios)})")

if __name__ == "__main__":
    main()
