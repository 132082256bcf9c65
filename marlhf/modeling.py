"""Model and tokenizer loading, a scalar-head model (reward model and critic), log-prob helpers.

API:
    load_tokenizer(name_or_path, padding_side="right") -> tokenizer   (pad token := eos token when missing)
    load_causal_lm(name_or_path, dtype="float32", gradient_checkpointing=False) -> AutoModelForCausalLM
    ScalarHeadModel.from_pretrained(name_or_path, dtype="float32", gradient_checkpointing=False)
        backbone = AutoModel (a causal-LM checkpoint loads without its LM head) + Linear(hidden, 1)
        model(input_ids, attention_mask) -> values [B, T] float32    (critic: one value per token)
        model.score(input_ids, attention_mask) -> [B]                 (reward model: value at last real token)
        model.save_pretrained(dir): backbone files + scalar_head.safetensors
    position_ids_from_mask(attention_mask) -> [B, T]      (positions count real tokens only: left padding safe)
    last_token_index(attention_mask) -> [B]                (last real token; any padding side)
    token_logprobs(logits [B, T, V], tokens [B, T], temperature=1.0, chunk_size=8) -> [B, T] float32
        log softmax(logits / temperature) at `tokens`, as gathered logit minus logsumexp, `chunk_size` rows at
        a time, so no [B, T, V] log-softmax of the whole batch is ever materialised.
    token_entropy(logits [B, T, V], temperature=1.0, chunk_size=8) -> [B, T] float32, no gradient
        entropy of softmax(logits / temperature) at each position, `chunk_size` rows at a time.
    sequence_logprobs(model, input_ids, attention_mask, num_tokens=None, temperature=1.0, chunk_size=8) -> [B, N]
        log-probs of the LAST num_tokens tokens of input_ids (default: every token after the first) under a
        causal LM; only num_tokens + 1 logit rows are computed (logits_to_keep). Rollout/PPO: input_ids =
        [left-padded prompt | right-padded response] and num_tokens = response length.
    sequence_logprobs_and_entropy(same arguments) -> ([B, N], [B, N]): the same log-probs and, from the same
        forward, the entropy of the distribution each token was drawn from (token_entropy).
    add_lora(model, r=8, alpha=16, dropout=0.0, target_modules=LLAMA_ATTENTION) -> model with LoRA adapters
        (peft): a causal LM becomes a peft.PeftModel; a ScalarHeadModel keeps its class, its backbone gets the
        adapters and its head stays fully trainable. Only adapter (and head) parameters require grad.
    apply_lora(model, config) -> add_lora with the config's lora_r, lora_alpha, lora_target_modules if
        config.use_lora, else the model as it is (what the trainers call)
    merge_lora(model) -> a plain copy (causal LM, or ScalarHeadModel with a plain backbone) with the adapters
        merged into its weights, for the final save; `model` keeps its adapters
    AdaptersDisabled(peft_model)(**forward kwargs): the base model's forward (adapters switched off, eval mode)
        without a second copy of the weights: the frozen reference of PPO and DPO when the policy trains LoRA
        adapters.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from marlhf.errors import MarlhfError
from marlhf.hub import HUB_TIMEOUT_VARIABLE, hub_lookup, hub_timeout
from marlhf.run_config import LLAMA_ATTENTION, TrainingConfig

logger = logging.getLogger(__name__)


def _torch_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return getattr(torch, dtype)


def check_model_path(name_or_path: str | Path) -> None:
    """A local path that does not exist is an error saying so (a Hub id has one '/' and no leading '.', '/'
    or '~'; from_pretrained would call the path a malformed repo id). A Hub id is looked up on the Hub within
    MARLHF_HUB_TIMEOUT seconds in all (`hub_timeout`): one not in the local cache must be there, else the error
    names the id, the cache and the Hub's last answer, instead of coming after the download's minutes of retries
    (offline, HF_HUB_OFFLINE, at once); for one in the cache a Hub that does not answer switches this process to
    the cache (as HF_HUB_OFFLINE=1 would), instead of from_pretrained waiting for it once per file."""
    name = str(name_or_path)
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or isinstance(name_or_path, Path)
    if Path(name).expanduser().exists():
        return
    if looks_local:
        raise MarlhfError(f"model path {name!r} does not exist")
    _check_hub_id(name)


def _check_hub_id(repo_id: str) -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    cached = any(isinstance(try_to_load_from_cache(repo_id, file), str)
                 for file in ("config.json", "tokenizer_config.json"))
    where = f"{repo_id!r} is neither a local directory nor in the Hugging Face cache ({constants.HF_HUB_CACHE}; HF_HOME)"
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise MarlhfError(f"model {where}, and HF_HUB_OFFLINE is set: download it where there is a network, point "
                          "HF_HOME at a cache that holds it, or pass a local directory")
    unanswered = hub_lookup(repo_id, hub_timeout(), missing_is_error=not cached)
    if unanswered is None:
        return
    if cached:
        logger.warning("the Hub (%s) %s: loading %r from the cache, this process works offline (HF_HUB_OFFLINE=1 "
                       "does so from the start)", constants.ENDPOINT, unanswered, repo_id)
        constants.HF_HUB_OFFLINE = True  # what from_pretrained reads: no per-file wait for the Hub
        return
    raise MarlhfError(f"model {where}, and the Hub ({constants.ENDPOINT}) is unreachable: it {unanswered}; download "
                      "it where there is a network, point HF_HOME at a cache that holds it, pass a local directory, "
                      f"set HF_HUB_OFFLINE=1 to work from the cache, or raise {HUB_TIMEOUT_VARIABLE} (now "
                      f"{hub_timeout():g} s)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")  # any one of them: transformers can try


def check_tokenizer_files(name_or_path: str | Path) -> None:
    """A local directory without any tokenizer file is a MarlhfError naming what it holds and what is missing
    (transformers would say "Couldn't instantiate the backend tokenizer" and list its converters)."""
    directory = Path(name_or_path).expanduser()
    if not directory.is_dir() or any((directory / name).is_file() for name in TOKENIZER_FILES):
        return
    held = sorted(path.name for path in directory.iterdir())
    inner = [path for path in sorted(directory.iterdir())
             if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)]
    fix = (f"did you mean {inner[0]}?" if inner else "save the tokenizer of the model it came from there too "
           "(tokenizer.save_pretrained(DIR), or copy its files)")
    raise MarlhfError(f"no tokenizer files in {directory} (it holds {', '.join(held[:6]) or 'nothing'}"
                      f"{', ...' if len(held) > 6 else ''}; a tokenizer is tokenizer.json, or tokenizer_config.json "
                      f"with its vocabulary files): {fix}")


def load_tokenizer(name_or_path: str, padding_side: str = "right"):
    """Right padding for training batches, left padding for generation."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    check_model_path(name_or_path)
    check_tokenizer_files(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path} has neither a pad token nor an eos token")
        # Masks are built from lengths, never from `ids == pad`, so pad == eos is safe.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def load_causal_lm(name_or_path: str, dtype: str | torch.dtype = "float32",
                   gradient_checkpointing: bool = False) -> PreTrainedModel:
    check_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=_torch_dtype(dtype))
    if gradient_checkpointing:
        model.activation_checkpointing_enable()
        model.config.use_cache = False
    return model


