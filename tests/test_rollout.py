from __future__ import annotations

import shutil

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from marlhf.data.encoding import pad_sequences
from marlhf.errors import MarlhfError
from marlhf.modeling import ScalarHeadModel
from marlhf.engines.base import response_mask_from_ids
from marlhf.engines.hf import CounterGumbelNoise, RowGumbelNoise, counter_uniforms, generate_responses, mix32
from marlhf.rollout import (decode_responses, forward_in_pieces, length_sorted_pieces, response_logprobs,
                            response_values, row_lengths, score_responses, trim_padding)

PAD, EOS = 0, 2


def _eight_token_lm(seed: int = 0) -> LlamaForCausalLM:
    """A vocabulary of 8 tokens, so that sampling hits EOS within a few steps on some rows only."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
    return LlamaForCausalLM(config).eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = pad_sequences([[1, 5, 6, 7], [1, 3], [1, 4, 4], [1, 6, 3, 5], [1, 7]] * 2, PAD, "left")
    return ids, mask.bool()


def test_response_mask_keeps_first_eos_and_masks_the_rest():
    ids = torch.tensor([[5, 2, 2, 0], [5, 6, 7, 3], [2, 5, 2, 6], [4, 9, 5, 5]])
    assert response_mask_from_ids(ids, 2).tolist() == [
        [True, True, False, False], [True, True, True, True], [True, False, False, False],
        [True, True, True, True]]
    # several EOS ids (e.g. Gemma's <eos> and <end_of_turn>)
    assert response_mask_from_ids(ids, [9, 3])[3].tolist() == [True, True, False, False]
    assert response_mask_from_ids(ids, [9, 3])[1].tolist() == [True, True, True, True]


def _sample(policy, prompt_ids, prompt_mask, seeds, **overrides):
    kwargs = dict(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=EOS, pad_token_id=PAD)
    kwargs.update(overrides)
    return generate_responses(policy, prompt_ids, prompt_mask, row_seeds=seeds, **kwargs)


def test_generate_responses_shapes_masks_and_eos():
    policy = _eight_token_lm()
    prompt_ids, prompt_mask = _prompts()
    response_ids, response_mask = _sample(policy, prompt_ids, prompt_mask, range(10))
    assert response_ids.shape == response_mask.shape and response_ids.shape[0] == 10
    assert response_ids.shape[1] <= 12 and response_mask.dtype == torch.bool
    lengths = response_mask.sum(1)
    assert (lengths >= 1).all()
    assert (response_mask == (torch.arange(response_ids.shape[1]) < lengths[:, None])).all()  # right-padded
    assert (response_ids[~response_mask] == PAD).all()
    ended = lengths < response_ids.shape[1]
    assert ended.any() and (~ended).any(), "the seeds should give rows with and without an early EOS"
    last = response_ids.gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert (last[ended] == EOS).all()  # the EOS is the last real token, included in the mask
    for row in range(10):  # no EOS before the last real token
        assert EOS not in response_ids[row, : lengths[row] - 1].tolist()
    with pytest.raises(ValueError, match="row_seeds"):
        _sample(policy, prompt_ids, prompt_mask, range(3))


def test_the_hf_engine_will_not_run_past_the_models_positions():
    """Longest real prompt (4 tokens; left padding takes no position) + max_new_tokens <= 64 positions."""
    policy, (prompt_ids, prompt_mask) = _eight_token_lm(), _prompts()
    assert _sample(policy, prompt_ids, prompt_mask, range(10), max_new_tokens=60)[0].shape[1] <= 60
    padded = torch.cat([torch.zeros_like(prompt_ids), prompt_ids], dim=1)  # wider, the same real tokens
    _sample(policy, padded, torch.cat([torch.zeros_like(prompt_mask), prompt_mask], dim=1), range(10),
            max_new_tokens=60)
    with pytest.raises(MarlhfError, match=r"^the hf engine would run past the model's 64 positions \(a prompt of 4 "
                                          r"tokens \+ 61 new ones\): lower max_prompt_length or max_response_length$"):
        _sample(policy, prompt_ids, prompt_mask, range(10), max_new_tokens=61)


@pytest.mark.parametrize("noise", ["row_generators", "counter_hash"])
def test_a_row_samples_the_same_response_alone_or_in_any_batch(noise):
    policy = _eight_token_lm()
    prompt_ids, prompt_mask = _prompts()
    seeds = [100 + row for row in range(10)]
    sampling = dict(temperature=0.8, top_k=5, top_p=0.9, sampling_noise=noise)
    batch_ids, batch_mask = _sample(policy, prompt_ids, prompt_mask, seeds, **sampling)
    again = _sample(policy, prompt_ids, prompt_mask, seeds, **sampling)
    assert torch.equal(again[0], batch_ids)
    for row in (0, 1, 7):
        alone_ids, alone_mask = _sample(policy, prompt_ids[row : row + 1, prompt_mask[row]], prompt_mask[row : row + 1,
                                        prompt_mask[row]], seeds[row : row + 1], **sampling)
        assert alone_ids[0, : alone_mask.sum()].tolist() == batch_ids[row, : batch_mask[row].sum()].tolist()
    order = [9, 3, 0, 7, 1, 2, 8, 4, 6, 5]  # another batch composition: the rows shuffled
    shuffled_ids, shuffled_mask = _sample(policy, prompt_ids[order], prompt_mask[order], [seeds[r] for r in order],
                                          **sampling)
    for position, row in enumerate(order):
        assert (shuffled_ids[position, : shuffled_mask[position].sum()].tolist()
                == batch_ids[row, : batch_mask[row].sum()].tolist())
    other_ids, _ = _sample(policy, prompt_ids, prompt_mask, [s + 1 for s in seeds], sampling_noise=noise)
    assert not torch.equal(other_ids, batch_ids)
    torch.manual_seed(3)  # without row seeds, they come from torch's global RNG
    first = _sample(policy, prompt_ids, prompt_mask, None, sampling_noise=noise)
    torch.manual_seed(3)
    assert torch.equal(_sample(policy, prompt_ids, prompt_mask, None, sampling_noise=noise)[0], first[0])


@pytest.mark.parametrize("noise, kv_cache", [
    ("row_generators", "static"), ("counter_hash", "static"),
    pytest.param("row_generators", "static_compiled", marks=pytest.mark.skipif(
        shutil.which("g++") is None, reason="torch.compile on a CPU needs a C++ compiler (g++)"))])
def test_a_static_kv_cache_samples_the_same_tokens_and_logprobs(noise, kv_cache):
    policy = _eight_token_lm()
    prompt_ids, prompt_mask = _prompts()
    dynamic = _sample(policy, prompt_ids, prompt_mask, range(10), sampling_noise=noise, return_logprobs=True)
    torch._dynamo.utils.counters.clear()
    static = _sample(policy, prompt_ids, prompt_mask, range(10), sampling_noise=noise, return_logprobs=True,
                     kv_cache=kv_cache)
    compiled_frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert (compiled_frames > 0) == (kv_cache == "static_compiled")  # compiled exactly when asked
    assert torch.equal(static[0], dynamic[0]) and torch.equal(static[1], dynamic[1])
    torch.testing.assert_close(static[2], dynamic[2], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="kv_cache"):
        _sample(policy, prompt_ids, prompt_mask, range(10), kv_cache="paged")


def test_the_two_noise_sources_sample_differently():
    policy = _eight_token_lm()
    prompt_ids, prompt_mask = _prompts()
    by_generators = _sample(policy, prompt_ids, prompt_mask, range(10), sampling_noise="row_generators")[0]
    assert not torch.equal(_sample(policy, prompt_ids, prompt_mask, range(10), sampling_noise="counter_hash")[0],
                           by_generators)
    with pytest.raises(ValueError, match="sampling_noise"):
        _sample(policy, prompt_ids, prompt_mask, range(10), sampling_noise="philox")
    with pytest.raises(ValueError, match="2\\^32"):
        _sample(policy, prompt_ids, prompt_mask, [-1] * 10, sampling_noise="counter_hash")


def _lowbias32(x: int) -> int:
    """The reference: Wellons' lowbias32 on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_and_the_uniforms_are_a_function_of_seed_position_token():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF] + torch.randint(2**32, (64,)).tolist()
    as_int32 = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    assert [v & 0xFFFFFFFF for v in mix32(as_int32).tolist()] == [_lowbias32(v) for v in values]
    seeds = torch.tensor([7, 8, 2**31 - 5], dtype=torch.int32)
    u = counter_uniforms(seeds, 3, 50)
    assert u.shape == (3, 50) and u.dtype == torch.float32 and ((u > 0) & (u < 1)).all()
    assert torch.equal(counter_uniforms(seeds[[2, 0]], 3, 50), u[[2, 0]])  # per row, whatever the batch
    assert torch.equal(counter_uniforms(seeds, 3, 20), u[:, :20])  # per token
    assert not torch.equal(counter_uniforms(seeds, 4, 50), u)  # per position
    noise = CounterGumbelNoise([7, 8, 2**31 - 5], torch.device("cpu"))  # caches the seed and token hashes
    scores = torch.randn(3, 50)
    for position in range(3):
        expected = scores - torch.log(-torch.log(counter_uniforms(seeds, position, 50)))
        assert torch.equal(noise(None, scores.clone()), expected)
    many = counter_uniforms(torch.arange(400, dtype=torch.int32), 0, 500).double()
    assert abs(many.mean().item() - 0.5) < 4 * (1 / 12 / many.numel()) ** 0.5
    assert abs(((many[:, 1:] - 0.5) * (many[:, :-1] - 0.5)).mean().item() * 12) < 4 / many.numel() ** 0.5


