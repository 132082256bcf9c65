"""Rollouts for PPO: sample responses to a batch of prompts, then score them.

Layout of one batch (B rows): the prompts are left-padded `[B, P]` and the sampled responses are
right-padded `[B, T]`, so `cat([query, response], 1)` puts every prompt's last token at column
P - 1 and every response's first token at column P. A response keeps its EOS token; tokens after
the first EOS are padding (mask False). All per-token outputs are `[B, T]` over response tokens,
0 on padding, aligned so that position t describes the action "emit response token t":
log-probs of token t and the critic's value of the state just before it.

Sampling is greedy decoding of temperature / top-k / top-p scores plus Gumbel noise keyed by each row's seed
(`row_seeds`), so a response depends on its prompt and seed only, not on the rest of the batch. The noise
comes from one torch generator per row (`sampling_noise="row_generators"`, B draws per token) or from a
counter-based hash of (row seed, position, token) computed for all rows at once (`"counter_hash"`, one
batched computation per token: what a GPU batch of hundreds of rows wants).

Call these with the models in eval mode: PPO's ratio compares the rollout's log-probs with a later
forward pass of the same weights, which dropout would perturb.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import (CompileConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from marlhf.modeling import ScalarHeadModel, sequence_logprobs

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


SamplingNoise = Literal["row_generators", "counter_hash"]  # the hf engine's per-row noise
KVCache = Literal["dynamic", "static", "static_compiled"]


@dataclass
class Rollout:
    query_ids: torch.Tensor  # [B, P] long, left-padded
    query_mask: torch.Tensor  # [B, P] bool
    response_ids: torch.Tensor  # [B, T] long, right-padded with pad_token_id
    response_mask: torch.Tensor  # [B, T] bool, True on response tokens (EOS included)
    logprobs: torch.Tensor  # [B, T] policy log-probs of the sampled tokens
    ref_logprobs: torch.Tensor | None  # [B, T] frozen reference log-probs of the same tokens; None without one
    values: torch.Tensor | None  # [B, T] critic values before each token; None without a critic
    scores: torch.Tensor  # [B] reward of each full response (reward model or reward function)
    query_lengths: list[int]  # prompt tokens of each row, on the host (row_lengths)
    response_lengths: list[int]  # response tokens of each row, on the host


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """True up to and including the first EOS of each row (the whole row when there is none)."""
    eos_ids = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos_ids).long()
    eos_before = is_eos.cumsum(1) - is_eos  # number of EOS strictly before each position
    return eos_before == 0


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


@torch.no_grad()
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


def generate_responses(
    policy: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
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
    GPUs, where transformers would otherwise compile a static-cache decode by itself."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if row_seeds is None:
        row_seeds = torch.randint(2**31 - 1, (query_ids.shape[0],)).tolist()
    if len(row_seeds) != query_ids.shape[0]:
        raise ValueError(f"`row_seeds` has {len(row_seeds)} seeds for {query_ids.shape[0]} prompts")
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
        generators = [torch.Generator(query_ids.device).manual_seed(int(seed)) for seed in row_seeds]
        processors.append(RowGumbelNoise(generators))
    elif sampling_noise == "counter_hash":
        processors.append(CounterGumbelNoise(row_seeds, query_ids.device))
    else:
        raise ValueError(f"`sampling_noise` must be 'row_generators' or 'counter_hash', got {sampling_noise!r}")
    if kv_cache == "dynamic":
        cache = {}
    elif kv_cache == "static":
        cache = {"cache_implementation": "static", "disable_compile": True}
    elif kv_cache == "static_compiled":
        compile_config = CompileConfig()
        compile_config._compile_all_devices = True  # transformers compiles on CPUs only when asked this way
        cache = {"cache_implementation": "static", "compile_config": compile_config}
    else:
        raise ValueError(f"`kv_cache` must be 'dynamic', 'static' or 'static_compiled', got {kv_cache!r}")
    sequences = policy.generate(
        input_ids=query_ids,
        attention_mask=query_mask.long(),
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
    response_ids = sequences[:, query_ids.shape[1] :]
    response_mask = response_mask_from_ids(response_ids, eos_token_id)
    response_ids = response_ids.masked_fill(~response_mask, pad_token_id)
    if not return_logprobs:
        return response_ids, response_mask
    return response_ids, response_mask, recorder.logprobs(sequences[:, -1]).masked_fill(~response_mask, 0.0)


def _sequence(query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of prompt + response."""
    return torch.cat([query_ids, response_ids], dim=1), torch.cat([query_mask, response_mask], dim=1).long()


