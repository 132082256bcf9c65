"""Supervised fine-tuning on {"prompt", "response"} records; the loss covers response tokens only.

    model = train_sft(SFTConfig(model_name_or_path=..., output_dir=...), records)
The final model and tokenizer are saved to output_dir (load them with from_pretrained(output_dir)); with
use_lora, LoRA adapters are trained and the final model is saved (and returned) with them merged in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tqdm.auto import tqdm

from marlhf.config import TrainingConfig, option
from marlhf.logging_utils import reduce_metrics
from marlhf.modeling import apply_lora, load_causal_lm, load_tokenizer, merge_lora
from marlhf.trainers.common import (BatchPlan, accumulation_context, collate_prompt_response,
                                    encode_prompt_response, make_accelerator, make_optimizer, make_scheduler,
                                    maybe_save_checkpoint, optimizer_step, records_from_config, require_fields,
                                    save_final_model, start_run)

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

    plan = BatchPlan(len(examples), config, accelerator)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config, plan.total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    models, optimizers, schedulers = {"model": model}, {"model": optimizer}, {"model": scheduler}
    start_step, logger = start_run(config, accelerator, models, optimizers, schedulers)

    model.train()
    progress = tqdm(range(start_step, plan.total_steps), initial=start_step, total=plan.total_steps, desc="sft",
                    disable=not accelerator.is_local_main_process)
    for step in progress:
        micro_batches = plan.micro_batches(step)
        losses = []
        for index, indices in enumerate(micro_batches):
            batch = collate_sft([examples[i] for i in indices], tokenizer.pad_token_id, accelerator.device)
            with accumulation_context(accelerator, model, index == len(micro_batches) - 1):
                loss = model(**batch, use_cache=False).loss
                accelerator.backward(loss / len(micro_batches))
            losses.append(loss.detach())
        grad_norm, learning_rate = optimizer_step(accelerator, model, optimizer, scheduler, config.max_grad_norm)

        done = step + 1
        if done % config.logging_steps == 0 or done == plan.total_steps:
            metrics = reduce_metrics({"loss": torch.stack(losses).mean(), "grad_norm": grad_norm}, accelerator)
            metrics.update(learning_rate=learning_rate, epoch=plan.epoch_at(done))
            logger.log(metrics, done)
            progress.set_postfix(loss=f"{metrics['loss']:.4f}")
        maybe_save_checkpoint(config, done, accelerator, models, optimizers, schedulers, tokenizer)

    logger.close()
    if config.use_lora:
        model = merge_lora(accelerator.unwrap_model(model))
    save_final_model(model, tokenizer, config.output_dir, accelerator)
    return accelerator.unwrap_model(model)
