"""The demo's BPE tokenizer: the same texts give the same tokenizer in every process, and it learns what
`tokenizers`' own BpeTrainer learns wherever that trainer's choice is not a tie."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from marlhf.demo.task import SyntheticTask
from marlhf.demo.tokenizer import CONTINUATION_PREFIX, bpe_merges, train_tokenizer

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def test_merges_by_hand():
    vocab, merges = bpe_merges(Counter({"abab": 3, "ab": 2}), 10, SPECIALS)
    # (a, ##b) occurs 5 times; then (ab, ##a) and (##a, ##b) 3 times each: the tie goes to the first in order
    assert merges == [("a", "##b"), ("##a", "##b")]
    assert list(vocab) == [*SPECIALS, "##a", "##b", "a", "b", "ab", "##ab"]  # every character also on its own
    assert bpe_merges(Counter({"a": 4}), 100, SPECIALS)[1] == []  # nothing left to merge: it stops early


def test_same_texts_same_tokenizer_in_any_process():
    """`tokenizers`' trainer breaks ties by ids it hands out in hash order (the demo's models once differed from
    build to build); this one does not."""
    code = ("from marlhf.demo.task import SyntheticTask; from marlhf.demo.tokenizer import train_tokenizer; "
            "print(train_tokenizer(SyntheticTask().pretraining_texts(2000, seed=0)).backend_tokenizer.to_str())")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
    assert json.loads(outputs.pop())["model"]["merges"]


def test_agrees_with_the_tokenizers_trainer_where_it_does_not_tie():
    """At 59 entries no tie is cut by the vocabulary size on the demo's texts (at 60 two pairs tie for the last
    merge, which `tokenizers` picks by hash order): the same vocabulary and the same tokens."""
    texts = SyntheticTask().pretraining_texts(2000, seed=0)
    ours = train_tokenizer(texts, vocab_size=59)
    theirs = Tokenizer(models.BPE(unk_token="<unk>", continuing_subword_prefix=CONTINUATION_PREFIX))
    theirs.pre_tokenizer = pre_tokenizers.Whitespace()
    theirs.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=59, special_tokens=SPECIALS, continuing_subword_prefix=CONTINUATION_PREFIX, show_progress=False))
    assert set(ours.get_vocab()) == set(theirs.get_vocab())
    assert all(ours.tokenize(text) == theirs.encode(text).tokens for text in texts[:300])
    assert ours.decode(ours(texts[0])["input_ids"]) == texts[0]
