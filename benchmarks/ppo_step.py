"""Wall time of one MA-PPO step, split into generation / scoring / update.

A Llama-like policy of about 5M parameters (built from a config, random weights, no download), its frozen
reference, a critic and a frozen reward model of the same size, a word-level tokenizer of 4,096 words.
Each step samples 64 new tokens for 16 prompts of 32-64 tokens (EOS is rare in a random model, so nearly
every response is 64 tokens), scores them (policy, reference, critic and reward-model forwards), and
runs one PPO epoch (default mini-batch 16: one update of policy and critic, which reuses the scoring's policy
and critic forwards, so "scoring" includes them and "update" is mostly backward passes). The first `--warmup`
steps are dropped; the mean and min of the rest are printed, from the time/* metrics train_ppo logs.

    python benchmarks/ppo_step.py [--batch 16] [--new-tokens 64] [--steps 6] [--warmup 2] [--ngram 5] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

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
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="prompts (= responses) per PPO step")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
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

    with tempfile.TemporaryDirectory() as output_dir:
        config = PPOConfig(output_dir=output_dir, model_name_or_path="benchmark", per_device_batch_size=args.batch,
                           mini_batch_size=args.mini_batch, max_prompt_length=64, max_response_length=args.new_tokens,
                           max_length=64 + args.new_tokens, max_steps=args.warmup + args.steps, ngram=args.ngram,
                           save_steps=0, learning_rate=1e-5, critic_learning_rate=1e-5)
        train_ppo(config, prompts, policy=policy, reward_model=reward_model, tokenizer=tokenizer)
        metrics = read_metrics(output_dir)[args.warmup:]

    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"policy {num_parameters / 1e6:.1f}M parameters (x4 models), batch {args.batch}, "
          f"{args.new_tokens} new tokens, mini-batch {args.mini_batch}, n={args.ngram}, {device}, "
          f"{len(metrics)} steps after {args.warmup} warm-up")
    mean_length = statistics.mean(m["objective/response_length"] for m in metrics)
    print(f"mean response length {mean_length:.1f} tokens")
    step_mean = statistics.mean(m["time/step_seconds"] for m in metrics)
    print(f"{'phase':<12}{'mean s':>9}{'min s':>9}{'share':>8}")
    for phase in PHASES:
        values = [m[phase] for m in metrics]
        name = phase.removeprefix("time/").removesuffix("_seconds")
        mean = statistics.mean(values)
        print(f"{name:<12}{mean:>9.3f}{min(values):>9.3f}{mean / step_mean:>8.0%}")


if __name__ == "__main__":
    main()
