"""Input checks shared by the core math: a wrong shape or a NaN must stop with a ValueError
naming the argument, never turn into a wrong number further down."""

from __future__ import annotations

import torch


def check_mask(mask: torch.Tensor, name: str = "mask") -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        dtype = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"`{name}` must be a bool tensor, got {dtype}")
    if mask.dim() != 2:
        raise ValueError(f"`{name}` must have shape [B, T], got {tuple(mask.shape)}")
    # Right padding: once a row is False it stays False.
    if mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):
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
    if finite and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(torch.where(mask, x, 0.0)).all()):
        raise ValueError(f"`{name}` holds NaN or inf on response tokens")


def check_finite_vector(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"`{name}` must be a 1-D floating tensor")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"`{name}` holds NaN or inf")


def check_segment_ids(segment_ids: torch.Tensor, mask: torch.Tensor, name: str = "segment_ids") -> None:
    """Segments of a row are numbered 0, 1, 2, ... left to right, cover every masked token, and
    padding holds -1."""
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype != torch.long:
        raise ValueError(f"`{name}` must be a long tensor")
    if segment_ids.shape != mask.shape:
        raise ValueError(f"`{name}` has shape {tuple(segment_ids.shape)} but `mask` has {tuple(mask.shape)}")
    if bool(((segment_ids >= 0) != mask).any()) or (segment_ids.numel() and int(segment_ids.min()) < -1):
        raise ValueError(f"`{name}` must be >= 0 exactly on masked tokens and -1 on padding")
    if mask.shape[1] == 0:
        return
    # Within a row, ids start at 0 and step by 0 or 1 (padding is already known to be -1).
    steps = torch.where(mask[:, 1:], segment_ids[:, 1:] - segment_ids[:, :-1], 0)
    low, high = torch.aminmax(steps) if steps.numel() else (0, 0)
    if bool((segment_ids[:, 0] > 0).any()) or low < 0 or high > 1:
        raise ValueError(f"`{name}` must number each row's segments 0, 1, 2, ... contiguously")