class ScalarHeadModel(nn.Module):
    """Transformer backbone + linear head: one scalar per token.

    The critic uses the per-token values [B, T]; the reward model uses `score`, the value at the last
    real token of each row. The head stays in float32 whatever the backbone dtype.
    """

    HEAD_FILE = "scalar_head.safetensors"

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        hidden_size = backbone.config.get_text_config().hidden_size
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, dtype: str | torch.dtype = "float32",
                        gradient_checkpointing: bool = False) -> ScalarHeadModel:
        """Backbone from any HF checkpoint; the head from scalar_head.safetensors if saved there, else fresh."""
        check_model_path(name_or_path)
        model = cls(AutoModel.from_pretrained(name_or_path, dtype=_torch_dtype(dtype)))
        head_file = Path(name_or_path) / cls.HEAD_FILE
        if head_file.exists():
            model.head.load_state_dict(load_file(str(head_file)))
        if gradient_checkpointing:
            model.activation_checkpointing_enable()
        return model

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`state_dict`: the weights to save in place of the model's own (under FSDP the gathered full ones)."""
        state_dict = state_dict if state_dict is not None else self.state_dict()
        backbone = {k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")}
        self.backbone.save_pretrained(directory, state_dict=backbone)
        head = {k.removeprefix("head."): v.contiguous() for k, v in state_dict.items() if k.startswith("head.")}
        save_file(head, str(Path(directory) / self.HEAD_FILE))

    def activation_checkpointing_enable(self) -> None:
        self.backbone.activation_checkpointing_enable()
        self.backbone.config.use_cache = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        values = self(input_ids, attention_mask)
        return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row, as generate() computes it."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    if not bool(attention_mask.bool().any(-1).all()):
        raise ValueError("every row of attention_mask needs at least one real token")
    length = attention_mask.shape[1]
    return length - 1 - attention_mask.long().flip(-1).argmax(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 8) -> torch.Tensor:
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    pieces = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start:start + chunk_size].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, tokens[start:start + chunk_size].unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(pieces, dim=0)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 8) -> torch.Tensor:
    pieces = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start:start + chunk_size].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        pieces.append(torch.special.entr(chunk.softmax(dim=-1)).sum(dim=-1))  # -p log p, 0 where p = 0
    return torch.cat(pieces, dim=0)