def _chi_square_rejects(counts: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    """Pearson's chi-square test at the 0.1 % level (Wilson-Hilferty quantile); zero-probability tokens must
    never be drawn."""
    if (counts[expected_probs == 0] > 0).any():
        return True
    support = expected_probs > 0
    expected = expected_probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    quantile = df * (1 - 2 / (9 * df) + 3.0902 * (2 / (9 * df)) ** 0.5) ** 3
    return statistic > quantile


@pytest.mark.parametrize("noise", ["row_generators", "counter_hash"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 4, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.9)])
def test_chi_square_sampled_tokens_follow_the_warped_softmax(noise, temperature, top_k, top_p):
    """Tokens drawn by greedy decoding of warped logits plus the noise, over 20,000 row seeds and 3 positions,
    follow softmax(logits / T) restricted by top-k / top-p; the same counts are rejected against the
    unwarped softmax (the test has the power to fail)."""
    vocab, rows = 12, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    seeds = list(range(rows))
    noise_processor = (CounterGumbelNoise(seeds, torch.device("cpu")) if noise == "counter_hash" else
                       RowGumbelNoise([torch.Generator().manual_seed(seed) for seed in seeds]))
    dummy_ids = torch.zeros(rows, 1, dtype=torch.long)
    warped = warpers(dummy_ids, logits.expand(rows, vocab).clone())
    expected = torch.softmax(warped[0], dim=-1)
    for _ in range(3):  # successive positions draw fresh noise
        tokens = noise_processor(dummy_ids, warped.clone()).argmax(-1)
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert not _chi_square_rejects(counts, expected.double())
        assert _chi_square_rejects(counts, torch.softmax(logits, dim=-1).double())


