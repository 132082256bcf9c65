"""Rollout engines: what PPO samples its responses with.

An engine has two methods, called by the trainer once per step, in this order:

    engine.sync_weights(policy)        # the policy's current weights, before the step's rollout
    engine.generate(query_ids, query_mask, row_seeds=..., max_new_tokens=..., temperature=..., top_k=...,
                    top_p=..., eos_token_id=..., pad_token_id=..., return_logprobs=...)
        -> (response_ids [B, T], response_mask [B, T]) or, with return_logprobs, also the log-probs [B, T]
           of the drawn tokens under logits / temperature

with the conventions of :mod:`marlhf.rollout`: prompts left-padded, responses right-padded with
`pad_token_id`, EOS kept, `mask` True up to and including the first EOS; row b is drawn from its own random
stream seeded by `row_seeds[b]`, so a response depends only on its prompt and seed.

`hf` (`HFEngine`) is the one built in: transformers' `generate` on the policy itself, so `sync_weights`
has nothing to copy; its `generate` also takes `sampling_noise` and `kv_cache`
(`marlhf.rollout.generate_responses`). A vLLM (or SGLang) engine is one new file that registers itself, and no
trainer edit:

- `sync_weights(policy)`: push the policy's state dict into the inference engine's model (with LoRA, the
  merged weights), e.g. through a worker-side `load_weights`, as OpenRLHF and verl do; the trainer calls it on
  every process before each step's rollout, so an engine shared by several processes syncs on one of them.
- `generate`: hand vLLM the prompts' token ids without their left padding (`TokensPrompt`), one
  `SamplingParams(n=1, temperature, top_k (-1 for 0), top_p, max_tokens, seed=row_seeds[b],
  logprobs=0 when return_logprobs)` per row, so that per-row seeds keep a response independent of the batch
  and of the number of processes (vLLM seeds per request); right-pad the returned token ids with
  `pad_token_id` and build the mask with `marlhf.rollout.response_mask_from_ids`.
- Returned log-probs: vLLM reports the log-prob of each sampled token under its processed logits; ask for
  them after temperature and before top-k / top-p where the vLLM version lets one choose, to match this
  convention. They come from another kernel than the training forward, so PPO should recompute
  them (`rollout_logprobs="recompute"`, the default) unless the difference is measured to be small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from marlhf.rollout import generate_responses

__all__ = ["RolloutEngine", "HFEngine", "ENGINES", "register_engine", "get_engine"]


class RolloutEngine(Protocol):
    def sync_weights(self, policy: nn.Module) -> None: ...

    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, *, row_seeds: Sequence[int],
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int,
                 return_logprobs: bool = False) -> tuple[torch.Tensor, ...]: ...


class HFEngine:
    """Samples with the policy itself through transformers' `generate` (KV cache, per-row Gumbel noise)."""

    def __init__(self) -> None:
        self.policy: nn.Module | None = None

    def sync_weights(self, policy: nn.Module) -> None:
        self.policy = policy  # the very module PPO trains: nothing to copy

    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, **sampling) -> tuple[torch.Tensor, ...]:
        if self.policy is None:
            raise RuntimeError("sync_weights(policy) must be called before generate")
        return generate_responses(self.policy, query_ids, query_mask, **sampling)


ENGINES: dict[str, Callable[[], RolloutEngine]] = {"hf": HFEngine}


def register_engine(name: str, factory: Callable[[], RolloutEngine]) -> None:
    """Make `factory` (called with no arguments, once per run) the engine named `name`."""
    if name in ENGINES and ENGINES[name] is not factory:
        raise ValueError(f"a rollout engine named {name!r} is already registered")
    ENGINES[name] = factory


def engine_class(name: str) -> type:
    """The engine class registered as `name` (a ValueError listing the registered ones otherwise)."""
    if name not in ENGINES:
        raise ValueError(f"rollout_engine must be one of {sorted(ENGINES)}, got {name!r}")
    return ENGINES[name]


def get_engine(name: str) -> RolloutEngine:
    """A new engine of the kind registered as `name`."""
    return engine_class(name)()
