"""Rollout engines: what PPO samples its responses with.

An engine is made once per run by its factory, `factory(context: EngineContext)` (the run's accelerator and
context budget, and the engine's own options; never the run's config), and has three methods, called by the
trainer in this order:

    engine.sync_weights(policy)        # each step: the policy's current weights, before the step's rollout
    engine.generate(prompt_ids, prompt_mask, row_seeds=..., max_new_tokens=..., temperature=..., top_k=...,
                    top_p=..., eos_token_id=..., pad_token_id=..., return_logprobs=...)
        -> Generation(response_ids [B, T], response_mask [B, T], logprobs [B, T] or None): the log-probs of
           the drawn tokens under logits / temperature, with return_logprobs (else None)
    engine.close()                     # once, when training ends, also on an error: free what it holds

with the conventions of :mod:`marlhf.rollout`: prompts left-padded, responses right-padded with
`pad_token_id`, EOS kept, `mask` True up to and including the first EOS (`response_mask_from_ids`); row b is
drawn from its own random stream seeded by `row_seeds[b]`, so a response depends only on its prompt and seed.

This package holds the seam (`base.py`) and one file per engine, each registering itself: `hf` (`hf.py`,
`HFEngine`: transformers' `generate` on the policy itself; its options are `sampling_noise` and `kv_cache`) and
`vllm` (`vllm.py`, `VLLMEngine` with its options `VLLMOptions`, docs/vllm.md; vLLM itself is imported only when a
run builds the engine, so marlhf neither needs nor imports it otherwise) and `vllm_server` (`vllm_server.py`,
`VLLMServerEngine`: the client of `marlhf vllm-serve` on another device or machine, docs/async.md). Engines are plug-ins like the
termination rules (marlhf.plugins): `register_engine(name, options=...)` on the factory, chosen by name or dotted
path with `rollout_engine`. Another engine (say SGLang) is one new file that registers itself, and no trainer
edit:

- `sync_weights(policy)`: push the policy's state dict into the inference engine's model (with LoRA, the
  merged weights), e.g. through a worker-side `load_weights`, as OpenRLHF and verl do; the trainer calls it on
  every process before each step's rollout, so an engine shared by several processes syncs on one of them.
- `generate`: hand the engine the prompts' token ids without their left padding, one request per row seeded
  with `row_seeds[b]` (temperature, top_k (-1 for 0), top_p, max_tokens, the sampled tokens' log-probs when
  return_logprobs), so that per-row seeds keep a response independent of the batch and of the number of
  processes; right-pad the returned token ids with `pad_token_id` and build the mask with
  `response_mask_from_ids`.
- Returned log-probs: ask for them after temperature and before top-k / top-p where the engine lets one choose,
  to match this convention. They come from another kernel than the training forward, so PPO should recompute
  them (`old_logprobs_from="recompute"`, the default) unless the difference is measured to be small.
- `close()`: release the engine's model and memory (vLLM's `LLM`, a server process).
"""

from marlhf.engines.base import (ENGINES, REGISTRY, EngineContext, Generation, RolloutEngine, check_sampling,
                                 get_engine, make_engine, model_positions, register_engine, response_mask_from_ids)
from marlhf.engines.hf import HFEngine, HFOptions  # noqa: E402  (importing an engine's file registers it)
from marlhf.engines.vllm import VLLMEngine, VLLMOptions  # noqa: E402
from marlhf.engines.vllm_server import VLLMServerEngine, VLLMServerOptions  # noqa: E402

__all__ = ["RolloutEngine", "Generation", "EngineContext", "REGISTRY", "ENGINES", "register_engine", "get_engine",
           "make_engine", "check_sampling", "model_positions", "response_mask_from_ids", "HFEngine", "HFOptions", "VLLMEngine",
           "VLLMOptions", "VLLMServerEngine", "VLLMServerOptions"]
