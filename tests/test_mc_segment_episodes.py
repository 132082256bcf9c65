"""`mc_segment` on episodes of an environment: Monte-Carlo continuations from a turn start
(marlhf.multiturn.continue_episodes, marlhf.trainers.continuations.EpisodeContinuations) restore the environment,
keep the episode's tokens and play the rest; their score is the return to go from the boundary's turn."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from marlhf.engines import HFEngine, HFOptions, model_positions
from marlhf.envs import Env
from marlhf.estimators.mc_segment import mc_boundary_values
from marlhf.multiturn import (EngineSampler, MultiTurnOptions, ObservationEncoder, continue_episodes,
                              episode_prefixes, rollout_episodes, turn_seed)
from marlhf.trainers.continuations import EpisodeContinuations
from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()
OPTIONS = MultiTurnOptions(max_turns=4, max_turn_tokens=5, max_response_tokens=200)


@pytest.fixture(scope="module")
def policy():
    return build_tiny_causal_lm(TOKENIZER).eval()


def _sampler(policy):
    engine = HFEngine()
    engine.options = HFOptions(sampling_noise="row_generators")
    engine.sync_weights(policy)
    return EngineSampler(engine, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=TOKENIZER.eos_token_id,
                         pad_token_id=TOKENIZER.pad_token_id)


class Memory(Env):
    """Stateful: its reply and reward depend on every action so far (their lengths' running sum); ends after
    `task` turns. Counts its resets, class-wide."""

    resets = 0

    def reset(self, seed, task=None):
        Memory.resets += 1
        self.turns, self.lengths = task, [seed % 5]
        return f"start {seed % 5}", {}

    def step(self, action_text):
        self.lengths.append(len(action_text))
        total, turn = sum(self.lengths), len(self.lengths) - 1
        return f"sum {total % 7}", float(total % 4) + 0.25 * turn, turn >= self.turns, False, {}


class CopiedMemory(Memory):
    def clone(self):  # its state copies: no replay
        return copy.deepcopy(self)


def _episodes(policy, env=Memory):
    tasks, seeds, env_seeds = [3, 2, 3], [11, 12, 13], [21, 21, 23]
    rollout = rollout_episodes([env() for _ in tasks], _sampler(policy), TOKENIZER, seeds=seeds, env_seeds=env_seeds,
                               tasks=tasks, options=OPTIONS, max_length=model_positions(policy))
    return rollout, tasks, env_seeds


def _turn_starts(rollout):
    """(row, response token) of every turn start of every episode."""
    turns = rollout.turn_ids
    previous = torch.cat([torch.full_like(turns[:, :1], -1), turns[:, :-1]], 1)
    rows, starts = ((turns >= 0) & (turns != previous)).nonzero(as_tuple=True)
    return rows.tolist(), starts.tolist()


def _reference(policy, rollout, row, start, task, env_seed, seed):
    """The slow way, one continuation alone: replay the environment, then generate and step turn by turn from the
    episode's tokens before `start`; (all tokens, the rewards of the turns from the boundary's on)."""
    sampler, encoder = _sampler(policy), ObservationEncoder(TOKENIZER)
    tokens, turns = rollout.response_ids[row, :start].tolist(), rollout.turn_ids[row].tolist()
    env = Memory()
    env.reset(env_seed, task)
    for k in range(turns[start]):
        env.step(TOKENIZER.decode([t for t, j in zip(rollout.response_ids[row].tolist(), turns) if j == k],
                                  skip_special_tokens=True))
    prompt = rollout.prompt_ids[row][rollout.prompt_mask[row]].tolist()
    rewards, turn, done = [], turns[start], False
    while not done:
        generation = sampler(torch.tensor([prompt + tokens]), torch.ones(1, len(prompt + tokens), dtype=torch.bool),
                             [turn_seed(seed, turn)], OPTIONS.max_turn_tokens)
        action = generation.response_ids[0, :int(generation.response_mask[0].sum())].tolist()
        observation, reward, done, _, _ = env.step(TOKENIZER.decode(action, skip_special_tokens=True))
        tokens, rewards, turn = tokens + action, rewards + [reward], turn + 1
        if not done:
            tokens += encoder.reply(observation)
    return tokens, rewards


def test_continuations_from_turn_starts_equal_the_slow_reference(policy):
    rollout, tasks, env_seeds = _episodes(policy)
    rows, starts = _turn_starts(rollout)
    assert len(rows) == sum(tasks)
    prefixes = episode_prefixes(rollout, rows, starts, TOKENIZER, env_seeds, tasks)
    seeds = [100 + i for i in range(2 * len(rows))]
    continued = continue_episodes(Memory, _sampler(policy), TOKENIZER, prefixes, 2, seeds, options=OPTIONS,
                                  max_length=model_positions(policy))
    experience = types.SimpleNamespace(**vars(rollout), env_seeds=env_seeds)
    scores = EpisodeContinuations(experience, TOKENIZER, tasks, lambda p, k, s: continued, lambda r, t, j: 0,
                                  lambda x: x)(torch.tensor(rows), torch.tensor(starts), 2)
    for n, (row, start) in enumerate(zip(rows, starts)):
        assert continued.response_ids[2 * n, :start].tolist() == rollout.response_ids[row, :start].tolist()
        for j in range(2):
            tokens, rewards = _reference(policy, rollout, row, start, tasks[row], env_seeds[row], seeds[2 * n + j])
            real = continued.response_mask[2 * n + j]
            assert continued.response_ids[2 * n + j, real].tolist() == tokens
            turn = rollout.turn_ids[row, start]
            assert continued.turn_rewards[2 * n + j, turn:turn + len(rewards)].tolist() == rewards
            assert scores[n, j].item() == pytest.approx(sum(rewards))


def test_a_continuation_restores_the_environment_and_clones_it(policy):
    """Rewards that depend on every earlier action match the whole continued episode's actions; an environment
    with its own clone() is reset once per boundary, however many continuations."""
    for env in (Memory, CopiedMemory):
        rollout, tasks, env_seeds = _episodes(policy, env)
        rows, starts = _turn_starts(rollout)
        prefixes = episode_prefixes(rollout, rows, starts, TOKENIZER, env_seeds, tasks)
        Memory.resets = 0
        continued = continue_episodes(env, _sampler(policy), TOKENIZER, prefixes, 3, list(range(3 * len(rows))),
                                      options=OPTIONS, max_length=model_positions(policy))
        assert Memory.resets == (len(rows) if env is CopiedMemory else 3 * len(rows))
        for i in range(3 * len(rows)):
            row, ids, turns = rows[i // 3], continued.response_ids[i].tolist(), continued.turn_ids[i].tolist()
            lengths = [env_seeds[row] % 5]
            for k in range(int(continued.num_turns[i])):
                lengths.append(len(TOKENIZER.decode([t for t, j in zip(ids, turns) if j == k],
                                                    skip_special_tokens=True)))
                assert continued.turn_rewards[i, k].item() == float(sum(lengths) % 4) + 0.25 * (k + 1)


def test_a_boundary_inside_a_turn_is_refused(policy):
    rollout, tasks, env_seeds = _episodes(policy)
    with pytest.raises(ValueError, match="does not start a turn"):
        episode_prefixes(rollout, [0], [1], TOKENIZER, env_seeds, tasks)


def test_a_kept_segment_that_resumes_after_observations_is_valued_at_its_first_token_only():
    """keep_boundaries merges turns into one segment across observation tokens (-1): its first token is its only
    boundary (a single-turn row's segments are contiguous, so their boundaries are unchanged)."""
    asked = []

    def continue_and_score(rows, starts, k):
        asked.append(list(zip(rows.tolist(), starts.tolist())))
        return torch.ones(len(rows), k)

    segment_ids = torch.tensor([[0, 0, -1, -1, 0, 1, -1, 1], [0, 1, 1, 2, -1, -1, -1, -1]])
    assert mc_boundary_values(continue_and_score, segment_ids, 2).shape == (2, 3)
    assert asked == [[(0, 0), (0, 5), (1, 0), (1, 1), (1, 3)]]
