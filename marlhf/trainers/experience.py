"""One PPO step's batch: the `Experience` each stage of `marlhf.trainers.ppo` fills in turn.

Vocabulary (docs/algorithm.md): a *row* is one sampled response with its prompt; a step's rows on one process
are its rollout; a *mini-batch* is the rows of one optimizer update; a *piece* is the rows of one forward pass
within a mini-batch (mini-batch / gradient_accumulation_steps rows), rows of similar length together with the
padding they all share cut off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from marlhf.rollout import Rollout, length_sorted_chunks, trim_padding

__all__ = ["Experience"]


@dataclasses.dataclass
class Experience:
    """The rows of one PPO step on this process; B rows, P prompt and T response columns.

    Filled by stage 1 (`make_experience`), from the sampled and scored rollout:
        prompt_rows: list[int] (host), each row's index into the run's prompt records
        query_ids: long [B, P], left-padded; query_mask: bool [B, P]
        response_ids: long [B, T], right-padded; response_mask: bool [B, T], True up to and including EOS
        query_lengths, response_lengths: list[int] (host), real tokens of each row
        logprobs: float [B, T], the sampling policy's log-probs of the drawn tokens (detached)
        ref_logprobs: float [B, T] or None (no reference model)
        values: float [B, T] or None (no critic), the critic's values before each token (detached)
        scores: float [B], one score per response
        attached_logprobs, attached_values: float [B, T] or None, the same forwards with their autograd graphs,
            kept when the step makes one update of the whole rollout, which then backpropagates through them
            instead of running them again (`PPOConfig.reuses_rollout_forward`)
        rollout_logprobs: float [B, T] or None, the engine's own sampling log-probs, kept beside the trainer's
            `logprobs` when something compares them (`PPOConfig.compares_rollout_logprobs`: the
            rollout/logprob_diff metrics, truncated importance sampling)
        entropy: float [B, T] or None, the sampling policy's entropy at each token, from the forward that gives
            `logprobs`, kept when the estimator reads it (its `reads_entropy` trait)
    Stage 2 (`per_token_rewards`): rewards float [B, T]; kl_coef float, the coefficient they used.
    Stage 3 (`macro_actions`): segment_ids long [B, T] (-1 on padding); segmentation_stats {name: number}.
    Stage 4 (`estimate_advantages`): advantages float [B, T]; returns float [B, T] or None (no critic);
        continuation_tokens: int or None, the tokens of the estimator's Monte-Carlo continuations (None: it made none)
    """

    prompt_rows: list[int]
    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    query_lengths: list[int]
    response_lengths: list[int]
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    scores: torch.Tensor
    attached_logprobs: torch.Tensor | None = None
    attached_values: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    kl_coef: float | None = None
    segment_ids: torch.Tensor | None = None
    segmentation_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    continuation_tokens: int | None = None

    # Per-row fields: tensors indexed by row, host lists picked by row; the rest belongs to the whole step.
    _PROMPT_COLUMNS = ("query_ids", "query_mask")
    _RESPONSE_COLUMNS = ("response_ids", "response_mask", "logprobs", "ref_logprobs", "values", "attached_logprobs",
                         "attached_values", "rollout_logprobs", "entropy", "rewards", "segment_ids", "advantages",
                         "returns")
    _ROWS = ("scores",)
    _HOST_ROWS = ("prompt_rows", "query_lengths", "response_lengths")

    @classmethod
    def from_rollout(cls, rollout: Rollout, prompt_rows: list[int], attached: tuple | None) -> Experience:
        logprobs, values = attached if attached is not None else (None, None)
        fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
        return cls(prompt_rows=prompt_rows, attached_logprobs=logprobs, attached_values=values, **fields)

    @property
    def num_rows(self) -> int:
        return len(self.prompt_rows)

    def select(self, rows: list[int]) -> Experience:
        """These rows, in this order (every per-row field)."""
        index = torch.tensor(rows, device=self.response_mask.device)
        picked = {name: [getattr(self, name)[row] for row in rows] for name in self._HOST_ROWS}
        for name in (*self._PROMPT_COLUMNS, *self._RESPONSE_COLUMNS, *self._ROWS):
            value = getattr(self, name)
            picked[name] = value[index] if value is not None else None
        return dataclasses.replace(self, **picked)

    def trimmed(self) -> Experience:
        """The same rows without the columns that are padding in all of them (leading prompt columns, trailing
        response columns; `marlhf.rollout.trim_padding`)."""
        query_ids, query_mask, response_ids, _ = trim_padding(self.query_ids, self.query_mask, self.response_ids,
                                                              self.response_mask, self.query_lengths,
                                                              self.response_lengths)
        width = response_ids.shape[1]
        cut = {name: getattr(self, name)[:, :width] for name in self._RESPONSE_COLUMNS
               if getattr(self, name) is not None}
        return dataclasses.replace(self, **cut, query_ids=query_ids, query_mask=query_mask)

    def pieces(self, rows: list[int], piece_size: int) -> Iterator[tuple[bool, list[int], Experience]]:
        """`rows` in length-sorted pieces of at most `piece_size` rows, each trimmed: (is_last, its rows, piece).
        Rows of similar length share a piece, so trimming cuts most of their padding."""
        chunks = length_sorted_chunks([self.query_lengths[row] for row in rows],
                                      [self.response_lengths[row] for row in rows], piece_size)
        for number, chunk in enumerate(chunks):
            piece_rows = [rows[i] for i in chunk]
            yield number == len(chunks) - 1, piece_rows, self.select(piece_rows).trimmed()

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_ids, query_mask, response_ids, response_mask): what the policy and critic forwards take."""
        return self.query_ids, self.query_mask, self.response_ids, self.response_mask
