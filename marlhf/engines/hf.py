"""`hf`: samples with the policy itself through transformers' `generate` (KV cache on), so `sync_weights` has nothing
to copy; its options are `sampling_noise` and `kv_cache`.

Sampling is greedy decoding of temperature / top-k / top-p scores plus Gumbel noise keyed by each row's seed
(`row_seeds`), so a response depends on its prompt and seed only, not on the rest of the batch. The noise
comes from one torch generator per row (`sampling_noise="row_generators"`, B draws per token) or from a
counter-based hash of (row seed, position, token) computed for all rows at once (`"counter_hash"`, one
batched computation per token: what a GPU batch of hundreds of rows wants). Call it with the policy in eval mode
(marlhf.rollout's layout and conventions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn
from transformers import (CompileConfig, DynamicCache, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from marlhf.config import option
from marlhf.engines.base import (EngineContext, Generation, check_sampling, model_positions, register_engine,
                                 response_mask_from_ids)
from marlhf.errors import MarlhfError

__all__ = ["HFEngine", "HFOptions", "SamplingNoise", "KVCache", "generate_responses", "RowGumbelNoise",
           "CounterGumbelNoise", "SampledTokenLogprobs", "counter_uniforms", "mix32"]

SamplingNoise = Literal["row_generators", "counter_hash"]  # the hf engine's per-row noise
KVCache = Literal["dynamic", "static", "static_compiled"]


class RowGumbelNoise(LogitsProcessor):
    """Adds Gumbel noise drawn from one generator per row. Greedy decoding of the result samples from
    softmax(scores) (the Gumbel-max trick), and each row's draws depend only on its own generator, not on
    the other rows of the batch: the same seed gives the same response in any batch, on any process."""

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.generators = generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows but {len(self.generators)} generators")
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device)
                               for g in self.generators])
        return scores - torch.log(-torch.log(uniform))  # uniform = 0 gives -inf: that token is never drawn


_GOLDEN32 = 0x9E3779B9 - 2**32  # 2^32 / golden ratio (as int32): spreads consecutive counters over 32 bits


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' `lowbias32` integer hash, elementwise and in place, on an int32 tensor read as uint32:
    int32 products wrap modulo 2^32, and a mask after each shift makes it a logical (unsigned) shift."""
    x ^= (x >> 16) & 0xFFFF
    x *= 0x7FEB352D
    x ^= (x >> 15) & 0x1FFFF
    x *= 0x846CA68B - 2**32
    x ^= (x >> 16) & 0xFFFF
    return x