def _sequence_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     num_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [B, N, V] that predict the last `num_tokens` tokens of input_ids, and those tokens [B, N]."""
    length = input_ids.shape[1]
    num_tokens = length - 1 if num_tokens is None else num_tokens
    if not 1 <= num_tokens < length:
        raise ValueError(f"num_tokens must be in [1, {length - 1}], got {num_tokens}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask),
                   logits_to_keep=num_tokens + 1, use_cache=False).logits[:, :-1]
    return logits, input_ids[:, -num_tokens:]


def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      num_tokens: int | None = None, temperature: float = 1.0, chunk_size: int = 8) -> torch.Tensor:
    logits, tokens = _sequence_logits(model, input_ids, attention_mask, num_tokens)
    return token_logprobs(logits, tokens, temperature, chunk_size)


def sequence_logprobs_and_entropy(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  num_tokens: int | None = None, temperature: float = 1.0,
                                  chunk_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    logits, tokens = _sequence_logits(model, input_ids, attention_mask, num_tokens)
    return token_logprobs(logits, tokens, temperature, chunk_size), token_entropy(logits, temperature, chunk_size)


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             target_modules: tuple[str, ...] = LLAMA_ATTENTION) -> nn.Module:
    """Freeze `model` and add trainable LoRA adapters (scale alpha / r) to the linear layers whose names
    end with one of `target_modules`. A ScalarHeadModel's value head stays trainable (it is new)."""
    from peft import LoraConfig, get_peft_model  # imported by LoRA runs only: it takes seconds

    if r < 1:
        raise ValueError(f"lora r must be >= 1, got {r}")
    if not target_modules:
        raise ValueError("lora target_modules must name at least one module")
    lora_config = dict(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    if isinstance(model, ScalarHeadModel):
        model.backbone = get_peft_model(model.backbone, LoraConfig(**lora_config))
        model.head.requires_grad_(True)
        return model
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora_config))


def apply_lora(model: nn.Module, config: TrainingConfig) -> nn.Module:
    if not config.use_lora:
        return model
    return add_lora(model, r=config.lora_r, alpha=config.lora_alpha, target_modules=config.lora_target_modules)


def merge_lora(model: nn.Module) -> nn.Module:
    """Copy first: the trained adapters stay in `model` (a later save or inspection still sees them)."""
    model = copy.deepcopy(model)
    if isinstance(model, ScalarHeadModel):
        model.backbone = model.backbone.merge_and_unload()
        return model
    return model.merge_and_unload()


class AdaptersDisabled:
    """Calls a peft model with its adapters switched off, in eval mode like a frozen copy (no dropout).
    Deliberately not an nn.Module: it must not register the policy as a submodule (freezing or moving the
    reference would touch the policy)."""

    def __init__(self, peft_model: nn.Module) -> None:
        if not hasattr(peft_model, "disable_adapter"):
            raise ValueError(f"AdaptersDisabled needs a peft model, got {type(peft_model).__name__}")
        self.peft_model = peft_model

    def __call__(self, **kwargs) -> Any:
        was_training = self.peft_model.training
        self.peft_model.eval()
        try:
            with self.peft_model.disable_adapter():
                return self.peft_model(**kwargs)
        finally:
            self.peft_model.train(was_training)
