"""Wall time of one MA-PPO step, split into generation / scoring / update.

A Llama-like policy of about 5M parameters (built from a config, random weights, no download), its frozen
reference, a critic and a frozen reward model of the same size, a word-level tokenizer of 4,096 words.
Each step samples 64 new tokens for 16 prompts of 32-64 tokens (EOS is rare in a random model, so nearly
every response is 64 tokens), scores them (policy, reference, critic and reward-model forwards), and
runs one PPO epoch (default mini-batch 16: one update of policy and critic, which reuses the scoring's policy
and critic forwards, so "scoring" includes them and "update" is mostly backward passes). The first `--warmup`
steps are dropped; the mean and min of the rest are printed, from the time/* metrics train_ppo logs.

Distance to the physical limit: each phase's model FLOPs (from parameter counts and the real token counts:
2 x matmul parameters per token for a forward, twice that for a backward, plus causal attention 4 x layers x
hidden x context per token), over its mean wall time, against the machine's float32 matmul peak, measured in
the same run by a large GEMM (best of several). Padding tokens and non-matmul work count as overhead, as in
the usual model-FLOPs utilisation.

`--engine vllm`: the rollouts come from the vllm rollout engine (marlhf.engines.vllm; run in the vLLM venv,
docs/vllm.md), synced with the policy after each update; its LLM is built in the first step's generation,
which the warm-up drops. `--engine hf` (default): the hf engine.

    python benchmarks/ppo_step.py [--engine hf|vllm] [--batch 16] [--new-tokens 64] [--steps 6] [--warmup 2]
                                  [--ngram 5] [--threads N] [--kv-cache-gib 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from marlhf.logging_utils import read_metrics
from marlhf.modeling import ScalarHeadModel
from marlhf.trainers.ppo import PPOConfig, train_ppo

VOCAB_SIZE = 4096
PHASES = ("time/generation", "time/scoring", "time/update", "time/step_seconds")


def word_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(VOCAB_SIZE - len(specials))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def llama(tokenizer, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def matmul_peak_flops(size: int, repeats: int = 5) -> float:
    """Float32 FLOP/s of the best of `repeats` size x size GEMMs (the machine's practical peak)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def forward_flops(matmul_parameters: int, layers: int, hidden: int, rows: int, start: int, end: int) -> float:
    """Forward FLOPs of `rows` sequences over positions [start, end) given the earlier ones (KV cache): 2 per
    matmul parameter per token plus causal attention, 4 x layers x hidden per (token, attended position)."""
    tokens = end - start
    attended = (end * (end + 1) - start * (start + 1)) / 2  # sum of the context lengths 1..end past start
    return rows * (2 * matmul_parameters * tokens + 4 * layers * hidden * attended)


def phase_flops(policy: LlamaForCausalLM, batch: int, prompt_length: float, response_length: float,
                reuses_forward: bool) -> dict[str, float]:
    """Model FLOPs of one PPO step's phases: generation (prefill + one token at a time), scoring (policy,
    reference, critic and reward-model forwards of prompt + response), update (backward of policy and critic,
    plus their forwards when the update does not reuse the scoring's)."""
    config = policy.config
    embedding = policy.get_input_embeddings().weight.numel()
    lm_parameters = sum(p.numel() for p in policy.parameters()) - embedding  # the LM head is a matmul
    head = policy.get_output_embeddings().weight.numel()
    scalar_parameters = lm_parameters - head  # critic / reward model: the backbone and a 1-wide head
    layers, hidden = config.num_hidden_layers, config.hidden_size
    prompt, total = round(prompt_length), round(prompt_length + response_length)

    def forward(parameters: int, start: int = 0, end: int = total) -> float:
        return forward_flops(parameters, layers, hidden, batch, start, end)

    generation = forward(lm_parameters, 0, prompt) + forward(lm_parameters, prompt, total)
    scoring = 2 * forward(lm_parameters) + 2 * forward(scalar_parameters)
    update = 2 * (forward(lm_parameters) + forward(scalar_parameters))  # backward = 2 x forward
    if not reuses_forward:
        update += forward(lm_parameters) + forward(scalar_parameters)
    return {"time/generation": generation, "time/scoring": scoring, "time/update": update,
            "time/step_seconds": generation + scoring + update}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="prompts (= responses) per PPO step")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--gemm-size", type=int, default=None,
                        help="side of the GEMM that measures the matmul peak (default: 2048 on CPU, 8192 on GPU)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout engine")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="vllm on CPU: VLLM_CPU_KVCACHE_SPACE")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()

    tokenizer = word_tokenizer()
    policy = llama(tokenizer, seed=0)
    reward_model = ScalarHeadModel(llama(tokenizer, seed=1).model)
    rng = random.Random(0)
    prompts = [{"prompt": " ".join(f"w{rng.randrange(VOCAB_SIZE - 3)}" for _ in range(rng.randint(32, 64)))}
               for _ in range(args.batch * 4)]
    num_parameters = sum(p.numel() for p in policy.parameters())

    engine_options = {"kv_cache_gib": args.kv_cache_gib} if args.engine == "vllm" else {}
    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOConfig(output_dir=output_dir, model_name_or_path="benchmark", per_device_batch_size=args.batch,
                           mini_batch_size=args.mini_batch, max_prompt_length=64, max_response_length=args.new_tokens,
                           max_length=64 + args.new_tokens, max_steps=args.warmup + args.steps, ngram=args.ngram,
                           save_steps=0, learning_rate=1e-5, critic_learning_rate=1e-5, rollout_engine=args.engine,
                           rollout_engine_options=engine_options)
        train_ppo(config, prompts, policy=policy, reward_model=reward_model, tokenizer=tokenizer)
        metrics = read_metrics(output_dir)[args.warmup:]
    peak = matmul_peak_flops(args.gemm_size or (8192 if torch.cuda.is_available() else 2048))

    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"policy {num_parameters / 1e6:.1f}M parameters (x4 models), batch {args.batch}, "
          f"{args.new_tokens} new tokens, mini-batch {args.mini_batch}, n={args.ngram}, {args.engine} engine, "
          f"{device}, {len(metrics)} steps after {args.warmup} warm-up")
    mean_length = statistics.mean(m["objective/response_length"] for m in metrics)
    print(f"mean response length {mean_length:.1f} tokens")
    step_mean = statistics.mean(m["time/step_seconds"] for m in metrics)
    prompt_length = statistics.mean(len(tokenizer(r["prompt"])["input_ids"]) for r in prompts)
    flops = phase_flops(policy, args.batch, prompt_length, mean_length, config.reuses_rollout_forward)
    print(f"float32 matmul peak {peak / 1e9:.1f} GFLOP/s (GEMM in this run)")
    print(f"{'phase':<12}{'mean s':>9}{'min s':>9}{'share':>8}{'GFLOP':>9}{'GFLOP/s':>9}{'of peak':>9}")
    for phase in PHASES:
        values = [m[phase] for m in metrics]
        name = phase.removeprefix("time/").removesuffix("_seconds")
        mean = statistics.mean(values)
        rate = flops[phase] / mean
        print(f"{name:<12}{mean:>9.3f}{min(values):>9.3f}{mean / step_mean:>8.0%}{flops[phase] / 1e9:>9.2f}"
              f"{rate / 1e9:>9.2f}{rate / peak:>9.1%}")


if __name__ == "__main__":
    main()
