"""Diagnostics PPO logs every step and evaluation reports: repetition of generated text (the reward hacking
MA-RLHF reports on WebGPT, where the policy learns to repeat phrases the reward model likes) and the L2 norms
of advantages and returns (the paper's Figure 11)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def repeated_ngram_fraction(tokens: Sequence[Hashable], n: int = 3) -> float:
    """Fraction of the n-grams of `tokens` that already occurred earlier in the same sequence:
    1 - (#distinct n-grams) / (#n-grams). 0.0 for a sequence shorter than n (no n-gram); a phrase
    repeated over and over tends to 1."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(tokens[i : i + n]) for i in range(total)})
    return 1.0 - distinct / total


def text_repetition(texts: Sequence[str], n: int = 3) -> list[float]:
    """`repeated_ngram_fraction` of each text over its whitespace-separated words."""
    return [repeated_ngram_fraction(text.split(), n) for text in texts]


def token_repetition(response_ids: torch.Tensor, response_mask: torch.Tensor, n: int = 3) -> torch.Tensor:
    """`repeated_ngram_fraction` of each response's real tokens: `[B, T]` ids and bool mask -> `[B]`
    float32 (rows as rollouts hold them; log `.mean()` as a PPO metric)."""
    if response_ids.shape != response_mask.shape:
        raise ValueError(f"response_ids {tuple(response_ids.shape)} and response_mask {tuple(response_mask.shape)} disagree")
    # One device read; padding is marked -1 (token ids are >= 0).
    rows = [[token for token in row if token >= 0]
            for row in torch.where(response_mask.bool(), response_ids, -1).tolist()]
    return torch.tensor([repeated_ngram_fraction(row, n) for row in rows], dtype=torch.float32)


def row_l2(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the L2 norm of each row's real tokens: `[B, T]` values and bool mask -> 0-dim."""
    return torch.where(mask, x, 0.0).norm(dim=1).mean()
