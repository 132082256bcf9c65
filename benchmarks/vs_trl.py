"""marlhf's PPO (n=1: token-level, the same algorithm) against TRL's PPOTrainer, same model, batch, lengths, steps.

Each side runs in its own subprocess, one after the other, with its own Python environment: marlhf in the
project's .venv, TRL in a separate, git-ignored .venv-trl (TRL is never a marlhf dependency; TRL >= 1.0 has no PPO
trainer, 0.26.0 is the last with one, under trl.experimental.ppo, and it needs transformers 4.x):

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 trl==0.26.0 transformers==4.57.6
    .venv/bin/python benchmarks/vs_trl.py [--batch 16] [--pieces 1] [--prompt-lengths 32 64] [--new-tokens 64]
                                          [--rollout-logprobs recompute] [--steps 6] [--warmup 2] [--threads N]
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
shared machine; both sides use the same number of torch threads). marlhf: its time/step_seconds metric; TRL:
wall time between on_step_end callbacks, which includes its own per-step metric gathering and gc.collect.
Memory: the process's peak resident set size (getrusage ru_maxrss) and that peak minus the resident size just
before training started, i.e. what training adds on top of the loaded models and libraries. The two sides run
different transformers releases (marlhf: 5.x, TRL: 4.57), so the model forward itself may differ in speed.
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


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


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


def run_marlhf(args) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from marlhf.logging_utils import read_metrics
    from marlhf.modeling import ScalarHeadModel
    from marlhf.trainers.ppo import PPOConfig, train_ppo

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(tokenizer))
    torch.manual_seed(1)
    reward_model = ScalarHeadModel(LlamaForCausalLM(llama_config(tokenizer)).model)
    prompts = [{"prompt": text} for text in prompt_texts(args.batch * (args.warmup + args.steps), args.prompt_lengths)]
    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOConfig(output_dir=output_dir, model_name_or_path="benchmark", per_device_batch_size=args.batch,
                           mini_batch_size=args.batch, gradient_accumulation_steps=args.pieces,
                           max_prompt_length=args.prompt_lengths[1], max_response_length=args.new_tokens,
                           max_length=args.prompt_lengths[1] + args.new_tokens, max_steps=args.warmup + args.steps, termination="fixed",
                           ngram=1, temperature=TEMPERATURE, top_k=0, top_p=1.0, kl_coef=KL_COEF, gamma=1.0, lam=0.95,
                           ppo_epochs=1, save_steps=0, learning_rate=1e-5, critic_learning_rate=1e-5, warmup_ratio=0.0,
                           lr_scheduler="linear", seed=0, rollout_logprobs=args.rollout_logprobs)
        rss_before = rss_mib()
        train_ppo(config, prompts, policy=policy, reward_model=reward_model, tokenizer=tokenizer)
        metrics = read_metrics(output_dir)
    step_seconds = [m["time/step_seconds"] for m in metrics][args.warmup:]
    return {"step_seconds": step_seconds, "rss_before_mib": rss_before, "peak_rss_mib": peak_rss_mib(),
            "response_length": statistics.mean(m["objective/response_length"] for m in metrics),
            "environment": environment(policy)}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification, TrainerCallback
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

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOConfig(output_dir=output_dir, per_device_train_batch_size=args.batch // args.pieces,
                           gradient_accumulation_steps=args.pieces,
                           num_mini_batches=1, local_rollout_forward_batch_size=args.batch,
                           total_episodes=args.batch * (args.warmup + args.steps), response_length=args.new_tokens,
                           temperature=TEMPERATURE, num_ppo_epochs=1, kl_coef=KL_COEF, kl_estimator="k1", gamma=1.0,
                           lam=0.95, cliprange=0.2, cliprange_value=0.2, stop_token=None, missing_eos_penalty=None,
                           num_sample_generations=0, learning_rate=1e-5, lr_scheduler_type="linear", report_to="none",
                           save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, use_cpu=True,
                           dataloader_num_workers=0,
                           # TRL 0.26's PPOConfig defaults to bf16 autocast and gradient checkpointing; marlhf runs
                           # float32 without checkpointing, so both are pinned off (on this CPU bf16 alone is ~10x)
                           bf16=False, fp16=False, gradient_checkpointing=False)
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                             reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                             eval_dataset=dataset.select(range(args.batch)), callbacks=[StepClock()])
        rss_before = rss_mib()
        start = time.perf_counter()
        trainer.train()
    ticks = [start] + step_ends
    step_seconds = [b - a for a, b in zip(ticks, ticks[1:])][args.warmup:]
    return {"step_seconds": step_seconds, "rss_before_mib": rss_before, "peak_rss_mib": peak_rss_mib(),
            "response_length": float(args.new_tokens),
            "environment": {**environment(policy), "bf16": config.bf16, "fp16": config.fp16,
                            "gradient_checkpointing": config.gradient_checkpointing}}


def child(side: str, args) -> dict:
    """Run one side in a fresh process with its own interpreter; return what it printed as JSON."""
    python = {"marlhf": REPO_ROOT / ".venv" / "bin" / "python", "trl": REPO_ROOT / ".venv-trl" / "bin" / "python"}[side]
    if not python.exists():
        raise SystemExit(f"{python} is missing: create it as the docstring of {Path(__file__).name} says")
    command = [str(python), __file__, "--side", side, "--batch", str(args.batch), "--pieces", str(args.pieces),
               "--prompt-lengths", *map(str, args.prompt_lengths), "--rollout-logprobs", args.rollout_logprobs,
               "--new-tokens",
               str(args.new_tokens), "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads",
               str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRL_EXPERIMENTAL_SILENCE": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{side} run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="prompts (= responses) per PPO step")
    parser.add_argument("--pieces", type=int, default=1,
                        help="gradient-accumulation pieces the update splits each step's rows into")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                        help="prompt lengths in tokens, drawn uniformly")
    parser.add_argument("--rollout-logprobs", choices=("recompute", "sampling"), default="recompute",
                        help="marlhf's rollout_logprobs (TRL always keeps those of its sampling pass)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each side (1: stable figures on a shared machine)")
    parser.add_argument("--side", choices=("marlhf", "trl"), help=argparse.SUPPRESS)  # internal: one child run
    args = parser.parse_args()
    if args.batch % args.pieces:
        parser.error(f"--pieces ({args.pieces}) must divide --batch ({args.batch})")

    if args.side is not None:
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(args.threads)
        hf_logging.set_verbosity_error()
        print(json.dumps((run_marlhf if args.side == "marlhf" else run_trl)(args)))
        return

    results = {side: child(side, args) for side in ("marlhf", "trl")}
    print(f"PPO step, Llama {LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']} (~5M params, x4 models), batch "
          f"{args.batch}, prompts {args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, {args.new_tokens} new "
          f"tokens, 1 epoch x 1 mini-batch in {args.pieces} piece(s), marlhf rollout_logprobs={args.rollout_logprobs}, "
          f"{args.steps} steps after "
          f"{args.warmup} warm-up, CPU ({os.cpu_count()} cores, {args.threads} torch threads)")
    for side, result in results.items():
        seconds = result["step_seconds"]
        result["steps_per_second"] = 1 / statistics.median(seconds)
        result["train_mib"] = result["peak_rss_mib"] - result["rss_before_mib"]
        print(f"  {side:7s} environment {json.dumps(result['environment'], sort_keys=True)}")
        print(f"  {side:7s} {result['steps_per_second']:.3f} steps/s (median {statistics.median(seconds):.3f} s, min "
              f"{min(seconds):.3f} s)  peak RSS {result['peak_rss_mib']:.0f} MiB, +{result['train_mib']:.0f} MiB "
              f"during training  mean response {result['response_length']:.1f} tokens")
    marlhf, trl = results["marlhf"], results["trl"]
    print(f"  marlhf / TRL throughput: {marlhf['steps_per_second'] / trl['steps_per_second']:.2f}x (median), "
          f"{min(trl['step_seconds']) / min(marlhf['step_seconds']):.2f}x (min); "
          f"peak RSS ratio {marlhf['peak_rss_mib'] / trl['peak_rss_mib']:.2f}, "
          f"training-memory ratio {marlhf['train_mib'] / max(trl['train_mib'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