def test_samples_follow_softmax_of_scaled_logits_with_top_k():
    """The Gumbel-max sampler draws each token with probability softmax(logits / temperature), renormalised
    over the top-k tokens: first-token frequencies over many seeds."""
    policy = _eight_token_lm()
    num_samples = 4000
    prompt_ids = torch.tensor([[1, 5, 6]]).expand(num_samples, 3)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    logits = policy(input_ids=prompt_ids[:1]).logits[0, -1]
    for temperature, top_k in ((0.7, 0), (1.0, 3)):
        first, _ = _sample(policy, prompt_ids, prompt_mask, range(num_samples), max_new_tokens=1,
                           temperature=temperature, top_k=top_k)
        scaled = logits / temperature
        if top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
        expected = torch.softmax(scaled, dim=-1)
        frequencies = torch.bincount(first[:, 0], minlength=8).float() / num_samples
        assert (frequencies[expected == 0] == 0).all()
        torch.testing.assert_close(frequencies, expected, atol=0.025, rtol=0)


def test_top_k_one_is_greedy():
    policy = _eight_token_lm()
    prompt_ids, prompt_mask = _prompts()
    greedy, _ = _sample(policy, prompt_ids, prompt_mask, range(10), max_new_tokens=6, temperature=0.8, top_k=1)
    logits = policy(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                    position_ids=(prompt_mask.long().cumsum(1) - 1).clamp(min=0)).logits[:, -1]
    assert torch.equal(greedy[:, 0], logits.argmax(-1))
    with pytest.raises(ValueError, match="top_p"):
        _sample(policy, prompt_ids, prompt_mask, range(10), top_p=0.0)


