"""Reward model on {"prompt", "chosen", "rejected"} records with the Bradley-Terry loss.

    model = train_reward_model(RewardConfig(model_name_or_path=..., output_dir=...), records)
The model is a marlhf.modeling.ScalarHeadModel whose score is its value at the last real token (the
EOS appended to each response). A held-out split (eval_fraction of the records, drawn with the seed, or
the eval_records passed in) is scored every eval_steps and at the end: eval/accuracy is the fraction of
pairs where the chosen response scores strictly higher. With use_lora the backbone trains LoRA adapters and
the value head trains fully; the final model is saved (and returned) with the adapters merged in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from marlhf.config import TrainingConfig, option
from marlhf.logging_utils import reduce_metrics
from marlhf.losses import bradley_terry_loss
from marlhf.modeling import ScalarHeadModel, apply_lora, last_token_index, load_tokenizer, merge_lora
from marlhf.trainers.common import (BatchPlan, accumulation_context, collate_prompt_response,
                                    encode_prompt_response, make_accelerator, make_optimizer, make_scheduler,
                                    maybe_save_checkpoint, optimizer_step, records_from_config, require_fields,
                                    save_final_model, start_run)

PAIR_FIELDS = ("prompt", "chosen", "rejected")
Pair = tuple[tuple[list[int], int], tuple[list[int], int]]


@dataclasses.dataclass(kw_only=True)
class RewardConfig(TrainingConfig):
    """Reward-model training on preference pairs (Bradley-Terry loss)."""

    output_dir: str = option("outputs/reward",
                             "directory for checkpoints, metrics.jsonl, config.yaml and the final model")
    eval_fraction: float = option(0.05, "held-out fraction of the records for pairwise accuracy (0: none)", ge=0, lt=1)
    eval_steps: int = option(100, "evaluate every N optimizer steps (0: only at the end)", ge=0)
    per_device_eval_batch_size: int = option(16, "pairs per evaluation batch on each process", ge=1)


def encode_pairs(tokenizer, records: list[dict[str, Any]], config: TrainingConfig) -> list[Pair]:
    return [(encode_prompt_response(tokenizer, r["prompt"], r["chosen"], config.max_prompt_length, config.max_length),
             encode_prompt_response(tokenizer, r["prompt"], r["rejected"], config.max_prompt_length, config.max_length))
            for r in records]


def collate_pairs(pairs: list[Pair], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One right-padded batch: the chosen sequences in rows [0, B), the rejected ones in rows [B, 2B)."""
    return collate_prompt_response([c for c, _ in pairs] + [r for _, r in pairs], pad_token_id, device)


