"""Cost of parsing-based segmentation per batch, next to fixed n-gram segmentation.

Builds a batch of English responses (TL;DR-style prose) and one of Python responses (APPS-style code)
from the test fixtures, tokenizes them with a byte-level BPE tokenizer trained here (no download), and
times `marlhf.parsing.parsing` (spaCy dependency parse / `ast` + `tokenize`) against
`marlhf.segments.fixed_ngram`. Prints milliseconds per batch and the ratio.

    .venv/bin/python benchmarks/parsing_cost.py --batch-size 16 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from marlhf.parsing import parsing, spacy_pipeline
from marlhf.segments import fixed_ngram

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def fixture_texts() -> tuple[list[str], list[str]]:
    """English passages (TL;DR posts) and Python programs (APPS solutions) from the shipped fixtures."""
    with (FIXTURES / "tldr_comparisons.jsonl").open() as f:
        posts = [row["info"]["post"] for row in map(json.loads, f) if row["info"]["post"]]
    with (FIXTURES / "apps.jsonl").open() as f:
        programs = [json.loads(row["solutions"])[0] for row in map(json.loads, f) if row["solutions"]]
    return posts, programs


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def make_batch(tokenizer, pieces: list[str], joiner: str, batch_size: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of about `tokens` tokens (pieces joined in a rotating order), right-padded, EOS last."""
    rows = []
    for b in range(batch_size):
        text, k = "", b
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
            text += pieces[k % len(pieces)] + joiner
            k += 1
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: tokens - 1 - (b % 4) * tokens // 8]
        rows.append(ids + [tokenizer.eos_token_id])
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return ids, mask


def time_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256, help="response length of the longest rows")
    parser.add_argument("--cutoff", type=int, default=5)
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    posts, programs = fixture_texts()
    tokenizer = train_tokenizer(posts + programs)
    spacy_pipeline()  # load once, outside the timings
    print(f"batch {args.batch_size} x up to {args.tokens} tokens, parsing cutoff {args.cutoff}, fixed n-gram n={args.ngram}")
    for language, pieces, joiner in (("text", posts, " "), ("python", programs, "\n")):
        ids, mask = make_batch(tokenizer, pieces, joiner, args.batch_size, args.tokens)
        fixed = time_ms(lambda: fixed_ngram(mask, args.ngram), args.repeats)
        parsed = time_ms(lambda: parsing(ids, mask, tokenizer, cutoff=args.cutoff, language=language), args.repeats)
        segment_ids, fallbacks = parsing(ids, mask, tokenizer, cutoff=args.cutoff, language=language)
        mean_length = mask.sum().item() / (segment_ids.max(dim=1).values + 1).sum().item()
        print(
            f"{language:>6}: fixed_ngram {fixed:8.3f} ms/batch | parsing {parsed:9.1f} ms/batch "
            f"({parsed / args.batch_size:6.1f} ms/row) | ratio {parsed / fixed:9.0f}x | "
            f"mean segment {mean_length:.2f} tokens | fallbacks {fallbacks}"
        )


if __name__ == "__main__":
    main()