def _unpadded(prompt_ids, prompt_mask, response_ids, response_mask, row):
    prompt = prompt_ids[row][prompt_mask[row]]
    response = response_ids[row][response_mask[row]]
    return prompt, response


def test_logprobs_values_and_scores_match_unpadded_forward():
    """Batched, padded, pieced results equal a plain full log_softmax / forward on each row alone."""
    policy, other = _eight_token_lm(0), _eight_token_lm(1)
    torch.manual_seed(0)
    critic = ScalarHeadModel(_eight_token_lm(2).model).eval()
    prompt_ids, prompt_mask = _prompts()
    response_ids, response_mask = _sample(policy, prompt_ids, prompt_mask, range(10), max_new_tokens=9)
    temperature = 0.7
    with torch.no_grad():
        rollout = score_responses(prompt_ids, prompt_mask, response_ids, response_mask, policy=policy, ref=other,
                                  temperature=temperature, critic=critic, reward_model=critic)
        for row in range(prompt_ids.shape[0]):
            prompt, response = _unpadded(prompt_ids, prompt_mask, response_ids, response_mask, row)
            sequence = torch.cat([prompt, response])[None]
            start, length = len(prompt) - 1, len(response)
            for model, got in ((policy, rollout.logprobs), (other, rollout.ref_logprobs)):
                full = torch.log_softmax(model(input_ids=sequence).logits[0] / temperature, dim=-1)
                expected = full[start : start + length].gather(1, response[:, None]).squeeze(1)
                torch.testing.assert_close(got[row, :length], expected, atol=1e-5, rtol=1e-5)
                assert (got[row, length:] == 0).all()
            values = critic(sequence, torch.ones_like(sequence))[0]
            torch.testing.assert_close(rollout.values[row, :length], values[start : start + length])
            assert (rollout.values[row, length:] == 0).all()
            torch.testing.assert_close(rollout.scores[row], values[-1])  # last real token of prompt + response
    assert rollout.logprobs.shape == rollout.values.shape == response_mask.shape
    assert rollout.scores.shape == (prompt_ids.shape[0],)
    assert (rollout.logprobs[response_mask] < 0).all()
    # the same helpers with gradients (the PPO update)
    grads = response_logprobs(policy, prompt_ids, prompt_mask, response_ids, response_mask, temperature)
    assert grads.requires_grad
    torch.testing.assert_close(grads.detach(), rollout.logprobs)
    assert response_values(critic, prompt_ids, prompt_mask, response_ids, response_mask).requires_grad


def test_given_logprobs_and_values_replace_those_forwards():
    policy, other = _eight_token_lm(0), _eight_token_lm(1)
    critic = ScalarHeadModel(_eight_token_lm(2).model).eval()
    prompt_ids, prompt_mask = _prompts()
    batch = (prompt_ids, prompt_mask, *_sample(policy, prompt_ids, prompt_mask, range(10), max_new_tokens=5))
    computed = score_responses(*batch, policy=policy, ref=other, temperature=0.9, critic=critic, reward_model=critic)
    logprobs = response_logprobs(policy, *batch, temperature=0.9)  # with gradients, as PPO keeps them
    values = response_values(critic, *batch)
    given = score_responses(*batch, logprobs=logprobs, values=values, ref=other, temperature=0.9, reward_model=critic)
    assert not given.logprobs.requires_grad and not given.values.requires_grad
    for field in ("logprobs", "ref_logprobs", "values", "scores"):
        torch.testing.assert_close(getattr(given, field), getattr(computed, field))
    without_reference = score_responses(*batch, policy=policy, ref=None, temperature=0.9, critic=critic,
                                        reward_model=critic)
    assert without_reference.ref_logprobs is None
    for field in ("logprobs", "values", "scores"):
        assert torch.equal(getattr(without_reference, field), getattr(computed, field))
    with pytest.raises(ValueError, match="`policy` and `logprobs`"):
        score_responses(*batch, policy=policy, logprobs=logprobs, ref=other, temperature=0.9, reward_model=critic)
    with pytest.raises(ValueError, match="`critic` and `values`"):
        score_responses(*batch, policy=policy, critic=critic, values=values, ref=other, temperature=0.9,
                        reward_model=critic)
    with pytest.raises(ValueError, match="`values` has shape"):
        score_responses(*batch, policy=policy, values=values[:, :-1], ref=other, temperature=0.9, reward_model=critic)


