"""The demo's base model: a tiny Llama trained briefly as a language model on the synthetic language."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from marlhf.demo.tokenizer import train_tokenizer


def tiny_llama(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 128, num_layers: int = 3,
               max_position_embeddings: int = 256) -> LlamaForCausalLM:
    """A Llama of about half a million parameters with the tokenizer's vocabulary and special tokens."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def pretrain(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    texts: list[str],
    *,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """One epoch of next-token prediction over `texts` (each followed by EOS), cosine-decayed learning rate.

    Returns the loss of every step. The model is trained in place and left in eval mode.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(texts) < batch_size:
        raise ValueError(f"texts holds {len(texts)} texts, fewer than one batch of {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(texts), generator=generator).tolist()
    num_steps = len(texts) // batch_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=num_steps,
                                                   pct_start=0.1)
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    model.train()
    losses = []
    for step in tqdm(range(num_steps), desc="pretrain", leave=False):
        batch_texts = [texts[i] + tokenizer.eos_token for i in order[step * batch_size : (step + 1) * batch_size]]
        batch = tokenizer(batch_texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    tokenizer.padding_side = padding_side
    model.eval()
    return losses


def pretrained_base(texts: list[str], seed: int, max_positions: int,
                    out_dir: Path) -> tuple[PreTrainedTokenizerFast, LlamaForCausalLM]:
    """The demo's tokenizer (BPE on `texts`) and base model (a tiny Llama pre-trained on them, initialised from
    `seed`), both saved to OUT_DIR: what every task of the demo starts from."""
    tokenizer = train_tokenizer(texts)
    torch.manual_seed(seed)
    base = tiny_llama(tokenizer, max_position_embeddings=max_positions)
    pretrain(base, tokenizer, texts, seed=seed)
    base.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return tokenizer, base
