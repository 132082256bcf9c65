"""Direct Preference Optimization on {"prompt", "chosen", "rejected"} records against a frozen reference.

    model = train_dpo(DPOConfig(model_name_or_path=..., output_dir=...), records)
The reference is ref_model_name_or_path (default: the starting policy itself), loaded once and frozen;
without a path and with a `model` passed in, the reference is a frozen copy of that model. With use_lora the
policy trains LoRA adapters and, without a reference path, the reference is the policy with its adapters
switched off (no second copy); the final model is saved (and returned) with the adapters merged in.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from marlhf.config import option
from marlhf.data.encoding import collate_pairs, encode_pairs
from marlhf.data.records import STAGE_FIELDS, require_fields
from marlhf.losses import dpo_loss
from marlhf.modeling import AdaptersDisabled, apply_lora, load_causal_lm, load_tokenizer, sequence_logprobs
from marlhf.run_config import TrainingConfig
from marlhf.trainers.common import make_accelerator, records_from_config, train_supervised


@dataclasses.dataclass(kw_only=True)
class DPOConfig(TrainingConfig):
    """DPO of a causal LM on preference pairs against a frozen reference model."""

    output_dir: str = option("outputs/dpo", "directory for checkpoints, metrics.jsonl, config.yaml and the final model")
    learning_rate: float = option(1e-6, "peak AdamW learning rate", gt=0)
    beta: float = option(0.1, "DPO inverse temperature on the implicit reward", gt=0)
    label_smoothing: float = option(0.0, "conservative DPO: assumed probability that a label is flipped", ge=0, lt=0.5)
    ref_model_name_or_path: str | None = option(None, "frozen reference model (none: the starting policy)")
    use_lora: bool = option(
        False, "train LoRA adapters on the policy; without ref_model_name_or_path the reference is the policy with "
               "its adapters off (no second copy); checkpoints hold the adapters, the final model is saved merged")


def response_logprob_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed log-probs of the response tokens of each row [2B] (chosen rows first, then rejected)."""
    logprobs = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"])  # tokens 1..T-1
    return (logprobs * batch["response_mask"][:, 1:]).sum(-1)


def train_dpo(config: DPOConfig, records: list[dict[str, Any]] | None = None, model=None, ref_model=None,
              tokenizer=None):
    """Train `model` (default: loaded from config.model_name_or_path) with DPO and return it unwrapped."""
    accelerator = make_accelerator(config)
    records = records if records is not None else records_from_config(config, "rm")
    require_fields(records, STAGE_FIELDS["rm"], "dpo")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path)
    if model is None:
        model = load_causal_lm(config.model_name_or_path, config.dtype, config.gradient_checkpointing)
    model = apply_lora(model, config)
    if ref_model is None and config.ref_model_name_or_path:
        ref_model = load_causal_lm(config.ref_model_name_or_path, config.dtype)
    elif ref_model is None:  # the starting policy: its weights with the adapters off, or a copy
        ref_model = AdaptersDisabled(model) if config.use_lora else copy.deepcopy(model)
    if isinstance(ref_model, torch.nn.Module):
        ref_model.requires_grad_(False).eval().to(accelerator.device)
    pairs = encode_pairs(tokenizer, records, config.max_prompt_length, config.max_length)

    def loss_fn(model, batch):
        with torch.no_grad(), accelerator.autocast():
            ref_chosen, ref_rejected = response_logprob_sums(ref_model, batch).chunk(2)
        policy_chosen, policy_rejected = response_logprob_sums(model, batch).chunk(2)
        return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=config.beta,
                        label_smoothing=config.label_smoothing)

    return train_supervised(config, accelerator, model, tokenizer, pairs, collate_pairs, loss_fn, "dpo")
