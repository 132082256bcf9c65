"""Every common model family through the whole pipeline, on tiny random-weight configs (nothing downloaded):
SFT -> reward model (ScalarHeadModel on the SFT model) -> PPO at n = 5 and n = 1 -> evaluate, with the
identities that catch misaligned positions on left-padded prompts: the sampling pass's log-probs equal the
scoring forward's, and the first update's ratio is exactly 1."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from marlhf.evaluation.evaluate import EvaluateConfig, run_evaluation
from marlhf.logging_utils import read_metrics
from marlhf.trainers.ppo import PPOConfig, train_ppo
from marlhf.trainers.reward import RewardConfig, train_reward_model
from marlhf.trainers.sft import SFTConfig, train_sft
from tests.sweeps import sweep
from tests.trainers.test_ppo import RECORDS

SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
FAMILIES = {  # the architectures differ where RLHF code breaks: tied embeddings, soft-capping, sliding windows,
    # learned absolute positions under left padding. gpt2 runs by default: rotary positions (llama, every other
    # test's model) cannot show a row's positions shifted by its padding; the others run under -m slow.
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),  # learned absolute positions
    "llama": {},
    "qwen2": {},
    "mistral": dict(sliding_window=16),
    "gemma": dict(head_dim=8),  # tied embeddings, scaled embeddings
    "gemma2": dict(head_dim=8, sliding_window=16, query_pre_attn_scalar=8),  # soft-capped logits and attention
    "phi3": {},
}


def _model(family: str, tokenizer):
    options = {**({} if family == "gpt2" else SIZE), **FAMILIES[family]}
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **options)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sweep(FAMILIES))
def test_a_family_runs_the_pipeline_with_aligned_positions(family, tmp_path, tiny_tokenizer):
    short = dict(per_device_batch_size=4, max_steps=1, save_steps=0, max_prompt_length=32, max_length=64)
    sft_dir, rm_dir = tmp_path / "sft", tmp_path / "rm"
    train_sft(SFTConfig(output_dir=str(sft_dir), learning_rate=1e-3, **short),
              [{"prompt": r["prompt"], "response": " hello there"} for r in RECORDS],
              model=_model(family, tiny_tokenizer), tokenizer=tiny_tokenizer)
    train_reward_model(RewardConfig(output_dir=str(rm_dir), model_name_or_path=str(sft_dir), eval_fraction=0.0,
                                    **short),
                       [{"prompt": r["prompt"], "chosen": " a fine thing", "rejected": " no"} for r in RECORDS],
                       tokenizer=tiny_tokenizer)
    for ngram, rollout_logprobs in ((5, "sampling"), (1, "recompute")):
        output_dir = tmp_path / f"ppo{ngram}"
        train_ppo(PPOConfig(output_dir=str(output_dir), model_name_or_path=str(sft_dir),
                            reward_model_name_or_path=str(rm_dir), per_device_batch_size=4, mini_batch_size=2,
                            max_prompt_length=32, max_response_length=8, max_length=64, max_steps=1, save_steps=0,
                            ngram=ngram, rollout_logprobs=rollout_logprobs, seed=3),
                  RECORDS, tokenizer=tiny_tokenizer)
        first = read_metrics(output_dir)[0]
        # The policy is the reference at step 1: KL is 0 up to float error, so the sampling pass (KV cache,
        # left padding) scores tokens as the full forward does; the first mini-batch's ratio is exactly 1.
        assert abs(first["objective/kl"]) < 1e-4, first["objective/kl"]
        assert first["policy/approxkl"] < 1e-6
    summary = run_evaluation(EvaluateConfig(model_name_or_path=str(tmp_path / "ppo5"), reward_model=str(rm_dir),
                                            output_dir=str(tmp_path / "eval"), batch_size=4, max_response_length=6,
                                            max_prompt_length=32, seed=3),
                             records=[{"prompt": r["prompt"]} for r in RECORDS[:4]])
    assert summary
