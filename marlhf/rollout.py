"""Scoring PPO's rollouts: log-probs, values and scores of sampled responses, one batched forward per model.

Layout of one batch (B rows): the prompts are left-padded `[B, P]` and the sampled responses are
right-padded `[B, T]`, so `cat([prompt, response], 1)` puts every prompt's last token at column
P - 1 and every response's first token at column P. A response keeps its EOS token; tokens after
the first EOS are padding (mask False). All per-token outputs are `[B, T]` over response tokens,
0 on padding, aligned so that position t describes the action "emit response token t":
log-probs of token t and the critic's value of the state just before it. Sampling is the rollout engines'
(marlhf.engines; the hf engine's in marlhf.engines.hf).

Call these with the models in eval mode: PPO's ratio compares the rollout's log-probs with a later
forward pass of the same weights, which dropout would perturb.

`score_responses` returns an `Experience`, the one batch type of a PPO step, which the trainer's stages then fill.
Vocabulary (docs/algorithm.md): a *row* is one sampled response with its prompt; a step's rows on one process
are its rollout; a *mini-batch* is the rows of one optimizer update; a *piece* is the rows of one forward pass
(within a mini-batch: mini-batch / gradient_accumulation_steps rows), rows of similar length together with the
padding they all share cut off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from marlhf.modeling import ScalarHeadModel, sequence_logprobs, sequence_logprobs_and_entropy

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


@dataclasses.dataclass
class Experience:
    """The rows of one PPO step on this process; B rows, P prompt and T response columns. `score_responses` fills
    the sampled and scored rollout; the trainer's stages (marlhf.trainers.ppo) fill the rest in turn.

    Stage 2 (`score`), from `score_responses`:
        prompt_ids: long [B, P], left-padded; prompt_mask: bool [B, P]
        response_ids: long [B, T], right-padded; response_mask: bool [B, T], True up to and including EOS
        logprobs: float [B, T], the sampling policy's log-probs of the drawn tokens (detached)
        ref_logprobs: float [B, T] or None (no reference model)
        values: float [B, T] or None (no critic), the critic's values before each token (detached)
        scores: float [B], one score per response (reward model or reward function)
        prompt_lengths, response_lengths: list[int] (host), real tokens of each row (row_lengths)
        entropy: float [B, T] or None, the sampling policy's entropy at each token, from the forward that gives
            `logprobs`, kept when the estimator reads it (its `reads_entropy` trait)
      and from the trainer:
        step: int, the PPO step
        prompt_rows: list[int] (host), each row's index into the run's prompt records
        attached_logprobs, attached_values: float [B, T] or None, the same forwards with their autograd graphs,
            kept when the step makes one update of the whole rollout, which then backpropagates through them
            instead of running them again (`PPOConfig.reuses_rollout_forward`)
        rollout_logprobs: float [B, T] or None, the engine's own sampling log-probs, kept beside the trainer's
            `logprobs` when something compares them (`PPOConfig.compares_rollout_logprobs`: the
            rollout/logprob_diff metrics, truncated importance sampling)
      multi-turn episodes (`--env`, marlhf.trainers.episodes; one a row, docs/multiturn.md), else None:
        action_mask: bool [B, T], the tokens the policy sampled (`response_mask`: every real token, actions and
            observations, what the forwards attend to); turn_ids: long [B, T], each action token's turn, -1 elsewhere;
        turn_rewards: float [B, K], the environment's reward of each turn; turn_state_ids: long [B, K], the state
            before each turn (-1 past an episode's turns); env_metrics: the rollout's env/* metrics ({} without);
        env_seeds: list[int] (host), each episode's reset seed (what Monte-Carlo continuations restore it with)
    Stage 3 (`per_token_rewards`): rewards float [B, T]; kl_coef float, the coefficient they used.
    Stage 4 (`macro_actions`): segment_ids long [B, T] (-1 on padding); segmentation_stats {name: number}.
    Stage 5 (`estimate_advantages`): advantages float [B, T]; returns float [B, T] or None (no critic);
        continuation_tokens: int or None, the tokens of the estimator's Monte-Carlo continuations (None: it made none)
    Stage 6 (`ppo_update`): update_stats {name: [one value per piece]}.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    scores: torch.Tensor
    prompt_lengths: list[int]
    response_lengths: list[int]
    entropy: torch.Tensor | None = None
    step: int = 0
    prompt_rows: list[int] = dataclasses.field(default_factory=list)
    attached_logprobs: torch.Tensor | None = None
    attached_values: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    kl_coef: float | None = None
    segment_ids: torch.Tensor | None = None
    segmentation_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    continuation_tokens: int | None = None
    update_stats: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    action_mask: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    turn_state_ids: torch.Tensor | None = None
    env_metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_seeds: list[int] = dataclasses.field(default_factory=list)

    # Per-row fields: tensors indexed by row, host lists picked by row; the rest belongs to the whole step.
    _PROMPT_COLUMNS = ("prompt_ids", "prompt_mask")
    _RESPONSE_COLUMNS = ("response_ids", "response_mask", "logprobs", "ref_logprobs", "values", "attached_logprobs",
                         "attached_values", "rollout_logprobs", "entropy", "rewards", "segment_ids", "advantages",
                         "returns", "action_mask", "turn_ids")
    _ROWS = ("scores", "turn_rewards", "turn_state_ids")
    _HOST_ROWS = ("prompt_rows", "prompt_lengths", "response_lengths", "env_seeds")

    def select(self, rows: list[int]) -> Experience:
        """These rows, in this order (every per-row field)."""
        index = torch.tensor(rows, device=self.response_mask.device)
        picked = {name: [getattr(self, name)[row] for row in rows] for name in self._HOST_ROWS if getattr(self, name)}
        for name in (*self._PROMPT_COLUMNS, *self._RESPONSE_COLUMNS, *self._ROWS):
            value = getattr(self, name)
            picked[name] = value[index] if value is not None else None
        return dataclasses.replace(self, **picked)

    def trimmed(self) -> Experience:
        """The same rows without the columns that are padding in all of them (leading prompt columns, trailing
        response columns; `trim_padding`)."""
        prompt_ids, prompt_mask, response_ids, _ = trim_padding(self.prompt_ids, self.prompt_mask, self.response_ids,
                                                                self.response_mask, self.prompt_lengths,
                                                                self.response_lengths)
        width = response_ids.shape[1]
        cut = {name: getattr(self, name)[:, :width] for name in self._RESPONSE_COLUMNS
               if getattr(self, name) is not None}
        return dataclasses.replace(self, **cut, prompt_ids=prompt_ids, prompt_mask=prompt_mask)

    def pieces(self, rows: list[int], piece_size: int) -> Iterator[tuple[bool, list[int], Experience]]:
        """`rows` in length-sorted pieces of at most `piece_size` rows, each trimmed: (is_last, its rows, piece).
        Rows of similar length share a piece, so trimming cuts most of their padding."""
        pieces = length_sorted_pieces([self.prompt_lengths[row] for row in rows],
                                      [self.response_lengths[row] for row in rows], piece_size)
        for number, piece in enumerate(pieces):
            piece_rows = [rows[i] for i in piece]
            yield number == len(pieces) - 1, piece_rows, self.select(piece_rows).trimmed()

    @property
    def actions(self) -> torch.Tensor:
        """bool [B, T]: the tokens the policy sampled, what the losses, the KL and the advantages are over (the
        response mask in a single-turn row; with gaps on a multi-turn episode's observations)."""
        return self.response_mask if self.action_mask is None else self.action_mask

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, response_ids, response_mask): what the policy and critic forwards take."""
        return self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask


def _sequence(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of prompt + response."""
    return torch.cat([prompt_ids, response_ids], dim=1), torch.cat([prompt_mask, response_mask], dim=1).long()


def row_lengths(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Prompt and response token counts of each row, read to the host once (one device read) so that
    trim_padding and length_sorted_pieces need none."""
    prompt_lengths, response_lengths = torch.stack([prompt_mask.sum(1), response_mask.sum(1)]).tolist()
    return prompt_lengths, response_lengths


def trim_padding(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor, prompt_lengths: Sequence[int],
                 response_lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows without the columns that are padding in all of them (leading prompt columns, trailing
    response columns; at least one response column stays), given the rows' token counts (row_lengths).
    Positions come from the masks, so outputs on real tokens do not change, and a forward pass costs only
    the columns left."""
    first = prompt_ids.shape[1] - max(prompt_lengths, default=0)  # left padding: the real columns are a suffix
    width = max(max(response_lengths, default=0), 1)  # right padding: the real columns are a prefix
    return prompt_ids[:, first:], prompt_mask[:, first:], response_ids[:, :width], response_mask[:, :width]


def length_sorted_pieces(prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                         piece_size: int) -> list[list[int]]:
    """Row indices, longest rows (prompt + response tokens) first, ties in row order, in pieces of at most
    `piece_size`: rows of similar length share a piece, so trim_padding cuts most of each piece's padding."""
    if piece_size < 1:
        raise ValueError(f"`piece_size` must be >= 1, got {piece_size}")
    lengths = [q + r for q, r in zip(prompt_lengths, response_lengths, strict=True)]
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])  # sorted is stable
    return [order[start : start + piece_size] for start in range(0, len(order), piece_size)]


def forward_in_pieces(forward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], prompt_ids: torch.Tensor,
                      prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor,
                      piece_size: int | None = None, lengths: tuple[Sequence[int], Sequence[int]] | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`forward(prompt_ids, prompt_mask, response_ids, response_mask)` over length_sorted_pieces of the rows, each
    trimmed by trim_padding, put back in row order: `[B]` results as they are, `[rows, T']` per-token results
    right-padded with 0 to `[B, T]`; a forward that returns a tuple of such results gives the tuple of them.
    `piece_size` None: all rows at once. `lengths`: the rows' row_lengths, if the caller has them (else read
    here)."""
    batch = (prompt_ids, prompt_mask, response_ids, response_mask)
    prompt_lengths, response_lengths = lengths if lengths is not None else row_lengths(prompt_mask, response_mask)
    pieces = length_sorted_pieces(prompt_lengths, response_lengths, piece_size or prompt_ids.shape[0])
    outputs = []
    for rows in pieces:
        index = torch.tensor(rows, device=prompt_ids.device)
        output = forward(*trim_padding(*(x[index] for x in batch), [prompt_lengths[row] for row in rows],
                                       [response_lengths[row] for row in rows]))
        outputs.append(output if isinstance(output, tuple) else (output,))
    order = torch.tensor([row for rows in pieces for row in rows], device=prompt_ids.device).argsort()

    def padded(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x, (0, response_ids.shape[1] - x.shape[1])) if x.dim() == 2 else x

    results = tuple(torch.cat([padded(output[i]) for output in outputs])[order] for i in range(len(outputs[0])))
    return results if isinstance(output, tuple) else results[0]


def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs `[B, T]` of the response tokens under `model`, from logits divided by the sampling
    temperature (the distribution the tokens were drawn from, before top-k/top-p truncation). One
    forward pass; gradients flow when enabled. 0 on padding."""
    input_ids, attention_mask = _sequence(prompt_ids, prompt_mask, response_ids, response_mask)
    logprobs = sequence_logprobs(model, input_ids, attention_mask, num_tokens=response_ids.shape[1],
                                 temperature=temperature)
    return logprobs.masked_fill(~response_mask, 0.0)


def response_logprobs_and_entropy(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_logprobs` and, from the same forward, the entropy `[B, T]` of softmax(logits / temperature) at each
    response token (no gradient; 0 on padding)."""
    input_ids, attention_mask = _sequence(prompt_ids, prompt_mask, response_ids, response_mask)
    logprobs, entropy = sequence_logprobs_and_entropy(model, input_ids, attention_mask,
                                                      num_tokens=response_ids.shape[1], temperature=temperature)
    return logprobs.masked_fill(~response_mask, 0.0), entropy.masked_fill(~response_mask, 0.0)


def response_values(
    critic: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Critic values `[B, T]`: entry t is the value of the state before response token t (the
    critic's output at column P-1+t). 0 on padding."""
    values = critic(*_sequence(prompt_ids, prompt_mask, response_ids, response_mask))
    num_response = response_ids.shape[1]
    return values[:, -num_response - 1 : -1].masked_fill(~response_mask, 0.0)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Response texts without padding and special tokens (EOS)."""
    return tokenizer.batch_decode(response_ids.masked_fill(~response_mask, tokenizer.pad_token_id),
                                  skip_special_tokens=True)


@torch.no_grad()
def score_responses(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ref: nn.Module | None,
    temperature: float,
    policy: nn.Module | None = None,
    logprobs: torch.Tensor | None = None,
    critic: nn.Module | None = None,
    values: torch.Tensor | None = None,
    reward_model: ScalarHeadModel | None = None,
    reward_fn: RewardFn | None = None,
    prompts: list[str] | None = None,
    tokenizer=None,
    piece_size: int | None = None,
    reward_kwargs: dict[str, list] | None = None,
    with_entropy: bool = False,
    entropy: torch.Tensor | None = None,
) -> Experience:
    """Everything PPO needs about sampled responses, one batched forward per model: policy and
    reference log-probs (none when `ref` is None), critic values (when there is a critic) and one score per
    response, from `reward_model` or, when given instead, from `reward_fn(prompts, decoded_responses)`.

    The policy's log-probs come from `policy`, or are `logprobs` the caller already computed (PPO does, with
    gradients, when its update reuses that forward); likewise the critic's values come from `critic` or are
    `values`. `with_entropy` also keeps the policy's entropy at each token from its forward (or takes `entropy`,
    given with `logprobs`). Given tensors are stored detached. `reward_kwargs` (record fields, a list each) go to
    `reward_fn` as keyword arguments (TRL's convention, marlhf.rewards.functions). Models see `piece_size` rows at a
    time (None: all), rows of similar length together with their common padding cut (forward_in_pieces)."""
    if (policy is None) == (logprobs is None):
        raise ValueError("give exactly one of `policy` and `logprobs`")
    if with_entropy and (policy is None) == (entropy is None):
        raise ValueError("`with_entropy` takes the entropy from `policy`'s forward, or as `entropy` with `logprobs`")
    if critic is not None and values is not None:
        raise ValueError("give at most one of `critic` and `values`")
    _check_reward_source(reward_model, reward_fn, prompts, tokenizer, prompt_ids.shape[0])
    batch = (prompt_ids, prompt_mask, response_ids, response_mask)
    for name, given in (("logprobs", logprobs), ("values", values)):
        if given is not None and given.shape != response_ids.shape:
            raise ValueError(f"`{name}` has shape {tuple(given.shape)}, the responses {tuple(response_ids.shape)}")

    lengths = row_lengths(prompt_mask, response_mask)

    def run(forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        return forward_in_pieces(forward, *batch, piece_size=piece_size, lengths=lengths)

    if policy is not None and with_entropy:
        logprobs, entropy = run(lambda *rows: response_logprobs_and_entropy(policy, *rows, temperature=temperature))
    elif policy is not None:
        logprobs = run(lambda *rows: response_logprobs(policy, *rows, temperature=temperature))
    ref_logprobs = None
    if ref is not None:
        ref_logprobs = run(lambda *rows: response_logprobs(ref, *rows, temperature=temperature))
    if critic is not None:
        values = run(lambda *rows: response_values(critic, *rows))
    logprobs, values = logprobs.detach(), values.detach() if values is not None else None
    scores = response_scores(*batch, reward_model=reward_model, reward_fn=reward_fn, prompts=prompts,
                             tokenizer=tokenizer, piece_size=piece_size, reward_kwargs=reward_kwargs, lengths=lengths)
    return Experience(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ref_logprobs, values, scores,
                      *lengths, entropy=entropy.detach() if with_entropy else None)


def _check_reward_source(reward_model, reward_fn, prompts, tokenizer, num_rows: int) -> None:
    if (reward_model is None) == (reward_fn is None):
        raise ValueError("give exactly one of `reward_model` and `reward_fn`")
    if reward_fn is not None and (prompts is None or tokenizer is None):
        raise ValueError("`reward_fn` needs the `prompts` texts and a `tokenizer` to decode responses")
    if prompts is not None and len(prompts) != num_rows:
        raise ValueError(f"`prompts` has {len(prompts)} texts for {num_rows} rows")


@torch.no_grad()
def response_scores(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_model: ScalarHeadModel | None = None,
    reward_fn: RewardFn | None = None,
    prompts: list[str] | None = None,
    tokenizer=None,
    piece_size: int | None = None,
    reward_kwargs: dict[str, list] | None = None,
    lengths: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """One score per response `[B]`: `reward_model` at the last real token of prompt + response (`piece_size` rows
    at a time, forward_in_pieces; `lengths`: the rows' row_lengths if known), or, when given instead,
    `reward_fn(prompts, decoded_responses, **reward_kwargs)` (score_responses' arguments)."""
    _check_reward_source(reward_model, reward_fn, prompts, tokenizer, prompt_ids.shape[0])
    if reward_model is not None:
        return forward_in_pieces(lambda *rows: reward_model.score(*_sequence(*rows)), prompt_ids, prompt_mask,
                                 response_ids, response_mask, piece_size=piece_size, lengths=lengths)
    responses = decode_responses(tokenizer, response_ids, response_mask)
    scores = torch.tensor([float(s) for s in reward_fn(prompts, responses, **(reward_kwargs or {}))],
                          device=prompt_ids.device)
    if scores.shape != (len(responses),):
        raise ValueError(f"`reward_fn` returned {scores.numel()} scores for {len(responses)} responses")
    return scores
