"""A BPE tokenizer trained offline on the demo task's text, wrapped for transformers.

The vocabulary is kept small on purpose so that words split into 2-3 tokens: the demo is about credit
assignment over multi-token units. Words are split on whitespace and punctuation before BPE, and word-inner
pieces carry a "##" prefix, so decoding restores the spaces and tokenizing a prompt and a response separately
gives the same tokens as tokenizing their concatenation.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
CONTINUATION_PREFIX = "##"


def train_tokenizer(texts: list[str], vocab_size: int = 60) -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer on `texts` and wrap it as a `PreTrainedTokenizerFast` (left padding for generation)."""
    if not texts:
        raise ValueError("texts is empty")
    tokenizer = Tokenizer(models.BPE(unk_token=UNK, continuing_subword_prefix=CONTINUATION_PREFIX))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX, cleanup=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, UNK],
        continuing_subword_prefix=CONTINUATION_PREFIX,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=_with_canonical_ids(tokenizer),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )


def _with_canonical_ids(tokenizer: Tokenizer) -> Tokenizer:
    """The trainer numbers the single characters in hash order, which changes from process to process
    (the merges do not): renumber them in sorted order so the same texts always give the same token ids."""
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merged = {a + b.removeprefix(CONTINUATION_PREFIX)
              for a, b in (m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"])}
    specials = sorted((t for t in vocab if t in (PAD, BOS, EOS, UNK)), key=vocab.get)
    alphabet = sorted(t for t in vocab if t not in merged and t not in specials)
    merges_in_order = sorted((t for t in merged if t in vocab), key=vocab.get)
    data["model"]["vocab"] = {t: i for i, t in enumerate(specials + alphabet + merges_in_order)}
    return Tokenizer.from_str(json.dumps(data))
