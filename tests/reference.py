"""Slow, obviously correct references for the core math: plain Python loops over rows, segments
and tokens, written straight from the formulas of docs/algorithm.md. The vectorised code is tested
against these."""

from __future__ import annotations

import math

import torch


def random_batch(batch: int, width: int, generator: torch.Generator, lengths=None):
    """A ragged right-padded batch; lengths include 0, 1 and the full width when room allows."""
    if lengths is None:
        lengths = torch.randint(0, width + 1, (batch,), generator=generator).tolist()
        special = [0, 1, width]
        for i, n in enumerate(special[: batch]):
            lengths[i] = n
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return mask, lengths


def segments_of_row(ids_row: list[int]) -> list[list[int]]:
    """Token positions of each segment of one row (ids -1 skipped), in order."""
    segments: dict[int, list[int]] = {}
    for t, s in enumerate(ids_row):
        if s >= 0:
            segments.setdefault(s, []).append(t)
    return [segments[k] for k in sorted(segments)]


def fixed_ngram_ref(lengths: list[int], width: int, n) -> list[list[int]]:
    rows = []
    for length in lengths:
        if n is None:
            row = [0] * length
        else:
            row = [t // n for t in range(length)]
        rows.append(row + [-1] * (width - length))
    return rows


def randomized_from_order_ref(lengths: list[int], width: int, pool: list[int], orders: list[list[int]]):
    rows = []
    for length, order in zip(lengths, orders):
        seg_lengths = [pool[k] for k in order]
        row, seg, used = [], 0, 0
        for _ in range(length):
            if seg < len(seg_lengths) and used == seg_lengths[seg]:
                seg, used = seg + 1, 0
            row.append(seg)
            used += 1
        rows.append(row + [-1] * (width - length))
    return rows


def perplexity_ref(lengths: list[int], width: int, ref_logprobs: list[list[float]]):
    rows = []
    for length, lp in zip(lengths, ref_logprobs):
        row, seg, current = [], 0, []
        for t in range(length):
            nll = -lp[t]
            if current and nll > sum(current) / len(current):
                seg, current = seg + 1, []
            current.append(nll)
            row.append(seg)
        rows.append(row + [-1] * (width - length))
    return rows


def sigma_ref(size: int, weighting: str) -> list[float]:
    if weighting == "equal":
        return [1.0 / size] * size
    if weighting == "unit":
        return [0.0] * (size - 1) + [1.0]
    if weighting == "first":
        return [1.0] + [0.0] * (size - 1)
    harmonic = sum(1.0 / (size - j) for j in range(size))
    return [(1.0 / (size - i)) / harmonic for i in range(size)]


def token_gae_ref(rewards, values, lengths, gamma, lam):
    return token_gae_schedule_ref(rewards, values, lengths, gamma, [[lam] * len(row) for row in rewards])


def macro_gae_ref(rewards, values, segment_ids, gamma, lam, weighting, segment_reward="sum"):
    batch, width = len(rewards), len(rewards[0])
    adv = [[0.0] * width for _ in range(batch)]
    ret = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        segments = segments_of_row(segment_ids[b])
        seg_r, seg_v = [], []
        for positions in segments:
            r = sum(rewards[b][t] for t in positions)
            seg_r.append(r / len(positions) if segment_reward == "mean" else r)
            sigma = sigma_ref(len(positions), weighting)
            seg_v.append(sum(s * values[b][t] for s, t in zip(sigma, positions)))
        last = 0.0
        for k in reversed(range(len(segments))):
            next_value = seg_v[k + 1] if k + 1 < len(segments) else 0.0
            delta = seg_r[k] + gamma * next_value - seg_v[k]
            last = delta + gamma * lam * last
            for t in segments[k]:
                adv[b][t] = last
                ret[b][t] = last + seg_v[k]
    return adv, ret


def policy_loss_ref(logprobs, old_logprobs, advantages, segment_ids, clip, granularity="macro", weighting="tokens",
                    rollout_logprobs=None, tis_cap=None):
    """weighting: "tokens" (segment surrogate x token count / tokens), "uniform" (mean over segments),
    "geometric" (ratio from the mean token log-ratio, x token count / tokens). With tis_cap, each unit's
    surrogate x min(prod over its tokens of exp(old - rollout), tis_cap)."""
    total, tokens, clipped_units, units = 0.0, 0, 0, 0
    for b in range(len(logprobs)):
        for positions in segments_of_row(segment_ids[b]):
            groups = [positions] if granularity == "macro" else [[t] for t in positions]
            for group in groups:
                log_ratio = sum(logprobs[b][t] - old_logprobs[b][t] for t in group)
                if weighting == "geometric":
                    log_ratio /= len(group)
                ratio = math.exp(max(-20.0, min(20.0, log_ratio)))
                a = advantages[b][group[0]]
                surrogate = -a * ratio
                clipped = -a * min(max(ratio, 1 - clip), 1 + clip)
                tis = 1.0
                if tis_cap is not None:
                    tis = min(math.prod(math.exp(old_logprobs[b][t] - rollout_logprobs[b][t]) for t in group), tis_cap)
                total += tis * max(surrogate, clipped) * (1 if weighting == "uniform" else len(group))
                clipped_units += clipped > surrogate
                units += 1
            tokens += len(positions)
    return total / max(units if weighting == "uniform" else tokens, 1), clipped_units / max(units, 1)


def value_loss_ref(values, old_values, returns, segment_ids, clip, weighting):
    total, tokens = 0.0, 0
    for b in range(len(values)):
        for positions in segments_of_row(segment_ids[b]):
            sigma = sigma_ref(len(positions), weighting)
            v = sum(s * values[b][t] for s, t in zip(sigma, positions))
            old = sum(s * old_values[b][t] for s, t in zip(sigma, positions))
            q = returns[b][positions[0]]
            loss = (v - q) ** 2
            if clip is not None:
                v_clipped = old + min(max(v - old, -clip), clip)
                loss = max(loss, (v_clipped - q) ** 2)
            total += 0.5 * loss * len(positions)
            tokens += len(positions)
    return total / max(tokens, 1)


def token_gae_schedule_ref(rewards, values, lengths, gamma, next_lams):
    """Token GAE with a lambda per step: A_t = delta_t + gamma * next_lams[b][t] * A_{t+1}."""
    batch, width = len(rewards), len(rewards[0])
    adv = [[0.0] * width for _ in range(batch)]
    ret = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        last = 0.0
        for t in reversed(range(lengths[b])):
            next_value = values[b][t + 1] if t + 1 < lengths[b] else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last = delta + gamma * next_lams[b][t] * last
            adv[b][t] = last
            ret[b][t] = last + values[b][t]
    return adv, ret
