import pytest
import torch

from marlhf._checks import check_segment_ids
from marlhf.segments import (
    broadcast_segments,
    fixed_ngram,
    num_segments,
    perplexity,
    randomized_ngram,
    segment_last_token,
    segment_lengths,
    segment_sum,
    split_last_token,
    word_starts,
    words,
)
from tests.reference import (
    fixed_ngram_ref,
    perplexity_ref,
    random_batch,
    randomized_from_order_ref,
    segments_of_row,
)
from tests.sweeps import seeds


@pytest.mark.parametrize("seed", seeds(5))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 64, None])
def test_fixed_ngram_matches_reference(seed, n):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(9, 13, g)
    ids = fixed_ngram(mask, n)
    assert ids.tolist() == fixed_ngram_ref(lengths, 13, n)
    check_segment_ids(ids, mask)


@pytest.mark.parametrize("n", ["inf", float("inf")])
def test_fixed_ngram_inf_spellings(n):
    mask, _ = random_batch(4, 6, torch.Generator().manual_seed(0))
    assert torch.equal(fixed_ngram(mask, n), fixed_ngram(mask, None))


def test_fixed_ngram_one_segment_per_row_and_one_token_per_segment():
    mask, lengths = random_batch(6, 10, torch.Generator().manual_seed(1))
    assert num_segments(fixed_ngram(mask, None)).tolist() == [min(n, 1) for n in lengths]
    assert num_segments(fixed_ngram(mask, 1)).tolist() == lengths


@pytest.mark.parametrize("bad", [0, -3, 2.5, "5", True])
def test_fixed_ngram_rejects_bad_n(bad):
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="`n`"):
        fixed_ngram(mask, bad)


def test_mask_checks():
    with pytest.raises(ValueError, match="`mask` must be a bool"):
        fixed_ngram(torch.ones(2, 4), 2)
    with pytest.raises(ValueError, match=r"`mask` must have shape \[B, T\]"):
        fixed_ngram(torch.ones(4, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="right-padded"):
        fixed_ngram(torch.tensor([[False, True]]), 2)


def test_all_padding_and_empty_width():
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for ids in (fixed_ngram(mask, 2), randomized_ngram(mask), perplexity(mask, torch.randn(3, 5))):
        assert (ids == -1).all()
    empty = torch.zeros(2, 0, dtype=torch.bool)
    assert fixed_ngram(empty, 3).shape == (2, 0)
    assert randomized_ngram(empty).shape == (2, 0)
    assert perplexity(empty, torch.zeros(2, 0)).shape == (2, 0)
    assert num_segments(fixed_ngram(empty, 3)).tolist() == [0, 0]


@pytest.mark.parametrize("seed", seeds(6))
def test_randomized_ngram_matches_reference(seed):
    lengths_pool, repeat = (2, 3, 5, 10), 2
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(8, 60, torch.Generator().manual_seed(100 + seed))
    ids = randomized_ngram(mask, lengths_pool, repeat, generator=g)
    check_segment_ids(ids, mask)
    pool = list(lengths_pool) * repeat
    # Same draw as the implementation, then the assignment done by a plain loop.
    orders = torch.rand(8, len(pool), generator=torch.Generator().manual_seed(seed)).argsort(1).tolist()
    assert ids.tolist() == randomized_from_order_ref(lengths, 60, pool, orders)


def test_randomized_ngram_properties():
    # Rows longer than the pool: its lengths appear exactly once each (in some order), then
    # the remainder segment.
    pool = [2, 3, 5, 10] * 3
    mask = torch.ones(32, 80, dtype=torch.bool)
    ids = randomized_ngram(mask, generator=torch.Generator().manual_seed(0))
    lengths = segment_lengths(ids)
    for row in lengths.tolist():
        assert sorted(row[: len(pool)]) == sorted(pool)
        assert row[len(pool)] == 80 - sum(pool)
    # Rows are shuffled independently, and a seed reproduces the draw.
    assert len({tuple(r) for r in lengths.tolist()}) > 1
    again = randomized_ngram(mask, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)


def test_randomized_ngram_rejects_bad_lengths():
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="`lengths`"):
        randomized_ngram(mask, (2, 0))
    with pytest.raises(ValueError, match="`lengths`"):
        randomized_ngram(mask, ())
    with pytest.raises(ValueError, match="`repeat_times`"):
        randomized_ngram(mask, (2, 3), 0)


@pytest.mark.parametrize("seed", seeds(6))
def test_perplexity_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(10, 30, g)
    ref_logprobs = -torch.rand(10, 30, generator=g) * 4
    ids = perplexity(mask, ref_logprobs)
    check_segment_ids(ids, mask)
    assert ids.tolist() == perplexity_ref(lengths, 30, ref_logprobs.tolist())


def test_perplexity_rule_on_a_hand_example():
    # NLLs 1, 1 (equal: grows), 0.5 (lowers the mean: grows), 2 (raises it: new segment), 1 (grows)
    mask = torch.ones(1, 5, dtype=torch.bool)
    nll = torch.tensor([[1.0, 1.0, 0.5, 2.0, 1.0]])
    assert perplexity(mask, -nll).tolist() == [[0, 0, 0, 1, 1]]


def test_perplexity_rejects_nan_and_shape():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="`ref_logprobs`"):
        perplexity(mask, torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="`ref_logprobs`"):
        perplexity(mask, torch.zeros(2, 4))
    # NaN on padding is ignored: padding is not part of the response.
    pad_mask = torch.tensor([[True, True, False]])
    assert perplexity(pad_mask, torch.tensor([[-1.0, -1.0, float("nan")]])).tolist() == [[0, 0, -1]]


