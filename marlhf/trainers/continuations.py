"""Monte-Carlo continuations of response prefixes: the trainer's side of `AdvantageBatch.continue_and_score`
(marlhf.estimators.ContinueAndScore), which the `mc_segment` estimator calls.

A prefix is a row's prompt and its first t response tokens; a continuation is sampled from it by the run's
rollout engine (marlhf.engines, any engine: only `generate` is called) until EOS or the run's response length
(prefix + continuation <= max_response_length tokens, the main rollout's budget), and the full response
(prefix + continuation) is scored as the run scores its responses. Layout as in marlhf.rollout: prompts
left-padded `[B, P]`, responses right-padded `[B, T]`.

For episodes of an environment (`--env`), a prefix ends at a turn start and a continuation is the rest of the
episode (`EpisodeContinuations`): its environment restored, the turn and the later ones played by the policy, its
score the sum of the (clipped) turn rewards from the boundary's turn on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from marlhf.engines.base import Generation, model_positions
from marlhf.envs import make_env
from marlhf.multiturn import EngineSampler, EpisodePrefix, MultiTurnRollout, continue_episodes, episode_prefixes
from marlhf.rollout import Experience, response_scores
from marlhf.trainers.ppo_setup import PPORun, mixed_seed

__all__ = ["PrefixContinuations", "EpisodeContinuations", "prefixed_prompts", "join_continuations",
           "run_continuations"]


def prefixed_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                     rows: torch.Tensor, prefix_lengths: torch.Tensor,
                     pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt of row `rows[n]` followed by its first `prefix_lengths[n]` response tokens, left-padded: what the
    engine continues. prompt_ids, prompt_mask: [B, P]; response_ids: [B, T]; rows, prefix_lengths: long [N];
    returns (ids long [N, W], mask bool [N, W]), W the longest prefix (columns that are padding in every row cut)."""
    width = response_ids.shape[1]
    ids = torch.cat([prompt_ids[rows], response_ids[rows]], dim=1)
    positions = torch.arange(width, device=rows.device)[None, :]
    mask = torch.cat([prompt_mask[rows].bool(), positions < prefix_lengths[:, None]], dim=1)
    # Shift each row right by its unused response columns, so that its real tokens end at the last column.
    source = torch.arange(ids.shape[1], device=rows.device)[None, :] - (width - prefix_lengths)[:, None]
    mask = mask.gather(1, source.clamp(min=0)) & (source >= 0)
    ids = ids.gather(1, source.clamp(min=0)).masked_fill(~mask, pad_token_id)
    longest = int(mask.sum(dim=1).max()) if rows.numel() else 0
    return ids[:, ids.shape[1] - longest:], mask[:, ids.shape[1] - longest:]


