"""Macro-action termination rules, segment reductions and segment values (docs/algorithm.md).

Every function works on response tokens only, shaped ``[B, T]`` and right-padded; ``mask`` is a
bool ``[B, T]`` tensor, True on real response tokens. A termination rule returns ``segment_ids``,
a long ``[B, T]`` tensor numbering the segments of each row 0, 1, 2, ... left to right, covering
every masked token, with -1 on padding. The tensor functions here do not loop over batch rows; only
``perplexity`` and ``low_prob_cutpoints`` with ``min_tokens`` loop over time (their rules are sequential),
vectorised across the batch. ``parsing`` is the
exception: it parses each decoded response in Python (it lives in :mod:`marlhf.parsing` with its parsers and is
named here beside the other rules).

The segment reductions (``segment_sum``, ``segment_mean``, ``segment_values`` under a value weighting,
``masked_mean``) serve both the advantages and the losses.

Multi-turn rows (docs/algorithm.md#multi-turn): the core functions take the *action* mask, which has gaps (False on
the observation tokens between a row's turns), and ``segment_ids`` -1 there; a segment never spans a gap (but for
``keep_boundaries``' merged segments, whose first token ``segment_first_token`` marks once). The reductions, ``segment_first_token``/``segment_last_token`` and ``value_weights`` need nothing more: a segment is a
run of consecutive positions either way. ``split_by_turns`` cuts any rule's segments at the turns (``turn_ids``);
``pack_actions``/``unpack_actions`` move a row's action tokens to its left, where a computation over "the next
token" becomes one over the next action token.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from marlhf._checks import check_like, check_mask
from marlhf.parsing import parsing  # the parse-tree rule lives with its parsers; spaCy loads lazily

__all__ = [
    "fixed_ngram",
    "randomized_ngram",
    "perplexity",
    "low_prob_tokens",
    "low_prob_cutpoints",
    "parsing",
    "words",
    "word_starts",
    "split_last_token",
    "keep_boundaries",
    "segment_sum",
    "segment_mean",
    "segment_lengths",
    "masked_mean",
    "value_weights",
    "segment_values",
    "num_segments",
    "broadcast_segments",
    "segment_first_token",
    "segment_last_token",
    "has_gaps",
    "last_positions",
    "pack_actions",
    "unpack_actions",
    "split_by_turns",
]


def fixed_ngram(mask: torch.Tensor, n: int | float | str | None) -> torch.Tensor:
    """Segments of exactly ``n`` tokens, the last one of a row truncated.

    ``n=None``, ``"inf"`` or ``float("inf")`` gives one segment per row; ``n=1`` one token per
    segment (token-level PPO).

    Args:
        mask: bool [B, T].
        n: segment length (int >= 1) or one of the "whole response" spellings.
    Returns:
        segment_ids: long [B, T], -1 on padding.
    """
    check_mask(mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    if n is None or n == "inf" or n == float("inf"):
        ids = torch.zeros_like(positions)
    elif isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"`n` must be an int >= 1 or None/'inf' for one segment per response, got {n!r}")
    elif n < 1:
        raise ValueError(f"`n` must be >= 1, got {n}")
    else:
        ids = positions // n
    return ids.masked_fill(~mask, -1)


def randomized_ngram(
    mask: torch.Tensor,
    lengths: Sequence[int] = (2, 3, 5, 10),
    repeat_times: int = 3,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Segment lengths drawn from ``lengths * repeat_times``, shuffled independently per row.

    Consecutive segments take their lengths from the shuffled list in order; once the list is
    used up, the remaining tokens form one last segment.

    Args:
        mask: bool [B, T].
        lengths: candidate segment lengths, each >= 1.
        repeat_times: how many times the list is repeated before shuffling (>= 1).
        generator: optional torch.Generator for reproducible shuffles.
    Returns:
        segment_ids: long [B, T], -1 on padding.
    """
    check_mask(mask)
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"`lengths` must be a non-empty sequence of ints >= 1, got {lengths!r}")
    if isinstance(repeat_times, bool) or not isinstance(repeat_times, int) or repeat_times < 1:
        raise ValueError(f"`repeat_times` must be an int >= 1, got {repeat_times!r}")
    batch, width = mask.shape
    pool = torch.tensor(lengths * repeat_times)
    rand_device = generator.device if generator is not None else torch.device("cpu")
    order = torch.rand(batch, len(pool), generator=generator, device=rand_device).argsort(dim=1)
    ends = pool[order.cpu()].cumsum(dim=1).to(mask.device)  # [B, K] exclusive end of each segment
    positions = torch.arange(width, device=mask.device).expand(batch, width).contiguous()
    # Segment of token t = number of segment ends at or before t; past the last end it is K,
    # the remainder segment.
    ids = torch.searchsorted(ends, positions, right=True)
    return ids.masked_fill(~mask, -1)