def row_lengths(query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Prompt and response token counts of each row, read to the host once (one device read) so that
    trim_padding and length_sorted_chunks need none."""
    query_lengths, response_lengths = torch.stack([query_mask.sum(1), response_mask.sum(1)]).tolist()
    return query_lengths, response_lengths


def trim_padding(query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor, query_lengths: Sequence[int],
                 response_lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows without the columns that are padding in all of them (leading prompt columns, trailing
    response columns; at least one response column stays), given the rows' token counts (row_lengths).
    Positions come from the masks, so outputs on real tokens do not change, and a forward pass costs only
    the columns left."""
    first = query_ids.shape[1] - max(query_lengths, default=0)  # left padding: the real columns are a suffix
    width = max(max(response_lengths, default=0), 1)  # right padding: the real columns are a prefix
    return query_ids[:, first:], query_mask[:, first:], response_ids[:, :width], response_mask[:, :width]


def length_sorted_chunks(query_lengths: Sequence[int], response_lengths: Sequence[int],
                         chunk_size: int) -> list[list[int]]:
    """Row indices, longest rows (prompt + response tokens) first, ties in row order, in chunks of at most
    `chunk_size`: rows of similar length share a chunk, so trim_padding cuts most of each chunk's padding."""
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be >= 1, got {chunk_size}")
    lengths = [q + r for q, r in zip(query_lengths, response_lengths, strict=True)]
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])  # sorted is stable
    return [order[start : start + chunk_size] for start in range(0, len(order), chunk_size)]