@pytest.mark.parametrize("seed", seeds(4))
def test_segment_reductions_match_loops(seed):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(7, 17, g)
    ids = fixed_ngram(mask, 4)
    x = torch.randn(7, 17, generator=g)
    sums, counts = segment_sum(x, ids), segment_lengths(ids)
    slots = max(len(segments_of_row(r)) for r in ids.tolist())
    assert sums.shape == (7, slots)
    for b, row in enumerate(ids.tolist()):
        segs = segments_of_row(row)
        for k in range(slots):
            expected = sum(x[b, t].item() for t in segs[k]) if k < len(segs) else 0.0
            assert sums[b, k].item() == pytest.approx(expected, abs=1e-5)
            assert counts[b, k].item() == (len(segs[k]) if k < len(segs) else 0)
    back = broadcast_segments(sums, ids)
    for b, row in enumerate(ids.tolist()):
        for t, s in enumerate(row):
            assert back[b, t].item() == (sums[b, s].item() if s >= 0 else 0.0)
    last = segment_last_token(ids)
    assert [[t for t in range(17) if last[b, t]] for b in range(7)] == [
        [seg[-1] for seg in segments_of_row(r)] for r in ids.tolist()
    ]


def test_segment_sum_gradient():
    mask, _ = random_batch(4, 6, torch.Generator().manual_seed(3))
    ids = fixed_ngram(mask, 2)
    x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: segment_sum(v, ids), (x,))


def test_split_last_token():
    mask, lengths = random_batch(8, 9, torch.Generator().manual_seed(5))
    for n in (1, 3, None):
        ids = split_last_token(fixed_ngram(mask, n), mask)
        check_segment_ids(ids, mask)
        for row, length in zip(ids.tolist(), lengths):
            segs = segments_of_row(row)
            if length:
                assert segs[-1] == [length - 1]
            expected = fixed_ngram_ref([length], 9, n)[0]
            # Every other token keeps its segment.
            assert row[: max(length - 1, 0)] == expected[: max(length - 1, 0)]


def test_check_segment_ids_rejects_bad_numbering():
    mask = torch.ones(1, 4, dtype=torch.bool)
    for bad in ([[0, 2, 2, 3]], [[1, 1, 2, 2]], [[0, 0, -1, 1]], [[0, 1, 0, 1]]):
        with pytest.raises(ValueError, match="`segment_ids`"):
            check_segment_ids(torch.tensor(bad), mask)


def words_ref(lengths: list[int], width: int, starts: list[list[bool]]) -> list[list[int]]:
    rows = []
    for length, row_starts in zip(lengths, starts):
        row, seg = [], -1
        for t in range(length):
            if t == 0 or row_starts[t]:
                seg += 1
            row.append(seg)
        rows.append(row + [-1] * (width - length))
    return rows


@pytest.mark.parametrize("seed", seeds(5))
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_words_matches_reference(seed, rate):
    g = torch.Generator().manual_seed(seed)
    mask, lengths = random_batch(9, 13, g)  # empty, length-1 and full rows included
    starts = torch.rand(mask.shape, generator=g) < rate  # starts on padding must be ignored
    ids = words(mask, starts)
    check_segment_ids(ids, mask)
    assert ids.tolist() == words_ref(lengths, 13, starts.tolist())


def test_words_edge_cases_and_bad_input():
    assert words(torch.zeros(3, 0, dtype=torch.bool), torch.zeros(3, 0, dtype=torch.bool)).shape == (3, 0)
    padding = torch.zeros(2, 4, dtype=torch.bool)
    assert (words(padding, ~padding) == -1).all()
    with pytest.raises(ValueError, match="`starts`"):
        words(torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3))
    with pytest.raises(ValueError, match="`starts`"):
        words(torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool))


def test_word_starts_with_a_continuing_subword_prefix():
    """The demo's tokenizer: word-inner pieces carry ##; a word is the tokens from one without it to the next."""
    from marlhf.demo.task import SyntheticTask
    from marlhf.demo.tokenizer import train_tokenizer

    task = SyntheticTask()
    tokenizer = train_tokenizer(task.pretraining_texts(300, seed=0))
    responses = [r["response"] for r in task.sft_records(4, seed=0)]
    encoded = [tokenizer(r)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
    width = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_token_id] * (width - len(e)) for e in encoded])
    mask = torch.arange(width)[None, :] < torch.tensor([len(e) for e in encoded])[:, None]
    segment_ids = words(mask, word_starts(ids, tokenizer))
    for row, response, length in zip(segment_ids.tolist(), responses, mask.sum(1).tolist()):
        pieces = segments_of_row(row)
        assert len(pieces) == len(response.split()) + 1 and pieces[-1] == [length - 1]  # the words, then EOS
    first = segments_of_row(segment_ids[0].tolist())
    assert [tokenizer.decode(ids[0, p].tolist()) for p in first[:-1]] == responses[0].split()


def test_word_starts_with_a_space_marker():
    """Byte-level BPE (GPT-2, Llama 3, Qwen): a token that begins with Ġ begins a word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["the cat sat on the mat", "a dog ran far"] * 20,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    ids = torch.tensor([tokenizer("the cat sat")["input_ids"] + [tokenizer.eos_token_id]])
    starts = word_starts(ids, tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(ids[0])
    assert starts[0].tolist() == [t.startswith("Ġ") or t == "<eos>" for t in tokens]
    segment_ids = words(torch.ones_like(ids, dtype=torch.bool), starts)
    assert [tokenizer.decode(ids[0, p].tolist()).strip() for p in segments_of_row(segment_ids[0].tolist())] == [
        "the", "cat", "sat", "<eos>"]
