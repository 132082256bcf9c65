"""Supervised fine-tuning on {"prompt", "response"} records; the loss covers response tokens only.

    model = train_sft(SFTConfig(model_name_or_path=..., output_dir=...), records)
The final model and tokenizer are saved to output_dir (load them with from_pretrained(output_dir)); with
use_lora, LoRA adapters are trained and the final model is saved (and returned) with them merged in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from marlhf.config import option
from marlhf.data.encoding import collate_prompt_response, encode_prompt_response
from marlhf.data.records import require_fields
from marlhf.modeling import apply_lora, load_causal_lm, load_tokenizer
from marlhf.run_config import TrainingConfig
from marlhf.trainers.common import make_accelerator, records_from_config, train_supervised

IGNORE_INDEX = -100  # label value the Hugging Face loss skips


@dataclasses.dataclass(kw_only=True)
class SFTConfig(TrainingConfig):
    """Supervised fine-tuning of a causal LM on prompt/response pairs (loss on the response only)."""

    output_dir: str = option("outputs/sft", "directory for checkpoints, metrics.jsonl, config.yaml and the final model")
    learning_rate: float = option(2e-5, "peak AdamW learning rate", gt=0)


def collate_sft(examples: list[tuple[list[int], int]], pad_token_id: int,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch whose labels are IGNORE_INDEX on prompt tokens and padding."""
    batch = collate_prompt_response(examples, pad_token_id, device)
    labels = batch["input_ids"].masked_fill(~batch.pop("response_mask"), IGNORE_INDEX)
    return {**batch, "labels": labels}


def train_sft(config: SFTConfig, records: list[dict[str, Any]] | None = None, model=None, tokenizer=None):
    """Fine-tune `model` (default: loaded from config.model_name_or_path) and return it unwrapped."""
    accelerator = make_accelerator(config)
    records = records if records is not None else records_from_config(config, "sft")
    require_fields(records, ("prompt", "response"), "sft")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path)
    if model is None:
        model = load_causal_lm(config.model_name_or_path, config.dtype, config.gradient_checkpointing)
    model = apply_lora(model, config)
    examples = [encode_prompt_response(tokenizer, r["prompt"], r["response"], config.max_prompt_length,
                                       config.max_length) for r in records]

    return train_supervised(config, accelerator, model, tokenizer, examples, collate_sft, _sft_loss, "sft")


def _sft_loss(model, batch) -> tuple[torch.Tensor, dict]:
    return model(**batch, use_cache=False).loss, {}