def perplexity(mask: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Greedy perplexity-based termination under the frozen reference model.

    Left to right, a segment keeps growing while adding the next token does not raise the
    segment's mean negative log-prob; when it would (the token's NLL is above the current mean),
    a new segment starts at that token.

    Args:
        mask: bool [B, T].
        ref_logprobs: float [B, T], reference log-probs of the sampled tokens.
    Returns:
        segment_ids: long [B, T], -1 on padding.
    """
    check_mask(mask)
    check_like(ref_logprobs, mask, "ref_logprobs")
    # The rule is sequential in time, so this loops over T, vectorised across the batch, in
    # NumPy on the host: a few microseconds a step instead of a kernel launch per tiny op.
    nll = -ref_logprobs.detach().to(torch.float64).cpu().numpy()
    batch, width = nll.shape
    ids = np.zeros((batch, width), dtype=np.int64)
    if width:
        seg_sum, seg_len = nll[:, 0].copy(), np.ones(batch)
        current = np.zeros(batch, dtype=np.int64)
        for t in range(1, width):
            starts = nll[:, t] * seg_len > seg_sum  # NLL above the running mean, without dividing
            current += starts
            ids[:, t] = current
            seg_sum = np.where(starts, nll[:, t], seg_sum + nll[:, t])
            seg_len = np.where(starts, 1.0, seg_len + 1.0)
    return torch.from_numpy(ids).to(mask.device).masked_fill(~mask, -1)


def low_prob_tokens(mask: torch.Tensor, logprobs: torch.Tensor, threshold: float = 0.9) -> torch.Tensor:
    """Bool [B, T]: True on response tokens whose probability under the sampling policy is below ``threshold``.

    SPO's test (arXiv 2505.23564; code AIFrameResearch/SPO): ``exp(logprob) < threshold``, strict, the
    probability taken in float64 as its NumPy code does. NaN or inf log-probs on response tokens raise a
    ValueError (padding may hold anything).

    Args:
        mask: bool [B, T].
        logprobs: float [B, T], log-probs of the sampled tokens under the policy that sampled them.
        threshold: in [0, 1]; 0 marks no token, 1 every token sampled with probability below 1.
    Returns:
        bool [B, T], False on padding.
    """
    check_mask(mask, gaps=True)
    check_like(logprobs, mask, "logprobs")
    if not 0.0 <= threshold <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"`threshold` must be in [0, 1], got {threshold}")
    return mask & (logprobs.detach().to(torch.float64).exp() < threshold)


def low_prob_cutpoints(
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    threshold: float = 0.9,
    interval: int = 1,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """SPO's cutpoints: a new segment starts at a sampled token whose probability is below ``threshold``.

    The low-probability tokens of a row (:func:`low_prob_tokens`) are numbered 0, 1, 2, ... left to right and
    every ``interval``-th is kept (0, interval, 2 interval, ...), as SPO's ``cutpoints[::cutpoint_interval]``
    does; a kept one at position 0 changes nothing, since the first token always starts segment 0. Then, left to
    right, a kept cutpoint less than ``min_tokens`` tokens after the current segment's start is dropped, and a
    segment that reaches ``max_tokens`` tokens ends there (a forced cut, not counted by ``interval``). A row's
    last segment may be shorter than ``min_tokens``.

    Vectorised; with ``min_tokens`` the rule is sequential (whether a cut is kept depends on the last kept one),
    so it loops over T, vectorised across the batch, as :func:`perplexity` does.

    Args:
        mask: bool [B, T].
        logprobs: float [B, T], log-probs of the sampled tokens under the sampling policy (finite on tokens).
        threshold: probability below which a token starts a segment (SPO: 0.9).
        interval: keep every ``interval``-th cutpoint (int >= 1).
        min_tokens, max_tokens: optional segment lengths (ints >= 1, min_tokens <= max_tokens).
    Returns:
        segment_ids: long [B, T], -1 on padding.
    """
    low = low_prob_tokens(mask, logprobs, threshold)
    for name, value in (("interval", interval), ("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"`min_tokens` ({min_tokens}) must be <= `max_tokens` ({max_tokens})")
    rank = low.long().cumsum(dim=1) - 1  # index of each low-probability token among its row's
    cuts = low & (rank % interval == 0)
    if min_tokens is None:
        starts = cuts
        if max_tokens is not None:  # split every segment into pieces of max_tokens
            positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
            seg_start = torch.where(cuts, positions, 0).cummax(dim=1).values  # the last cut at or before t
            starts = starts | ((positions - seg_start) % max_tokens == 0)
    else:
        starts = _greedy_starts(cuts, min_tokens, max_tokens)
    if starts.shape[1]:
        starts[:, 0] = True
    ids = (starts & mask).long().cumsum(dim=1) - 1
    return ids.masked_fill(~mask, -1)


def _greedy_starts(cuts: torch.Tensor, min_tokens: int, max_tokens: int | None) -> torch.Tensor:
    """Left to right: start a segment at a cut once the current one has ``min_tokens`` tokens, or at any token
    once it has ``max_tokens``. Loops over T in NumPy on the host, vectorised across the batch."""
    cut = cuts.cpu().numpy()
    batch, width = cut.shape
    starts = np.zeros((batch, width), dtype=bool)
    length = np.zeros(batch, dtype=np.int64)  # tokens in the current segment before t
    limit = width + 1 if max_tokens is None else max_tokens
    for t in range(width):
        starts[:, t] = (cut[:, t] & (length >= min_tokens)) | (length >= limit) | (t == 0)
        length = np.where(starts[:, t], 1, length + 1)
    return torch.from_numpy(starts).to(cuts.device)


def words(mask: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """One segment per word: a new segment begins at every token that starts a word.

    The first token of a row always begins a segment, whatever ``starts`` says there.

    Args:
        mask: bool [B, T].
        starts: bool [B, T], True on tokens that begin a word (see :func:`word_starts`).
    Returns:
        segment_ids: long [B, T], -1 on padding.
    """
    check_mask(mask)
    if not isinstance(starts, torch.Tensor) or starts.dtype != torch.bool or starts.shape != mask.shape:
        raise ValueError(f"`starts` must be a bool tensor shaped like `mask` {tuple(mask.shape)}")
    starts = starts.clone()
    if starts.shape[1]:
        starts[:, 0] = True
    ids = (starts & mask).long().cumsum(dim=1) - 1
    return ids.masked_fill(~mask, -1)


_WORD_START_TABLES: dict[int, tuple[object, torch.Tensor]] = {}


def word_starts(response_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Bool [B, T]: True on tokens that begin a word, read off the tokenizer's vocabulary.

    With a continuing-subword prefix (WordPiece's or BPE's ``##``, as the demo's tokenizer has), every
    token without it begins a word; otherwise (byte-level BPE, SentencePiece) the tokens whose text
    begins with a space marker (``Ġ``, ``▁``) or whitespace do, and special tokens do. A token table
    per tokenizer is built once.
    """
    cached = _WORD_START_TABLES.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        vocab = tokenizer.get_vocab()
        table = torch.zeros(max(max(vocab.values()) + 1, len(tokenizer)), dtype=torch.bool)
        prefix = _continuing_subword_prefix(tokenizer)
        special = set(tokenizer.all_special_tokens)
        for token, index in vocab.items():
            if prefix:
                table[index] = not token.startswith(prefix)
            else:
                table[index] = token in special or token[:1] in ("Ġ", "▁", "Ċ") or token[:1].isspace()
        cached = _WORD_START_TABLES[id(tokenizer)] = (tokenizer, table)
    table = cached[1].to(response_ids.device)
    return table[response_ids.clamp(0, table.shape[0] - 1)]