def join_continuations(response_ids: torch.Tensor, rows: torch.Tensor, prefix_lengths: torch.Tensor,
                       continuation: Generation, width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full responses: row `rows[n]`'s first `prefix_lengths[n]` response tokens, then continuation n, cut to
    `width` tokens (the run's response length) and right-padded. response_ids: [B, T]; rows, prefix_lengths: long
    [N]; continuation: [N, C]; returns (ids long [N, width], mask bool [N, width])."""
    positions = torch.arange(width, device=rows.device)[None, :]
    in_prefix = positions < prefix_lengths[:, None]
    prefix = response_ids[rows].gather(1, positions.clamp(max=response_ids.shape[1] - 1).expand(len(rows), -1))
    offset = positions - prefix_lengths[:, None]  # the continuation's token at each position
    columns = continuation.response_ids.shape[1]
    inside = (offset >= 0) & (offset < columns)
    index = offset.clamp(0, columns - 1)
    mask = in_prefix | (continuation.response_mask.bool().gather(1, index) & inside)
    ids = torch.where(in_prefix, prefix, continuation.response_ids.gather(1, index))
    return ids.masked_fill(~mask, pad_token_id), mask


@dataclasses.dataclass
class PrefixContinuations:
    """`continue_and_score(rows, prefix_lengths, k) -> scores [N, k]` over one step's rows: all N x k continuations
    in one `generate` call, continuation j of row r's prefix of length t from the seed `seed(r, t, j)` (the same
    seed gives the same continuation in any batch), their full responses scored by `score`. Counts its engine
    calls and the continuation tokens it keeps (`calls`, `tokens`; a continuation past the response length is cut
    there, and its cut tokens are not counted).

    One call generates max_response_length - (the shortest prefix) tokens for every row, so a row with a longer
    prefix runs past its own budget (those tokens are cut). When that would take a row past `max_length` positions
    (prompt + prefix + generated: the run's context, which the main rollout fits), the rows sorted by prefix length
    are split into consecutive runs, each as long as fits: the engine is never asked for positions the model may
    not have.

    prompt_ids, prompt_mask: [B, P], the step's prompts; response_ids: [B, T], its responses;
    generate(ids, mask, row_seeds, max_new_tokens) -> Generation: the run's engine with its sampling settings;
    score(rows, prompt_ids, prompt_mask, response_ids, response_mask) -> float [N]: final scores of full responses;
    max_response_length: the longest response (prefix + continuation); max_length: the longest prompt + response
    a call may reach (the run's context, at least the longest prompt + max_response_length)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    generate: Callable[[torch.Tensor, torch.Tensor, list[int], int], Generation]
    score: Callable[[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    seed: Callable[[int, int, int], int]
    max_response_length: int
    pad_token_id: int
    max_length: int
    calls: int = 0
    tokens: int = 0

    def __call__(self, rows: torch.Tensor, prefix_lengths: torch.Tensor, k: int) -> torch.Tensor:
        if k < 1:
            raise ValueError(f"`k` must be >= 1, got {k}")
        rows, prefix_lengths = rows.repeat_interleave(k), prefix_lengths.repeat_interleave(k)  # [N * k]
        if rows.numel() == 0:
            return self.response_ids.new_zeros((0, k), dtype=torch.float32)
        host_rows, host_lengths = torch.stack([rows, prefix_lengths]).tolist()
        seeds = [self.seed(row, length, i % k) for i, (row, length) in enumerate(zip(host_rows, host_lengths))]
        ids, mask = prefixed_prompts(self.prompt_ids, self.prompt_mask, self.response_ids, rows, prefix_lengths,
                                     self.pad_token_id)
        groups = self._calls_that_fit(mask.sum(1).tolist(), host_lengths)
        width = self.max_response_length
        response_ids = torch.full((len(host_rows), width), self.pad_token_id, dtype=self.response_ids.dtype,
                                  device=rows.device)
        response_mask = torch.zeros((len(host_rows), width), dtype=torch.bool, device=rows.device)
        for group in groups:
            index = torch.tensor(group, device=rows.device)
            # A group's own left padding: the shortest columns that hold its longest prefix.
            group_mask = mask[index]
            used = int(group_mask.sum(1).max())
            continuation = self.generate(ids[index, ids.shape[1] - used:], group_mask[:, mask.shape[1] - used:],
                                         [seeds[i] for i in group], width - min(host_lengths[i] for i in group))
            response_ids[index], response_mask[index] = join_continuations(
                self.response_ids, rows[index], prefix_lengths[index], continuation, width, self.pad_token_id)
        self.calls += len(groups)
        self.tokens += int(response_mask.sum()) - sum(host_lengths)
        return self.score(host_rows, self.prompt_ids[rows], self.prompt_mask[rows], response_ids,
                          response_mask).view(-1, k)

    def _calls_that_fit(self, lengths: list[int], prefix_lengths: list[int]) -> list[list[int]]:
        """The rows of each engine call: all in one when the longest input (prompt + prefix, `lengths`) plus the
        tokens to generate (max_response_length - the shortest prefix) fits max_length; otherwise consecutive runs
        of the rows sorted by prefix length, each as long as it fits (a row alone always fits: its prompt plus
        max_response_length does)."""
        groups: list[list[int]] = []
        longest = shortest_prefix = 0  # of the last group
        for i in sorted(range(len(lengths)), key=lambda i: (prefix_lengths[i], i)):
            if groups and max(longest, lengths[i]) + self.max_response_length - shortest_prefix <= self.max_length:
                groups[-1].append(i)
                longest = max(longest, lengths[i])
                continue
            if lengths[i] + self.max_response_length - prefix_lengths[i] > self.max_length:
                raise ValueError(f"a prompt of {lengths[i] - prefix_lengths[i]} tokens plus max_response_length "
                                 f"{self.max_response_length} exceeds max_length {self.max_length}")
            groups.append([i])
            longest, shortest_prefix = lengths[i], prefix_lengths[i]
        return [sorted(group) for group in groups]


@dataclasses.dataclass
class EpisodeContinuations:
    """`continue_and_score(rows, prefix_lengths, k) -> scores [N, k]` over one step's episodes (`experience`, with
    `turn_ids`): episode r's prefix of t response tokens must end where a turn k starts; its k continuations
    (`play(prefixes, k, seeds)`: marlhf.multiturn.continue_episodes) restore its environment, keep those tokens
    and play the rest of the episode, continuation j from the seed `seed(r, t, j)`. A continuation's score is its
    return to go, sum_{j >= k} clip(R_j): the rewards of turns before k are already on their last action tokens
    (the per-token rewards), so with these values mc_segment's V(next) - V(start) + the segment's rewards is the
    turn's advantage. Counts the `play` engine calls and the action tokens they sample (`calls`, `tokens`)."""

    experience: Experience
    tokenizer: Any
    tasks: list[Any]
    play: Callable[[list[EpisodePrefix], int, list[int]], MultiTurnRollout]
    seed: Callable[[int, int, int], int]
    clip: Callable[[torch.Tensor], torch.Tensor]
    calls: int = 0
    tokens: int = 0

    def __call__(self, rows: torch.Tensor, prefix_lengths: torch.Tensor, k: int) -> torch.Tensor:
        if k < 1:
            raise ValueError(f"`k` must be >= 1, got {k}")
        host_rows, host_lengths = torch.stack([rows, prefix_lengths]).tolist() if rows.numel() else ([], [])
        if not host_rows:
            return self.experience.turn_rewards.new_zeros((0, k))
        prefixes = episode_prefixes(self.experience, host_rows, host_lengths, self.tokenizer,
                                    self.experience.env_seeds, self.tasks)
        rollout = self.play(prefixes, k, [self.seed(row, length, j) for row, length in zip(host_rows, host_lengths)
                                          for j in range(k)])
        device = rollout.turn_rewards.device
        first_turns = torch.tensor([len(prefix.turn_rewards) for prefix in prefixes], device=device)
        later = torch.arange(rollout.turn_rewards.shape[1], device=device)[None, :] >= \
            first_turns.repeat_interleave(k)[:, None]  # the boundary's turn and the later ones
        scores = torch.where(later, self.clip(rollout.turn_rewards), 0.0).sum(1)
        self.calls += int(rollout.metrics["env/generate_calls"])
        self.tokens += int(rollout.action_mask.sum()) - k * sum(sum(t >= 0 for t in p.turn_of) for p in prefixes)
        return scores.view(-1, k).to(self.experience.turn_rewards.device)


def _continuation_seed(run: PPORun, step: int) -> Callable[[int, int, int], int]:
    """Continuation j of the prefix of length t of row r (among all processes' rows) is seeded by (seed, step, r,
    t + 1, j), which no rollout seed (seed, step, r) equals."""
    first_row = run.accelerator.process_index * run.config.rollout_size
    return lambda row, length, sample: mixed_seed(run.config.seed, step, first_row + row, length + 1, sample)


def episode_continuations(run: PPORun, experience: Experience) -> EpisodeContinuations:
    """A PPO step's `continue_and_score` over its episodes: played on the run's engine as its episodes are
    (`run.episodes`: environment, limits, sampling settings), seeded as `_continuation_seed` says."""
    spec, accelerator = run.episodes, run.accelerator

    def play(prefixes: list[EpisodePrefix], k: int, seeds: list[int]) -> MultiTurnRollout:
        run.train(False)  # the rollout's mode: dropout off, KV cache on
        with accelerator.autocast(), torch.no_grad():
            return continue_episodes(lambda: make_env(spec.env, spec.env_options),
                                     EngineSampler(run.engine, **spec.sampling), spec.tokenizer, prefixes, k, seeds,
                                     options=spec.options, max_length=spec.max_length, env_name=spec.env,
                                     device=accelerator.device)

    return EpisodeContinuations(experience, run.tokenizer, [run.prompt_records[i] for i in experience.prompt_rows],
                                play, _continuation_seed(run, experience.step), run.clipped)


def run_continuations(run: PPORun, experience: Experience) -> PrefixContinuations | EpisodeContinuations:
    """A PPO step's `continue_and_score` over its rows (`episode_continuations` for episodes): sampled by the run's
    engine with the rollout's settings, seeded by `_continuation_seed`; scored as the rollout is, clipped."""
    if experience.turn_ids is not None:
        return episode_continuations(run, experience)
    config, accelerator = run.config, run.accelerator

    def generate(ids: torch.Tensor, mask: torch.Tensor, seeds: list[int], max_new_tokens: int):
        run.train(False)  # the rollout's mode: dropout off, KV cache on
        with accelerator.autocast():
            return run.engine.generate(ids, mask, row_seeds=seeds, max_new_tokens=max_new_tokens, **run.sampling)

    def score(rows: list[int], *batch: torch.Tensor) -> torch.Tensor:
        prompt_rows = [experience.prompt_rows[row] for row in rows]
        logged = getattr(run.reward_fn, "last_means", None)  # the step logs the rollout's reward means
        with accelerator.autocast():
            scores = response_scores(*batch, reward_model=run.reward_model, reward_fn=run.reward_fn,
                                     prompts=[run.prompt_records[i]["prompt"] for i in prompt_rows],
                                     tokenizer=run.tokenizer, reward_kwargs=run.record_fields(prompt_rows),
                                     piece_size=config.forward_batch_size or run.piece_size)
        if logged is not None:
            run.reward_fn.last_means = logged
        return run.clipped(scores)

    # the longest prompt + response an engine call may reach: max_length, or fewer if the policy has fewer positions
    positions = model_positions(accelerator.unwrap_model(run.policy))
    context_length = config.max_length if positions is None else min(config.max_length, positions)
    return PrefixContinuations(experience.prompt_ids, experience.prompt_mask, experience.response_ids, generate, score,
                               _continuation_seed(run, experience.step), config.max_response_length,
                               run.tokenizer.pad_token_id, context_length)
