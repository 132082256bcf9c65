"""The rollout-engine seam: the engine protocol, what a factory gets (`EngineContext`) and an engine returns
(`Generation`), the registry, and the conventions every engine keeps (`check_sampling`, `response_mask_from_ids`);
the package docstring says how to write one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from marlhf.plugins import Plugin, Registry

__all__ = ["RolloutEngine", "Generation", "EngineContext", "REGISTRY", "ENGINES", "register_engine", "get_engine",
           "make_engine", "check_sampling", "model_positions", "response_mask_from_ids"]


@dataclasses.dataclass
class Generation:
    """What an engine's `generate` returns: the responses right-padded, `response_mask` True up to and including
    the first EOS, and with `return_logprobs` the sampling log-probs of the drawn tokens (0 past the mask).

    response_ids: [B, T] long; response_mask: [B, T] bool; logprobs: [B, T] float, or None."""

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """What the trainer calls: `sync_weights` then `generate` once per step, `close` once when training ends (also
    on an error), after which the engine is not used again."""

    def sync_weights(self, policy: nn.Module) -> None: ...

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, row_seeds: Sequence[int],
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int,
                 return_logprobs: bool = False) -> Generation: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What an engine's factory gets: the run's Accelerate accelerator (None outside a run), the engine's own
    options (an instance of its options dataclass, None if it declares none) and the run's context budget in
    tokens, prompt + response (PPOConfig.max_length; None outside a run)."""

    accelerator: Any = None
    options: Any = None
    max_length: int | None = None


REGISTRY = Registry("rollout engine", "rollout_engine")
ENGINES: dict[str, Plugin] = REGISTRY.plugins


def register_engine(name: str, *, options: type | None = None) -> Callable[[Any], Any]:
    """Decorator: make the factory (a class, or a function of an EngineContext) the engine named `name`."""
    return REGISTRY.register(name, options=options)


def get_engine(spec: str) -> Plugin:
    """The engine registered as `spec`, or the factory at the dotted path `package.module:factory`."""
    return REGISTRY.get(spec)


def make_engine(spec: str, context: EngineContext) -> RolloutEngine:
    """A new engine of the kind named by `spec`."""
    return get_engine(spec).obj(context)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """The sampling arguments every rollout engine takes, checked the same way for all."""
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"`top_p` must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"`top_k` must be >= 0 (0 turns it off), got {top_k}")



def model_positions(model: nn.Module) -> int | None:
    """The positions the model has (its config's `max_position_embeddings`; a LoRA model's are its base's), or
    None when it names none: what a prompt plus its generated tokens may not exceed."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """True up to and including the first EOS of each row (the whole row when there is none)."""
    eos_ids = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos_ids).long()
    eos_before = is_eos.cumsum(1) - is_eos  # number of EOS strictly before each position
    return eos_before == 0
