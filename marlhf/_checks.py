"""Input checks shared by the core math: a wrong shape or a NaN must stop with a ValueError
naming the argument, never turn into a wrong number further down.

Checks of a tensor's values (right padding, finiteness, segment numbering) read it to the host, which on
an accelerator waits for all queued work. A caller that checked its tensors once at its boundary runs the
core functions inside `trusted_inputs()`, where only the free checks (type, dtype, shape) run: PPO checks
a step's rollout, segments and advantages once, then updates on slices of them without a device read.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_TRUSTED = contextvars.ContextVar("marlhf_trusted_inputs", default=False)


@contextlib.contextmanager
def trusted_inputs() -> Iterator[None]:
    """Skip the value checks (the ones that read tensors to the host) inside this block."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def _check_values() -> bool:
    return not _TRUSTED.get()


def check_mask(mask: torch.Tensor, name: str = "mask", gaps: bool = False) -> None:
    """`mask` is a bool [B, T] tensor, right-padded; with `gaps`, a multi-turn action mask: False may also sit
    between True tokens of a row (observation tokens, docs/algorithm.md#multi-turn)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        dtype = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"`{name}` must be a bool tensor, got {dtype}")
    if mask.dim() != 2:
        raise ValueError(f"`{name}` must have shape [B, T], got {tuple(mask.shape)}")
    # Right padding: once a row is False it stays False.
    if not gaps and _check_values() and mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(f"`{name}` must be right-padded (True on response tokens, then False)")


def check_like(x: torch.Tensor, mask: torch.Tensor, name: str, finite: bool = True) -> None:
    """`x` must be a floating tensor shaped like `mask` and finite on the masked positions."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`{name}` must be a tensor, got {type(x).__name__}")
    if x.shape != mask.shape:
        raise ValueError(f"`{name}` has shape {tuple(x.shape)} but `mask` has {tuple(mask.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got {x.dtype}")
    # One reduction catches any NaN/inf (a sum that overflows only sends us to the exact test);
    # padding may hold anything, so the exact test looks at response tokens only.
    if finite and _check_values() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(torch.where(mask, x, 0.0)).all()):
        raise ValueError(f"`{name}` holds NaN or inf on response tokens")


def check_finite_vector(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"`{name}` must be a 1-D floating tensor")
    if _check_values() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"`{name}` holds NaN or inf")


def check_segment_ids(segment_ids: torch.Tensor, mask: torch.Tensor, name: str = "segment_ids",
                      num_slots: int | None = None) -> None:
    """Segments of a row are numbered 0, 1, 2, ... left to right, cover every masked token, and
    padding holds -1; `num_slots`, when given, is the largest number of segments of a row. With gaps in `mask`
    (observation tokens of a multi-turn row, -1 there too), a segment never spans a gap: the first masked token
    after a gap starts a new segment."""
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype != torch.long:
        raise ValueError(f"`{name}` must be a long tensor")
    if segment_ids.shape != mask.shape:
        raise ValueError(f"`{name}` has shape {tuple(segment_ids.shape)} but `mask` has {tuple(mask.shape)}")
    if not _check_values():
        return
    if bool(((segment_ids >= 0) != mask).any()) or (segment_ids.numel() and int(segment_ids.min()) < -1):
        raise ValueError(f"`{name}` must be >= 0 exactly on masked tokens and -1 on padding")
    if num_slots is not None:
        most = int(segment_ids.max()) + 1 if segment_ids.numel() else 0
        if num_slots != most:
            raise ValueError(f"`num_slots` is {num_slots} but the longest row of `{name}` has {most} segments")
    if mask.shape[1] == 0:
        return
    # Each masked token's id minus the last id before it (-1 before the first): 0 or 1 after a masked token,
    # exactly 1 after a gap or at the row's start (padding and gaps are already known to be -1).
    before = torch.cat([segment_ids.new_full((mask.shape[0], 1), -1), segment_ids[:, :-1].cummax(dim=1).values], 1)
    steps = segment_ids - before
    after_token = torch.cat([mask.new_zeros(mask.shape[0], 1), mask[:, :-1]], dim=1)
    if bool((mask & ((steps < 0) | (steps > 1))).any()):
        raise ValueError(f"`{name}` must number each row's segments 0, 1, 2, ... contiguously")
    if bool((mask & ~after_token & (steps != 1)).any()):
        raise ValueError(f"`{name}` must start a new segment after every gap in `mask` (a segment never spans an "
                         "observation)")


def check_turn_ids(turn_ids: torch.Tensor, mask: torch.Tensor, num_turns: int | None = None) -> None:
    """`turn_ids` (long [B, T]) numbers the policy turn of each action token (True in `mask`), -1 elsewhere; a row's
    turns are nondecreasing left to right; with `num_turns` K, every id is < K (a [B, K] per-turn tensor covers
    them)."""
    if not isinstance(turn_ids, torch.Tensor) or turn_ids.dtype != torch.long or turn_ids.shape != mask.shape:
        raise ValueError(f"`turn_ids` must be a long tensor shaped like `mask` {tuple(mask.shape)}")
    if not _check_values() or not turn_ids.numel():
        return
    if bool(((turn_ids >= 0) != mask).any()) or int(turn_ids.min()) < -1:
        raise ValueError("`turn_ids` must be >= 0 exactly on the action tokens (`mask`) and -1 elsewhere")
    if num_turns is not None and int(turn_ids.max()) >= num_turns:
        raise ValueError(f"`turn_ids` has turn {int(turn_ids.max())} but the per-turn tensor has {num_turns} turns")
    if bool((mask & (turn_ids < turn_ids.cummax(dim=1).values)).any()):
        raise ValueError("`turn_ids` must be nondecreasing along each row (turns in order)")
