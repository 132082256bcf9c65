"""A tiny model as a policy that plays an environment's episodes: observation (text or chat messages) -> text."""

from __future__ import annotations

import pytest
import torch

from marlhf.engines.hf import generate_responses


@pytest.fixture
def tiny_policy(make_tiny_causal_lm, tiny_tokenizer):
    """`act(observation, seed) -> text`: 16 sampled tokens of a tiny model on the observation's last 400 tokens."""
    model = make_tiny_causal_lm().eval()

    def act(observation, seed: int = 0) -> str:
        text = observation if isinstance(observation, str) else "\n".join(m["content"] for m in observation)
        ids = torch.tensor([tiny_tokenizer(text)["input_ids"][-400:] or [tiny_tokenizer.bos_token_id]])
        response, _ = generate_responses(model, ids, torch.ones_like(ids, dtype=torch.bool), max_new_tokens=16,
                                         temperature=1.0, top_k=0, top_p=1.0,
                                         eos_token_id=tiny_tokenizer.eos_token_id,
                                         pad_token_id=tiny_tokenizer.pad_token_id, row_seeds=[seed])
        return tiny_tokenizer.decode(response[0], skip_special_tokens=True)

    return act



@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """The tests' tiny model with room for a TextArena prompt (about 600 tokens of the tiny tokenizer), saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tiny_tokenizer.pad_token_id, bos_token_id=tiny_tokenizer.bos_token_id,
                         eos_token_id=tiny_tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("long_tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
