"""A BPE tokenizer trained offline on the demo task's text, wrapped for transformers.

The vocabulary is kept small on purpose so that words split into 2-3 tokens: the demo is about credit
assignment over multi-token units. Words are split on whitespace and punctuation before BPE, and word-inner
pieces carry a "##" prefix, so decoding restores the spaces and tokenizing a prompt and a response separately
gives the same tokens as tokenizing their concatenation.
"""

from __future__ import annotations

from collections import Counter

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
CONTINUATION_PREFIX = "##"


def train_tokenizer(texts: list[str], vocab_size: int = 60) -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer on `texts` and wrap it as a `PreTrainedTokenizerFast` (left padding for generation).
    The same texts always give the same tokenizer (`bpe_merges`)."""
    if not texts:
        raise ValueError("texts is empty")
    pre_tokenizer = pre_tokenizers.Whitespace()
    word_counts = Counter(word for text in texts for word, _ in pre_tokenizer.pre_tokenize_str(text))
    vocab, merges = bpe_merges(word_counts, vocab_size, [PAD, BOS, EOS, UNK])
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK,
                                     continuing_subword_prefix=CONTINUATION_PREFIX))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX, cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )


def bpe_merges(word_counts: Counter[str], vocab_size: int,
               special_tokens: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-pair merges learnt from word counts, the algorithm of `tokenizers`' BpeTrainer with a
    continuing-subword prefix: a word starts as its first character and "##"-prefixed others; each round
    merges the most frequent adjacent pair until the vocabulary (specials, characters, merged tokens) has
    `vocab_size` entries. Ties go to the alphabetically first pair: `tokenizers` breaks them by character ids
    it assigns in hash order, so two processes could learn different tokenizers from the same texts.
    Returns (token -> id: specials, then the characters sorted, then merged tokens in merge order; merges)."""
    words = [([word[0], *(CONTINUATION_PREFIX + c for c in word[1:])], count)
             for word, count in sorted(word_counts.items())]
    # Every character on its own (as `tokenizers` keeps them, wherever they occur) and in its word-inner form.
    characters = {c for word in word_counts for c in word}
    alphabet = sorted((characters | {symbol for symbols, _ in words for symbol in symbols}) - set(special_tokens))
    tokens = [*special_tokens, *alphabet]
    known = set(tokens)
    merges: list[tuple[str, str]] = []
    while len(tokens) < vocab_size:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in words:
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break
        pair = min(pair_counts, key=lambda p: (-pair_counts[p], p))
        merged = pair[0] + pair[1].removeprefix(CONTINUATION_PREFIX)
        merges.append(pair)
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        for symbols, _ in words:  # left to right, as BPE applies a merge
            i = 0
            while i < len(symbols) - 1:
                if (symbols[i], symbols[i + 1]) == pair:
                    symbols[i : i + 2] = [merged]
                i += 1
    return {token: i for i, token in enumerate(tokens)}, merges
