"""Records to token ids, one way for every stage that reads prompt + response text (SFT, reward modelling,
DPO, evaluation):

    pad_sequences(token-id lists, pad_token_id, padding_side) -> (input_ids [B, T], attention_mask [B, T] long)
    prompt_token_ids(tokenizer, prompt, max_prompt_length)  # the last max_prompt_length tokens, leading <bos> kept
    encode_prompt_response(tokenizer, prompt, response, max_prompt_length, max_length) -> (token ids, prompt length)
    collate_prompt_response(examples, pad_token_id, device) -> {"input_ids", "attention_mask", "response_mask"}
    encode_pairs(tokenizer, records, max_prompt_length, max_length) -> [(chosen, rejected) encodings]
    collate_pairs(pairs, pad_token_id, device)  # chosen rows [0, B), rejected rows [B, 2B)
"""

from __future__ import annotations

from typing import Any

import torch

Pair = tuple[tuple[list[int], int], tuple[list[int], int]]


def pad_sequences(sequences: list[list[int]], pad_token_id: int,
                  padding_side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences padded to the longest with pad_token_id, on the right or the left, and their attention mask."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("pad_sequences needs at least one sequence and no empty sequence")
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        span = slice(0, len(sequence)) if padding_side == "right" else slice(length - len(sequence), length)
        input_ids[row, span] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, span] = 1
    return input_ids, attention_mask


def prompt_token_ids(tokenizer, prompt: str, max_prompt_length: int) -> list[int]:
    """The prompt's token ids, its LAST max_prompt_length of them when it is longer (the instruction
    usually ends it), with the special tokens the tokenizer puts in front (Gemma's and Llama's `<bos>`) kept."""
    ids = tokenizer(prompt)["input_ids"]
    if len(ids) <= max_prompt_length:
        return ids
    prefix = tokenizer("")["input_ids"]  # what the tokenizer adds in front of any text
    if prefix and ids[:len(prefix)] == prefix and len(prefix) < max_prompt_length:
        return prefix + ids[len(prefix):][len(ids) - max_prompt_length:]
    return ids[-max_prompt_length:]


def encode_prompt_response(tokenizer, prompt: str, response: str, max_prompt_length: int,
                           max_length: int) -> tuple[list[int], int]:
    """Token ids of prompt + response + EOS and the prompt's length in tokens.

    The prompt keeps its LAST max_prompt_length tokens and its leading special tokens (prompt_token_ids);
    the response is cut to fit max_length.
    """
    prompt_ids = prompt_token_ids(tokenizer, prompt, max_prompt_length)
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    response_ids = response_ids[:max_length - len(prompt_ids)]
    return prompt_ids + response_ids, len(prompt_ids)


def collate_prompt_response(examples: list[tuple[list[int], int]], pad_token_id: int,
                            device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch of encode_prompt_response outputs; response_mask (bool) marks response tokens."""
    input_ids, attention_mask = pad_sequences([ids for ids, _ in examples], pad_token_id, "right")
    prompt_lengths = torch.tensor([prompt_length for _, prompt_length in examples])
    positions = torch.arange(input_ids.shape[1])
    response_mask = attention_mask.bool() & (positions[None, :] >= prompt_lengths[:, None])
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "response_mask": response_mask.to(device)}


def encode_pairs(tokenizer, records: list[dict[str, Any]], max_prompt_length: int, max_length: int) -> list[Pair]:
    """(chosen, rejected) encode_prompt_response outputs of each preference record."""
    return [(encode_prompt_response(tokenizer, r["prompt"], r["chosen"], max_prompt_length, max_length),
             encode_prompt_response(tokenizer, r["prompt"], r["rejected"], max_prompt_length, max_length))
            for r in records]


def collate_pairs(pairs: list[Pair], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One right-padded batch: the chosen sequences in rows [0, B), the rejected ones in rows [B, 2B)."""
    return collate_prompt_response([c for c, _ in pairs] + [r for _, r in pairs], pad_token_id, device)