def pair_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores; `model` may be DDP-wrapped, so call it and pick the last token here."""
    values = model(batch["input_ids"], batch["attention_mask"])
    scores = values.gather(1, last_token_index(batch["attention_mask"]).unsqueeze(1)).squeeze(1)
    return scores.chunk(2)


def split_records(records: list[dict[str, Any]], eval_fraction: float, seed: int):
    """(train, held-out) split drawn with `seed`; no held-out records when eval_fraction is 0."""
    if eval_fraction == 0:
        return records, []
    num_eval = max(1, math.ceil(eval_fraction * len(records)))
    if num_eval >= len(records):
        raise ValueError(f"eval_fraction {eval_fraction} leaves no training records out of {len(records)}")
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    return [records[i] for i in order[num_eval:]], [records[i] for i in order[:num_eval]]


@torch.no_grad()
def evaluate_reward_model(model: torch.nn.Module, pairs: list[Pair], pad_token_id: int, batch_size: int,
                          accelerator: Accelerator) -> dict[str, float]:
    """Pairwise accuracy, mean Bradley-Terry loss and mean margin over all held-out pairs (all processes)."""
    # The unwrapped model: DDP's forward may broadcast buffers, which would hang on uneven shards.
    model = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    shard = pairs[accelerator.process_index::accelerator.num_processes]
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # accuracy, loss, margin sums; pairs
    for start in range(0, len(shard), batch_size):
        chunk = shard[start:start + batch_size]
        chosen, rejected = pair_scores(model, collate_pairs(chunk, pad_token_id, accelerator.device))
        loss, stats = bradley_terry_loss(chosen, rejected)
        totals[:3] += torch.stack([stats["accuracy"], loss, stats["margin"]]).double() * len(chunk)
        totals[3] += len(chunk)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    correct, loss, margin, count = totals.tolist()
    return {"eval/accuracy": correct / count, "eval/loss": loss / count, "eval/margin": margin / count}


def train_reward_model(config: RewardConfig, records: list[dict[str, Any]] | None = None,
                       eval_records: list[dict[str, Any]] | None = None, model: ScalarHeadModel | None = None,
                       tokenizer=None) -> ScalarHeadModel:
    """Train `model` (default: ScalarHeadModel from config.model_name_or_path) and return it unwrapped."""
    accelerator = make_accelerator(config)
    records = records if records is not None else records_from_config(config, "rm")
    require_fields(records, PAIR_FIELDS, "rm")
    if eval_records is None:
        records, eval_records = split_records(records, config.eval_fraction, config.seed)
    elif eval_records:
        require_fields(eval_records, PAIR_FIELDS, "rm eval")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path)
    if model is None:
        model = ScalarHeadModel.from_pretrained(config.model_name_or_path, config.dtype, config.gradient_checkpointing)
    model = apply_lora(model, config)
    pairs, eval_pairs = encode_pairs(tokenizer, records, config), encode_pairs(tokenizer, eval_records, config)

    plan = BatchPlan(len(pairs), config, accelerator)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config, plan.total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    models, optimizers, schedulers = {"model": model}, {"model": optimizer}, {"model": scheduler}
    start_step, logger = start_run(config, accelerator, models, optimizers, schedulers)

    model.train()
    progress = tqdm(range(start_step, plan.total_steps), initial=start_step, total=plan.total_steps, desc="reward",
                    disable=not accelerator.is_local_main_process)
    for step in progress:
        micro_batches = plan.micro_batches(step)
        step_stats = []
        for index, indices in enumerate(micro_batches):
            batch = collate_pairs([pairs[i] for i in indices], tokenizer.pad_token_id, accelerator.device)
            with accumulation_context(accelerator, model, index == len(micro_batches) - 1):
                loss, stats = bradley_terry_loss(*pair_scores(model, batch))
                accelerator.backward(loss / len(micro_batches))
            step_stats.append(torch.stack([loss.detach(), stats["accuracy"], stats["margin"]]))
        grad_norm, learning_rate = optimizer_step(accelerator, model, optimizer, scheduler, config.max_grad_norm)

        done = step + 1
        metrics = {}
        if done % config.logging_steps == 0 or done == plan.total_steps:
            loss, accuracy, margin = torch.stack(step_stats).mean(0)
            metrics = reduce_metrics({"loss": loss, "accuracy": accuracy, "margin": margin, "grad_norm": grad_norm},
                                     accelerator)
            metrics.update(learning_rate=learning_rate, epoch=plan.epoch_at(done))
        if eval_pairs and ((config.eval_steps and done % config.eval_steps == 0) or done == plan.total_steps):
            metrics.update(evaluate_reward_model(model, eval_pairs, tokenizer.pad_token_id,
                                                 config.per_device_eval_batch_size, accelerator))
        if metrics:
            logger.log(metrics, done)
            progress.set_postfix({k: f"{v:.4f}" for k, v in metrics.items() if k in ("loss", "eval/accuracy")})
        maybe_save_checkpoint(config, done, accelerator, models, optimizers, schedulers, tokenizer)

    logger.close()
    if config.use_lora:
        model = merge_lora(accelerator.unwrap_model(model))
    save_final_model(model, tokenizer, config.output_dir, accelerator)
    return accelerator.unwrap_model(model)