def _continuing_subword_prefix(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    return getattr(model, "continuing_subword_prefix", None) or None


def split_last_token(segment_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give the last real token of each row a segment of its own (the released code's layout,
    where that token carries the reward-model score). Rows whose last segment already has one
    token are unchanged. With gaps in ``mask`` (multi-turn), the last action token of the row.

    Args:
        segment_ids: long [B, T]; mask: bool [B, T].
    Returns:
        segment_ids: long [B, T].
    """
    check_mask(mask, gaps=True)
    last = last_positions(mask)
    prev = (last - 1).clamp(min=0)
    last_id = segment_ids.gather(1, last[:, None])
    shares = (last >= 1)[:, None] & (segment_ids.gather(1, prev[:, None]) == last_id)
    return segment_ids.scatter(1, last[:, None], last_id + shares.long())


def keep_boundaries(segment_ids: torch.Tensor, max_boundaries: int) -> torch.Tensor:
    """At most `max_boundaries` segments per row: a row of m > M = max_boundaries segments keeps the boundaries
    (segment starts) of segments floor(i m / M), i = 0..M-1, evenly spaced in segment index with the first
    always kept, and each kept boundary's segment absorbs the segments up to the next kept one. Segment s goes to
    ceil((s + 1) M / m) - 1, the last kept boundary at or before it. Rows of at most M segments are unchanged.

    Args:
        segment_ids: long [B, T], -1 on padding; max_boundaries: M >= 1.
    Returns:
        long [B, T], the merged segments numbered 0, 1, ... per row, -1 on padding.
    """
    if max_boundaries < 1:
        raise ValueError(f"`max_boundaries` must be >= 1, got {max_boundaries}")
    counts = num_segments(segment_ids)[:, None]  # m per row, [B, 1]
    merged = ((segment_ids + 1) * max_boundaries + counts - 1) // counts.clamp(min=1) - 1
    return torch.where((counts > max_boundaries) & (segment_ids >= 0), merged, segment_ids)


def _num_slots(segment_ids: torch.Tensor) -> int:
    return int(segment_ids.max().item()) + 1 if segment_ids.numel() else 0


def segment_sum(x: torch.Tensor, segment_ids: torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the tokens of each segment.

    Args:
        x: [B, T] values (gradients flow through).
        segment_ids: long [B, T], -1 on padding (padding is ignored, whatever ``x`` holds there).
        num_slots: S, the number of segment slots per row; default max segment id + 1.
    Returns:
        [B, S]; slots past a row's last segment hold 0.
    """
    slots = _num_slots(segment_ids) if num_slots is None else num_slots
    # Shift ids by one so that padding (-1) lands in slot 0, which is dropped.
    out = x.new_zeros(x.shape[0], slots + 1)
    return out.scatter_add(1, segment_ids + 1, x)[:, 1:]


def segment_mean(x: torch.Tensor, segment_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over the tokens of each segment: [B, T] -> [B, S] (0 for missing segments).

    ``lengths`` (from :func:`segment_lengths`) may be passed to save a pass over the batch.
    """
    if lengths is None:
        lengths = segment_lengths(segment_ids)
    return segment_sum(x, segment_ids, lengths.shape[1]) / lengths.clamp(min=1)


def segment_lengths(segment_ids: torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
    """Token count of each segment: long [B, S] (0 for slots past a row's last segment)."""
    ones = torch.ones_like(segment_ids)
    return segment_sum(ones, segment_ids, num_slots)


def num_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Number of segments per row: long [B] (0 for an empty row)."""
    if segment_ids.shape[1] == 0:
        return segment_ids.new_zeros(segment_ids.shape[0])
    return segment_ids.max(dim=1).values + 1


def broadcast_segments(x_seg: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Copy each segment's value to its tokens: [B, S] -> [B, T], 0 on padding."""
    if x_seg.shape[1] == 0:
        return x_seg.new_zeros(segment_ids.shape)
    gathered = x_seg.gather(1, segment_ids.clamp(min=0))
    return torch.where(segment_ids >= 0, gathered, torch.zeros_like(gathered))


def segment_first_token(segment_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, T], True on the first token of every segment. Segment ids increase along a row; a segment that
    resumes after -1 positions (observation tokens inside a kept multi-turn segment) starts once, where it first
    appears."""
    seen = torch.cat([segment_ids.new_full((segment_ids.shape[0], 1), -1), segment_ids[:, :-1].cummax(1).values], 1)
    return segment_ids > seen


def segment_last_token(segment_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, T], True on the last token of every segment."""
    following = torch.cat([segment_ids[:, 1:], segment_ids.new_full((segment_ids.shape[0], 1), -1)], dim=1)
    return (segment_ids >= 0) & (following != segment_ids)


# ---- segment values (the value weighting) and masked means: used by the advantages and the losses
ValueWeighting = Literal["equal", "unit", "position", "first"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over True positions of ``mask`` (0 where nothing is masked)."""
    x = torch.where(mask, x, torch.zeros_like(x))
    if dim is None:
        return x.sum() / mask.sum().clamp(min=1)
    return x.sum(dim) / mask.sum(dim).clamp(min=1)


def value_weights(
    segment_ids: torch.Tensor,
    mask: torch.Tensor,
    value_weighting: ValueWeighting = "equal",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The value weighting's token weights sigma, which turn token values into a segment value (they sum to 1
    per segment; `value_weighting`, not the policy loss's `segment_weighting`). The default is the paper's
    "equal"; PPO passes its own value_weighting explicitly (default "first": marlhf.advantages, Defaults).

    - ``"equal"``: 1/|tau| on each token;
    - ``"unit"``: 1 on the segment's last token;
    - ``"position"``: (1/(|tau| - i)) / H, i = 0 for the first token, H the normaliser
      (later tokens weigh more; the last one most);
    - ``"first"`` (not in the paper): 1 on the segment's first token, i.e. the value of the state
      where the macro action starts. V_t is the value before token t, so the paper's three mix in
      states that already hold part of the action being judged; this one does not.

    Returns:
        float [B, T], 0 on padding.
    """
    is_last = segment_last_token(segment_ids)
    slots = segment_ids.shape[1]  # a row has at most T segments: enough slots without reading the ids
    if value_weighting == "equal":
        raw = mask.to(dtype)
    elif value_weighting == "unit":
        raw = is_last.to(dtype)
    elif value_weighting == "first":
        raw = segment_first_token(segment_ids).to(dtype)
    elif value_weighting == "position":
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(segment_ids)
        last_pos = broadcast_segments(segment_sum(torch.where(is_last, positions, 0), segment_ids, slots), segment_ids)
        remaining = (last_pos - positions + 1).clamp(min=1)  # |tau| - i
        raw = torch.where(mask, 1.0 / remaining.to(dtype), 0.0)
    else:
        raise ValueError(f"`value_weighting` must be one of {list(typing.get_args(ValueWeighting))}, "
                         f"got {value_weighting!r}")
    norm = broadcast_segments(segment_sum(raw, segment_ids, slots), segment_ids)
    return torch.where(mask, raw / norm.clamp(min=1e-12), 0.0)


def segment_values(
    values: torch.Tensor,
    segment_ids: torch.Tensor,
    value_weighting: ValueWeighting = "equal",
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Segment values ``V_tau = sum_i sigma_i V_{t_tau+i}``: [B, T] -> [B, S] (``value_weighting``: the paper's
    "equal" by default; PPO passes its own explicitly).

    ``lengths`` (from :func:`segment_lengths`) may be passed to save a pass over the batch.
    """
    if value_weighting == "equal":  # the common case, without building per-token weights
        return segment_mean(values, segment_ids, lengths)
    weights = value_weights(segment_ids, segment_ids >= 0, value_weighting, values.dtype)
    return segment_sum(values * weights, segment_ids, None if lengths is None else lengths.shape[1])


# ---- multi-turn rows: gaps in the action mask (docs/algorithm.md#multi-turn)
def has_gaps(mask: torch.Tensor) -> bool:
    """Whether some row of ``mask`` has a False between two True tokens (observation tokens of a multi-turn row);
    reads the device."""
    seen = mask.long().cummax(dim=1).values.bool()  # True from a row's first True on
    return bool((seen & ~mask & mask.flip(1).long().cummax(dim=1).values.flip(1).bool()).any())


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """Long [B]: the position of each row's last True token (0 for a row without one). For a right-padded mask
    it is the row's length - 1."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, 0).amax(dim=1) if mask.shape[1] else mask.new_zeros(mask.shape[0]).long()


def pack_actions(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's masked tokens to its left, in order: ``x`` [B, T] -> (packed [B, T], packed_mask [B, T]),
    right-padded with 0; :func:`unpack_actions` puts them back."""
    width = mask.shape[1]
    rank = mask.long().cumsum(dim=1) - 1
    index = torch.where(mask, rank, width)  # non-masked tokens go to a spare column, dropped
    packed = x.new_zeros(x.shape[0], width + 1).scatter(1, index, torch.where(mask, x, 0))[:, :width]
    packed_mask = torch.arange(width, device=mask.device)[None, :] < mask.sum(dim=1, keepdim=True)
    return packed, packed_mask


def unpack_actions(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_actions`: packed [B, T] -> [B, T] on the masked tokens of ``mask``, 0 elsewhere."""
    rank = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return torch.where(mask, packed.gather(1, rank), 0)


def split_by_turns(segment_ids: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Intersect a rule's segments with the policy's turns: a segment starts wherever the rule starts one or a turn
    starts, and only the action tokens (``turn_ids`` >= 0) keep an id, renumbered 0, 1, ... per row.

    Args:
        segment_ids: long [B, T], a rule's segments over the row (any ids; a segment may span observations).
        turn_ids: long [B, T], the turn of each action token, -1 on observations and padding.
    Returns:
        segment_ids: long [B, T], -1 off the action tokens; no segment spans two turns or an observation.
    """
    if not isinstance(turn_ids, torch.Tensor) or turn_ids.dtype != torch.long or turn_ids.shape != segment_ids.shape:
        raise ValueError(f"`turn_ids` must be a long tensor shaped like the responses {tuple(segment_ids.shape)}")
    action = turn_ids >= 0
    edge = segment_ids.new_full((segment_ids.shape[0], 1), -1)
    prev_turn = torch.cat([edge, turn_ids[:, :-1]], dim=1)
    prev_segment = torch.cat([edge, segment_ids[:, :-1]], dim=1)
    starts = action & ((prev_turn != turn_ids) | (prev_segment != segment_ids))
    return torch.where(action, starts.long().cumsum(dim=1) - 1, -1)