def test_reward_function_gets_prompts_and_decoded_responses(tiny_tokenizer, make_tiny_causal_lm):
    policy = make_tiny_causal_lm().eval()
    prompts = ["Human: hi\n\nAssistant:", "The quick brown fox"]
    prompt_ids, prompt_mask = pad_sequences([tiny_tokenizer(p)["input_ids"] for p in prompts],
                                          tiny_tokenizer.pad_token_id, "left")
    response_texts = [" jumps over", " the lazy dog."]
    rows = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
            for t in response_texts]
    response_ids, response_mask = pad_sequences(rows, tiny_tokenizer.pad_token_id, "right")
    seen = []

    def reward_fn(batch_prompts, responses):
        seen.append((batch_prompts, responses))
        return [float(len(r)) for r in responses]

    rollout = score_responses(prompt_ids, prompt_mask.bool(), response_ids, response_mask.bool(), policy=policy,
                              ref=policy, temperature=1.0, reward_fn=reward_fn, prompts=prompts,
                              tokenizer=tiny_tokenizer)
    assert seen == [(prompts, response_texts)]
    assert decode_responses(tiny_tokenizer, response_ids, response_mask.bool()) == response_texts
    assert rollout.scores.tolist() == [11.0, 14.0] and rollout.values is None
    torch.testing.assert_close(rollout.logprobs, rollout.ref_logprobs)
    with pytest.raises(ValueError, match="exactly one"):
        score_responses(prompt_ids, prompt_mask.bool(), response_ids, response_mask.bool(), policy=policy, ref=policy,
                        temperature=1.0)
    with pytest.raises(ValueError, match="scores for 2 responses"):
        score_responses(prompt_ids, prompt_mask.bool(), response_ids, response_mask.bool(), policy=policy, ref=policy,
                        temperature=1.0, reward_fn=lambda p, r: [1.0], prompts=prompts, tokenizer=tiny_tokenizer)


def test_trim_padding_cuts_the_columns_every_row_pads():
    prompt_ids = torch.tensor([[0, 0, 0, 5, 6], [0, 0, 4, 4, 4]])
    prompt_mask = prompt_ids != 0
    response_ids = torch.tensor([[7, 2, 0, 0], [7, 7, 7, 0]])
    response_mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    assert row_lengths(prompt_mask, response_mask) == ([2, 3], [2, 3])
    q_ids, q_mask, r_ids, r_mask = trim_padding(prompt_ids, prompt_mask, response_ids, response_mask, [2, 3], [2, 3])
    assert q_ids.tolist() == [[0, 5, 6], [4, 4, 4]] and q_mask.tolist() == [[False, True, True], [True] * 3]
    assert r_ids.tolist() == [[7, 2, 0], [7, 7, 7]] and r_mask.tolist() == [[True, True, False], [True] * 3]
    empty = trim_padding(prompt_ids, prompt_mask, response_ids, torch.zeros_like(response_mask), [2, 3], [0, 0])
    assert empty[2].shape == (2, 1)  # one response column stays, so a forward still has a token to score
    assert trim_padding(prompt_ids[:, 2:], prompt_mask[:, 2:], response_ids[:, :3], response_mask[:, :3],
                        [2, 3], [2, 3])[0].shape[1] == 3


