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

from marlhf.config import option
from marlhf.data.encoding import Pair, collate_pairs, encode_pairs
from marlhf.data.records import STAGE_FIELDS, require_fields
from marlhf.losses import bradley_terry_loss
from marlhf.modeling import ScalarHeadModel, apply_lora, last_token_index, load_tokenizer
from marlhf.run_config import TrainingConfig
from marlhf.trainers.common import make_accelerator, records_from_config, train_supervised


@dataclasses.dataclass(kw_only=True)
class RewardConfig(TrainingConfig):
    """Reward-model training on preference pairs (Bradley-Terry loss)."""

    output_dir: str = option("outputs/reward",
                             "directory for checkpoints, metrics.jsonl, config.yaml and the final model")
    eval_fraction: float = option(0.05, "held-out fraction of the records for pairwise accuracy (0: none)", ge=0, lt=1)
    eval_steps: int = option(100, "evaluate every N optimizer steps (0: only at the end)", ge=0)
    per_device_eval_batch_size: int = option(16, "pairs per evaluation batch on each process", ge=1)


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
    require_fields(records, STAGE_FIELDS["rm"], "rm")
    if eval_records is None:
        records, eval_records = split_records(records, config.eval_fraction, config.seed)
    elif eval_records:
        require_fields(eval_records, STAGE_FIELDS["rm"], "rm eval")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path)
    if model is None:
        model = ScalarHeadModel.from_pretrained(config.model_name_or_path, config.dtype, config.gradient_checkpointing)
    model = apply_lora(model, config)
    pairs, eval_pairs = (encode_pairs(tokenizer, records, config.max_prompt_length, config.max_length),
                           encode_pairs(tokenizer, eval_records, config.max_prompt_length, config.max_length))

    def evaluate(model, done: int, total_steps: int) -> dict[str, float]:
        if eval_pairs and ((config.eval_steps and done % config.eval_steps == 0) or done == total_steps):
            return evaluate_reward_model(model, eval_pairs, tokenizer.pad_token_id, config.per_device_eval_batch_size,
                                         accelerator)
        return {}

    return train_supervised(config, accelerator, model, tokenizer, pairs, collate_pairs,
                            lambda model, batch: bradley_terry_loss(*pair_scores(model, batch)), "reward", evaluate)