def counter_uniforms(row_seeds: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """`[B, V]` float32 uniforms in (0, 1), a pure function of (row seed, position, token id): one batched
    computation for all rows, the same value for a row in any batch, on any process or device. 24-bit
    resolution (like torch.rand's float32), centred in its cell so that neither 0 nor 1 occurs.
    row_seeds: `[B]` int32 (a seed in [0, 2^32) read as uint32)."""
    return _keyed_uniforms(mix32(row_seeds.clone()), _token_keys(vocab_size, row_seeds.device), position)


def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    return mix32(torch.arange(vocab_size, device=device, dtype=torch.int32) * _GOLDEN32)


def _keyed_uniforms(seed_keys: torch.Tensor, token_keys: torch.Tensor, position: int) -> torch.Tensor:
    """counter_uniforms from the hashed seeds `[B]` and token ids `[V]`, which do not change between positions."""
    row_keys = mix32(seed_keys + (position + 1) * _GOLDEN32)
    bits = mix32(mix32(row_keys[:, None] ^ token_keys[None, :]))
    return (((bits >> 8) & 0xFFFFFF).float() + 0.5) * 2.0**-24


class CounterGumbelNoise(LogitsProcessor):
    """Adds Gumbel noise from `counter_uniforms` of the rows' seeds at the current step (the Gumbel-max trick,
    as RowGumbelNoise), for all rows in one computation per token instead of one draw per row. The hashes of
    the seeds and of the token ids are computed once, not at every token."""

    def __init__(self, row_seeds: Sequence[int], device: torch.device) -> None:
        seeds = [int(seed) for seed in row_seeds]
        if any(not 0 <= seed < 2**32 for seed in seeds):
            raise ValueError("counter_hash sampling needs row seeds in [0, 2^32)")
        self.seed_keys = mix32(torch.tensor([seed - 2**32 if seed >= 2**31 else seed for seed in seeds],
                                            dtype=torch.int32, device=device))
        self.token_keys: torch.Tensor | None = None
        self.position = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != self.seed_keys.shape[0]:
            raise ValueError(f"{scores.shape[0]} rows but {self.seed_keys.shape[0]} row seeds")
        if self.token_keys is None or self.token_keys.shape[0] != scores.shape[1]:
            self.token_keys = _token_keys(scores.shape[1], scores.device)
        uniform = _keyed_uniforms(self.seed_keys, self.token_keys, self.position)
        self.position += 1
        return scores - torch.log(-torch.log(uniform))


class SampledTokenLogprobs(LogitsProcessor):
    """Records the log-probability of the token drawn at each step under the scores it is handed (placed right
    after the temperature warper: logits / temperature, before top-k / top-p truncation). The token drawn at
    one step is read from `input_ids` at the next, so one `[B, V]` distribution is kept at a time."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = scores.float().log_softmax(-1)
        return scores

    def logprobs(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """`[B, T]` log-probs of the T drawn tokens, given the tokens drawn at the last step `[B]`."""
        if self.last is None:
            raise ValueError("no token was drawn")
        return torch.stack([*self.steps, self.last.gather(1, last_tokens[:, None]).squeeze(1)], dim=1)


def generate_responses(
    policy: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    row_seeds: Sequence[int] | None = None,
    return_logprobs: bool = False,
    sampling_noise: SamplingNoise = "row_generators",
    kv_cache: KVCache = "dynamic",
    past_key_values: DynamicCache | None = None,
) -> tuple[torch.Tensor, ...]:
    """Sample one response per left-padded prompt (KV cache on), row b from its own random stream seeded by
    `row_seeds[b]` (default: seeds drawn from torch's global RNG, so seeding torch fixes them). Returns
    `(response_ids, response_mask)`, `[B, T]` with T <= max_new_tokens, padding filled with `pad_token_id`,
    and with `return_logprobs` the sampling pass's log-probs of the drawn tokens under logits / temperature
    `[B, T]` (0 on padding; those of response_logprobs up to float error, larger in low precision). Sampling
    settings not given here (e.g. a repetition penalty) come from `policy.generation_config`; such
    settings act before the temperature, so the returned log-probs include them. `sampling_noise`: where each
    row's Gumbel noise comes from (module docstring); the two give different, equally distributed samples.
    `kv_cache`: transformers' cache, grown by concatenation each token (`dynamic`) or allocated once for
    prompt + max_new_tokens (`static`: no per-token copies), or static with the decode step's forward compiled
    by torch.compile (`static_compiled`, on any device; the first call compiles). `static` stays eager even on
    GPUs, where transformers would otherwise compile a static-cache decode by itself. `past_key_values`: a dynamic
    cache (`new_cache`) that holds the keys and values of the first columns of `prompt_ids` from an earlier call, which
    are then not computed again, and which this call extends (a multi-turn rollout's next turn: marlhf.multiturn); the
    mask may have holes (False between real tokens), and positions count real tokens only."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    positions = model_positions(policy)
    if positions is not None and prompt_mask.numel():
        longest = int(prompt_mask.sum(1).max())  # positions count real tokens only (left padding has none)
        if longest + max_new_tokens > positions:
            raise MarlhfError(f"the hf engine would run past the model's {positions} positions (a prompt of {longest} "
                              f"tokens + {max_new_tokens} new ones): lower max_prompt_length or max_response_length")
    if row_seeds is None:
        row_seeds = torch.randint(2**31 - 1, (prompt_ids.shape[0],)).tolist()
    if len(row_seeds) != prompt_ids.shape[0]:
        raise ValueError(f"`row_seeds` has {len(row_seeds)} seeds for {prompt_ids.shape[0]} prompts")
    # Sampling = greedy decoding of temperature / top-k / top-p scores plus per-row Gumbel noise.
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    recorder = SampledTokenLogprobs()
    if return_logprobs:
        processors.append(recorder)
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        processors.append(TopPLogitsWarper(top_p))
    if sampling_noise == "row_generators":
        generators = [torch.Generator(prompt_ids.device).manual_seed(int(seed)) for seed in row_seeds]
        processors.append(RowGumbelNoise(generators))
    elif sampling_noise == "counter_hash":
        processors.append(CounterGumbelNoise(row_seeds, prompt_ids.device))
    else:
        raise ValueError(f"`sampling_noise` must be 'row_generators' or 'counter_hash', got {sampling_noise!r}")
    cache = _cache_arguments(kv_cache, past_key_values)
    sequences = policy.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        do_sample=False,
        temperature=1.0,
        top_p=1.0,
        logits_processor=processors,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
        **cache,
    )
    response_ids = sequences[:, prompt_ids.shape[1] :]
    response_mask = response_mask_from_ids(response_ids, eos_token_id)
    response_ids = response_ids.masked_fill(~response_mask, pad_token_id)
    if not return_logprobs:
        return response_ids, response_mask
    return response_ids, response_mask, recorder.logprobs(sequences[:, -1]).masked_fill(~response_mask, 0.0)



def _cache_arguments(kv_cache: KVCache, past_key_values: DynamicCache | None) -> dict:
    """transformers' generate arguments for the KV cache `kv_cache`, continuing `past_key_values` when given."""
    if past_key_values is not None:
        if kv_cache != "dynamic":
            raise ValueError(f"continuing a cache (`past_key_values`) needs kv_cache 'dynamic', not {kv_cache!r}")
        return {"past_key_values": past_key_values}
    if kv_cache == "dynamic":
        return {}
    if kv_cache == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    if kv_cache == "static_compiled":
        compile_config = CompileConfig()
        compile_config._compile_all_devices = True  # transformers compiles on CPUs only when asked this way
        return {"cache_implementation": "static", "compile_config": compile_config}
    raise ValueError(f"`kv_cache` must be 'dynamic', 'static' or 'static_compiled', got {kv_cache!r}")


@dataclasses.dataclass(frozen=True)
class HFOptions:
    """The hf engine's options (also PPOConfig's flat flags `--sampling_noise`, `--kv_cache`: marlhf.plugins)."""

    sampling_noise: SamplingNoise = option(
        "row_generators", "per-row Gumbel noise: one torch generator per row (B draws per token), or a hash of (row "
                          "seed, position, token) for all rows at once (for large GPU batches)")
    kv_cache: KVCache = option(
        "dynamic", "KV cache: grown each token (dynamic), allocated once (static), or static with the decode step "
                   "compiled by torch.compile (static_compiled); the same samples; static needs mixed_precision no")


@register_engine("hf", options=HFOptions)
class HFEngine:
    """Samples with the policy itself through transformers' `generate` (KV cache, per-row Gumbel noise)."""

    def __init__(self, context: EngineContext | None = None) -> None:
        options = context.options if context is not None else None
        self.options = options if isinstance(options, HFOptions) else HFOptions()
        self.policy: nn.Module | None = None

    def sync_weights(self, policy: nn.Module) -> None:
        self.policy = policy  # the very module PPO trains: nothing to copy

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **sampling) -> Generation:
        if self.policy is None:
            raise RuntimeError("sync_weights(policy) must be called before generate")
        return Generation(*generate_responses(self.policy, prompt_ids, prompt_mask, kv_cache=self.options.kv_cache,
                                              sampling_noise=self.options.sampling_noise, **sampling))

    def new_cache(self) -> DynamicCache | None:
        """An empty KV cache that `generate(..., past_key_values=cache)` fills and a later call continues (a
        multi-turn rollout's turns, marlhf.multiturn); None with a static cache, which cannot be continued."""
        if self.policy is None:
            raise RuntimeError("sync_weights(policy) must be called before new_cache")
        return DynamicCache(config=self.policy.config) if self.options.kv_cache == "dynamic" else None

    def close(self) -> None:
        self.policy = None  # holds no memory of its own: only the reference to the trained policy goes