def forward_in_chunks(forward: Callable[..., torch.Tensor], query_ids: torch.Tensor, query_mask: torch.Tensor,
                      response_ids: torch.Tensor, response_mask: torch.Tensor, chunk_size: int | None = None,
                      lengths: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`forward(query_ids, query_mask, response_ids, response_mask)` over length_sorted_chunks of the rows, each
    trimmed by trim_padding, put back in row order: `[B]` results as they are, `[rows, T']` per-token results
    right-padded with 0 to `[B, T]`. `chunk_size` None: all rows at once. `lengths`: the rows' row_lengths, if
    the caller has them (else read here)."""
    batch = (query_ids, query_mask, response_ids, response_mask)
    query_lengths, response_lengths = lengths if lengths is not None else row_lengths(query_mask, response_mask)
    chunks = length_sorted_chunks(query_lengths, response_lengths, chunk_size or query_ids.shape[0])
    outputs = []
    for rows in chunks:
        index = torch.tensor(rows, device=query_ids.device)
        output = forward(*trim_padding(*(x[index] for x in batch), [query_lengths[row] for row in rows],
                                       [response_lengths[row] for row in rows]))
        if output.dim() == 2:
            output = nn.functional.pad(output, (0, response_ids.shape[1] - output.shape[1]))
        outputs.append(output)
    order = torch.tensor([row for rows in chunks for row in rows], device=query_ids.device)
    return torch.cat(outputs)[order.argsort()]


def response_logprobs(
    model: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs `[B, T]` of the response tokens under `model`, from logits divided by the sampling
    temperature (the distribution the tokens were drawn from, before top-k/top-p truncation). One
    forward pass; gradients flow when enabled. 0 on padding."""
    input_ids, attention_mask = _sequence(query_ids, query_mask, response_ids, response_mask)
    logprobs = sequence_logprobs(model, input_ids, attention_mask, num_tokens=response_ids.shape[1],
                                 temperature=temperature)
    return logprobs.masked_fill(~response_mask, 0.0)


def response_values(
    critic: nn.Module,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Critic values `[B, T]`: entry t is the value of the state before response token t (the
    critic's output at column P-1+t). 0 on padding."""
    values = critic(*_sequence(query_ids, query_mask, response_ids, response_mask))
    num_response = response_ids.shape[1]
    return values[:, -num_response - 1 : -1].masked_fill(~response_mask, 0.0)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Response texts without padding and special tokens (EOS)."""
    return tokenizer.batch_decode(response_ids.masked_fill(~response_mask, tokenizer.pad_token_id),
                                  skip_special_tokens=True)


@torch.no_grad()
def score_responses(
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ref: nn.Module | None,
    temperature: float,
    policy: nn.Module | None = None,
    logprobs: torch.Tensor | None = None,
    critic: nn.Module | None = None,
    values: torch.Tensor | None = None,
    reward_model: ScalarHeadModel | None = None,
    reward_fn: RewardFn | None = None,
    prompts: list[str] | None = None,
    tokenizer=None,
    chunk_size: int | None = None,
    reward_kwargs: dict[str, list] | None = None,
) -> Rollout:
    """Everything PPO needs about sampled responses, one batched forward per model: policy and
    reference log-probs (none when `ref` is None), critic values (when there is a critic) and one score per
    response, from `reward_model` or, when given instead, from `reward_fn(prompts, decoded_responses)`.

    The policy's log-probs come from `policy`, or are `logprobs` the caller already computed (PPO does, with
    gradients, when its update reuses that forward); likewise the critic's values come from `critic` or are
    `values`. Given tensors are stored detached. `reward_kwargs` (record fields, a list each) go to `reward_fn`
    as keyword arguments (TRL's convention, marlhf.rewards.functions). Models see `chunk_size` rows at a time (None: all), rows of
    similar length together with their common padding cut (forward_in_chunks)."""
    if (policy is None) == (logprobs is None):
        raise ValueError("give exactly one of `policy` and `logprobs`")
    if critic is not None and values is not None:
        raise ValueError("give at most one of `critic` and `values`")
    if (reward_model is None) == (reward_fn is None):
        raise ValueError("give exactly one of `reward_model` and `reward_fn`")
    if reward_fn is not None and (prompts is None or tokenizer is None):
        raise ValueError("`reward_fn` needs the `prompts` texts and a `tokenizer` to decode responses")
    if prompts is not None and len(prompts) != query_ids.shape[0]:
        raise ValueError(f"`prompts` has {len(prompts)} texts for {query_ids.shape[0]} rows")
    batch = (query_ids, query_mask, response_ids, response_mask)
    for name, given in (("logprobs", logprobs), ("values", values)):
        if given is not None and given.shape != response_ids.shape:
            raise ValueError(f"`{name}` has shape {tuple(given.shape)}, the responses {tuple(response_ids.shape)}")

    lengths = row_lengths(query_mask, response_mask)

    def run(forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        return forward_in_chunks(forward, *batch, chunk_size=chunk_size, lengths=lengths)

    if policy is not None:
        logprobs = run(lambda *rows: response_logprobs(policy, *rows, temperature=temperature))
    ref_logprobs = None
    if ref is not None:
        ref_logprobs = run(lambda *rows: response_logprobs(ref, *rows, temperature=temperature))
    if critic is not None:
        values = run(lambda *rows: response_values(critic, *rows))
    logprobs, values = logprobs.detach(), values.detach() if values is not None else None
    if reward_model is not None:  # at the last real token of prompt + response
        scores = run(lambda *rows: reward_model.score(*_sequence(*rows)))
    else:
        responses = decode_responses(tokenizer, response_ids, response_mask)
        scores = torch.tensor([float(s) for s in reward_fn(prompts, responses, **(reward_kwargs or {}))],
                              device=query_ids.device)
        if scores.shape != (len(responses),):
            raise ValueError(f"`reward_fn` returned {scores.numel()} scores for {len(responses)} responses")
    return Rollout(query_ids, query_mask, response_ids, response_mask, logprobs, ref_logprobs, values, scores, *lengths)