def test_trim_padding_equals_the_columns_the_masks_use():
    """Host lengths give the columns a mask-based cut gives, on random ragged batches (empty rows too)."""
    generator = torch.Generator().manual_seed(5)
    for _ in range(50):
        rows = int(torch.randint(1, 6, (1,), generator=generator))
        prompt_mask = torch.arange(7) >= torch.randint(0, 8, (rows, 1), generator=generator)
        response_mask = torch.arange(6) < torch.randint(0, 7, (rows, 1), generator=generator)
        batch = (torch.randint(0, 9, (rows, 7), generator=generator), prompt_mask,
                 torch.randint(0, 9, (rows, 6), generator=generator), response_mask)
        first = int(prompt_mask.any(0).long().argmax()) if prompt_mask.any() else 7
        width = max(int(response_mask.any(0).sum()), 1)
        expected = (batch[0][:, first:], prompt_mask[:, first:], batch[2][:, :width], response_mask[:, :width])
        for got, want in zip(trim_padding(*batch, *row_lengths(prompt_mask, response_mask)), expected):
            assert torch.equal(got, want)


def test_length_sorted_pieces_cover_every_row_once():
    generator = torch.Generator().manual_seed(0)
    prompt_mask = torch.arange(9) >= torch.randint(0, 9, (11, 1), generator=generator)
    response_mask = torch.arange(7) < torch.randint(0, 8, (11, 1), generator=generator)
    lengths = prompt_mask.sum(1) + response_mask.sum(1)
    expected = lengths.argsort(descending=True, stable=True).tolist()  # longest first, ties in row order
    for piece_size in (1, 3, 11, 50):
        pieces = length_sorted_pieces(*row_lengths(prompt_mask, response_mask), piece_size)
        assert [row for piece in pieces for row in piece] == expected
        assert all(len(c) <= piece_size for c in pieces) and len(pieces) == -(-11 // piece_size)
    with pytest.raises(ValueError, match="piece_size"):
        length_sorted_pieces([1], [1], 0)


@pytest.mark.parametrize("piece_size", [None, 1, 3, 10])
def test_forward_in_pieces_equals_one_padded_forward(piece_size):
    """Length-sorted, trimmed pieces give what one forward over the whole padded batch gives, in row order,
    for per-token and per-row outputs, with gradients."""
    policy = _eight_token_lm(0)
    critic = ScalarHeadModel(_eight_token_lm(2).model).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 8, (int(n),), generator=generator).tolist()
               for n in torch.randint(0, 20, (10,), generator=generator)]
    prompt_ids, prompt_mask = pad_sequences(prompts, PAD, "left")
    batch = (prompt_ids, prompt_mask.bool(), *_sample(policy, prompt_ids, prompt_mask.bool(), range(10)))
    assert batch[3].sum(1).unique().numel() > 2  # ragged responses too

    def logprobs(*rows):
        return response_logprobs(policy, *rows, temperature=0.7)

    def scores(*rows):
        return critic.score(torch.cat(rows[0::2], 1), torch.cat(rows[1::2], 1).long())

    for forward in (logprobs, lambda *rows: response_values(critic, *rows), scores):
        pieced = forward_in_pieces(forward, *batch, piece_size=piece_size)
        whole = forward(*batch)
        assert pieced.shape == whole.shape
        torch.testing.assert_close(pieced, whole, atol=1e-5, rtol=1e-5)
    pieced = forward_in_pieces(logprobs, *batch, piece_size=piece_size)
    pieced.sum().backward()
    expected = torch.autograd.grad(logprobs(*batch).sum(), policy.lm_head.weight)[0]
    torch.testing.assert_close(policy.lm_head.weight.grad, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 0.9)])
def test_sampling_pass_logprobs_equal_a_full_forward(top_k, top_p):
    policy = _eight_token_lm()
    prompt_ids, prompt_mask = _prompts()
    response_ids, response_mask, logprobs = _sample(policy, prompt_ids, prompt_mask, range(10), temperature=0.7,
                                                    top_k=top_k, top_p=top_p, return_logprobs=True)
    again, _ = _sample(policy, prompt_ids, prompt_mask, range(10), temperature=0.7, top_k=top_k, top_p=top_p)
    assert torch.equal(again, response_ids)  # recording changes nothing about the draw
    assert (~response_mask).any(), "the seeds should give rows that end early"
    with torch.no_grad():
        expected = response_logprobs(policy, prompt_ids, prompt_mask, response_ids, response_mask, 0.7)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
    assert (logprobs[~response_mask] == 0).all()
