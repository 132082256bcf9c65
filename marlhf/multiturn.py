"""Multi-turn rollouts: episodes of environments (marlhf.envs) against a rollout engine, one row per episode.

    rollout = rollout_episodes(envs, EngineSampler(engine, temperature=1.0, ...), tokenizer, seeds=[...],
                               tasks=[...], options=MultiTurnOptions(max_turns=4), max_length=positions)

Each round generates the next turn of every live episode in one batched `generate` call (episodes at different
turns together), steps each episode's environment with its action's text, and appends the environment's reply as
observation tokens. The policy's sampled token ids are kept exactly (the transcript is never re-tokenized); an
observation is encoded alone (`ObservationEncoder`: the chat template's delta for the new message when the tokenizer
has a template, the text between plain separators otherwise). Turn k of an episode with seed s is sampled with the
row seed `turn_seed(s, k)` (s itself for turn 0), and engines draw each row from its own seed (marlhf.engines), so
an episode's tokens do not depend on the other episodes of the batch: a batched run equals the episodes run one at a
time. The engine is only called through a sampler (`EngineSampler`), so any engine works, re-reading each episode's
context every round; a sampler whose engine offers `new_cache()` (the hf engine) continues one KV cache from round
to round instead (`_Layout`: rows keep their columns, with holes masked out), so a turn computes only its new
tokens.

The layout is docs/multiturn.md's: the prompt (the first observation) left-padded `[B, P]`; a response region
`[B, T]` of action tokens, observation tokens between turns, right padding; `action_mask` True on sampled tokens
only; `turn_ids` the turn of each action token (-1 elsewhere); each turn's reward on its last action token.

Limits and faults (docs/multiturn.md#faults): `max_turns` policy turns, `max_turn_tokens` per turn,
`max_response_tokens` per episode and `max_length` positions (prompt + response); a turn cut by the episode's
budget, or an observation that leaves no room for another action token, ends the episode truncated
(`env/context_overflow`); a step that raises or outlasts `step_timeout` ends it truncated
(`env/errors`, `env/timeouts`) or, with `env_errors="raise"`, stops the run; a reset that raises, an observation
that is neither text nor messages, a reward that is not a finite number, or a step that does not return five
values always stops the run, in one line naming the environment, the episode and the turn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from marlhf.config import check_bounds, option
from marlhf.data.encoding import pad_sequences
from marlhf.engines.base import Generation, RolloutEngine
from marlhf.envs import make_env
from marlhf.envs.base import Observation, check_observation
from marlhf.errors import MarlhfError

__all__ = ["MultiTurnOptions", "MultiTurnRollout", "ObservationEncoder", "Generate", "EngineSampler",
           "rollout_episodes", "turn_seed", "EpisodeSpec", "run_episodes", "concat_rollouts", "EpisodePrefix",
           "episode_prefixes", "continue_episodes"]

EnvErrors = Literal["truncate", "raise"]
# sampler(ids, mask, row_seeds, max_new_tokens) -> Generation with log-probs; one with `new_cache()` is also called
# with `cache=` (EngineSampler)
Generate = Callable[[torch.Tensor, torch.Tensor, list[int], int], Generation]


@dataclasses.dataclass(frozen=True)
class MultiTurnOptions:
    """The limits of a multi-turn rollout and what a failing environment does (docs/multiturn.md)."""

    max_turns: int = option(4, "most policy turns of an episode; one that reaches it ends truncated", ge=1)
    max_turn_tokens: int = option(64, "most tokens the policy writes in one turn (the turn ends there)", ge=1)
    max_response_tokens: int = option(
        512, "most tokens of an episode after its prompt (actions and observations); past it the episode is "
             "truncated", ge=1)
    step_timeout: float | None = option(
        None, "seconds one step may take (None: no limit); a step past it ends its episode as env_errors says",
        gt=0)
    env_errors: EnvErrors = option(
        "truncate", "a step that raises or times out: end that episode truncated (counted in env/errors, "
                    "env/timeouts) or stop the run")
    observation_separator: str = option(
        "\n", "without a chat template: the text put before and after each observation")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_bounds(f"multi-turn option {field.name!r}", getattr(self, field.name),
                         field.metadata.get("bounds", {}))
        if self.env_errors not in ("truncate", "raise"):
            raise ValueError(f"multi-turn option 'env_errors' must be 'truncate' or 'raise', got {self.env_errors!r}")


@dataclasses.dataclass
class MultiTurnRollout:
    """B episodes, one row each (docs/multiturn.md's layout; P prompt columns, T response columns, K = the most
    turns of an episode).

    prompt_ids: long [B, P] left-padded, the first observations; prompt_mask: bool [B, P]
    response_ids: long [B, T] right-padded with the pad id: actions and observations
    response_mask: bool [B, T], True on every real token (what a forward attends to)
    action_mask: bool [B, T], True exactly on the tokens the policy sampled
    turn_ids: long [B, T], the turn of each action token, -1 on observations and padding
    logprobs: float [B, T], the sampling log-probs of the action tokens (the engine's), 0 elsewhere
    rewards: float [B, T], turn k's reward on turn k's last action token, 0 elsewhere
    turn_rewards: float [B, K], 0 past an episode's turns
    turn_state_ids: long [B, K], the id of the observation the policy saw at the start of each turn (equal ids:
        equal observations, among this batch's episodes), -1 past an episode's turns; `states[id]` is its text
    num_turns: long [B]; terminated, truncated: bool [B] (the environment's flags, or truncated by a limit or fault)
    metrics: {"env/<name>": number}, the rollout's counts and times (docs/multiturn.md#metrics)
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    action_mask: torch.Tensor
    turn_ids: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    turn_rewards: torch.Tensor
    turn_state_ids: torch.Tensor
    num_turns: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    states: list[str]
    metrics: dict[str, float]

    def to(self, device: torch.device | str) -> MultiTurnRollout:
        return dataclasses.replace(self, **{field.name: getattr(self, field.name).to(device)
                                            for field in dataclasses.fields(self)
                                            if isinstance(getattr(self, field.name), torch.Tensor)})


def turn_seed(seed: int, turn: int) -> int:
    """The row seed of an episode's turn: the episode's seed for turn 0 (so a one-turn episode samples as a
    single-turn rollout of that seed), a 32-bit mix of (seed, turn) after."""
    if turn == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), turn]).generate_state(1)[0])


class EngineSampler:
    """`sampler(ids, mask, row_seeds, max_new_tokens, cache=None) -> Generation`: `engine.generate` with these
    sampling settings and the sampled tokens' log-probs (what `rollout_episodes` calls). `new_cache()`: a KV cache
    that a call fills and the next turn's call continues, when the engine has one (the hf engine with its dynamic
    cache: `HFEngine.new_cache`), else None."""

    def __init__(self, engine: RolloutEngine, *, temperature: float, top_k: int, top_p: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int) -> None:
        self.engine = engine
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                             pad_token_id=pad_token_id, return_logprobs=True)

    def new_cache(self) -> Any:
        make = getattr(self.engine, "new_cache", None)
        return make() if make is not None else None

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, row_seeds: list[int], max_new_tokens: int,
                 cache: Any = None) -> Generation:
        continued = {} if cache is None else {"past_key_values": cache}
        return self.engine.generate(ids, mask, row_seeds=row_seeds, max_new_tokens=max_new_tokens, **self.sampling,
                                    **continued)


class ObservationEncoder:
    """Token ids of observations, each encoded alone. With a chat template (`tokenizer.chat_template`): the first
    observation is the conversation so far with the generation prompt, a later one the text the template adds for
    the new messages after an assistant turn, with the next generation prompt (a text observation is one user
    message). Without one: the first observation's text with the tokenizer's special tokens, a later one the text
    between `separator`s, without them. Messages without a template are their contents joined by `separator`."""

    _BEFORE = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]

    def __init__(self, tokenizer: Any, separator: str = "\n") -> None:
        self.tokenizer = tokenizer
        self.separator = separator
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def _messages(self, observation: Observation) -> list[dict[str, str]]:
        return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)

    def first(self, observation: Observation) -> list[int]:
        if self.chat:
            text = self.tokenizer.apply_chat_template(self._messages(observation), tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(self._text(observation))["input_ids"]

    def reply(self, observation: Observation) -> list[int]:
        if not self.chat:
            text = self.separator + self._text(observation) + self.separator
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        before = self.tokenizer.apply_chat_template(self._BEFORE, tokenize=False)
        after = self.tokenizer.apply_chat_template(self._BEFORE + self._messages(observation), tokenize=False,
                                                   add_generation_prompt=True)
        if not after.startswith(before):
            raise MarlhfError("the tokenizer's chat template renders a conversation's start differently once a "
                              "message follows, so a new message cannot be encoded alone: use a template that "
                              "only appends")
        return self.tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]

    def _text(self, observation: Observation) -> str:
        return observation if isinstance(observation, str) else self.separator.join(
            message["content"] for message in observation)


def state_key(observation: Observation) -> str:
    """The text that identifies an observation as a state (its messages as JSON)."""
    return observation if isinstance(observation, str) else json.dumps(list(observation), sort_keys=True)


@dataclasses.dataclass
class _Episode:
    """One episode while it runs: its row's tokens so far, as host lists."""

    index: int
    env: Any
    seed: int
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    turn_of: list[int] = dataclasses.field(default_factory=list)  # each token's turn, -1 on observations
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    states: list[str] = dataclasses.field(default_factory=list)  # the observation before each turn
    round_start: int = 0  # where this round's action starts in `tokens`
    round_end: int = 0  # where it ends (and the reply, if one was appended, starts)
    done: bool = False
    terminated: bool = False
    truncated: bool = False

    @property
    def turn(self) -> int:
        """The turn the policy writes next (the number of turns stepped)."""
        return len(self.turn_rewards)


class _StepFault(Exception):
    """A step that raised or timed out; `kind` is the metric it counts in (errors, timeouts)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _call_step(env: Any, action_text: str, timeout: float | None) -> Any:
    """`env.step(action_text)`, in a daemon thread when there is a time limit (a step past it is abandoned there,
    never called again); a _StepFault when it raises or outlasts `timeout`."""
    if timeout is None:
        try:
            return env.step(action_text)
        except Exception as error:
            raise _StepFault("errors", f"{type(error).__name__}: {error}") from None
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = env.step(action_text)
        except Exception as error:
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="marlhf-env-step")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _StepFault("timeouts", f"took more than {timeout:g} s")
    if "result" not in box:
        error = box.get("error")
        raise _StepFault("errors", f"{type(error).__name__}: {error}" if error else "its thread died")
    return box["result"]


def _fitting_groups(contexts: list[int], caps: list[int], max_length: int | None) -> list[list[int]]:
    """Indices into the live episodes, in groups that one `generate` call may take: the group's longest context
    plus its largest cap (its call's max_new_tokens) within `max_length` positions. Longest contexts first."""
    order = sorted(range(len(contexts)), key=lambda i: (-contexts[i], i))
    if max_length is None:
        return [order]
    groups: list[list[int]] = []
    for i in order:
        if groups and contexts[groups[-1][0]] + max(caps[i], max(caps[j] for j in groups[-1])) <= max_length:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclasses.dataclass
class _Layout:
    """The live episodes' rows as the last continued `generate` call left them: `ids`, `mask` [n, W], the mask False
    on left padding and on holes (tokens sampled past a turn's end, padding before a shorter reply); `cache`, the
    engine's KV cache of every column but the last sampled one; `episodes`, each row's episode."""

    episodes: list[_Episode]
    ids: torch.Tensor
    mask: torch.Tensor
    cache: Any


class _Runner:
    """The rounds of one `rollout_episodes` call (its arguments, its episodes, its metrics)."""

    def __init__(self, generate: Generate, tokenizer: Any, options: MultiTurnOptions, max_length: int | None,
                 env_name: str | None, device: torch.device | str) -> None:
        self.generate, self.tokenizer, self.options, self.max_length = generate, tokenizer, options, max_length
        self.env_name, self.device = env_name, device
        self.encoder = ObservationEncoder(tokenizer, options.observation_separator)
        self.layout: _Layout | None = None
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    def where(self, episode: _Episode) -> str:
        name = self.env_name or type(episode.env).__name__
        return f"environment {name!r} at turn {episode.turn} of episode {episode.index}"

    def room(self, episode: _Episode) -> int:
        """The tokens the episode may still add: within max_response_tokens and max_length positions."""
        room = self.options.max_response_tokens - len(episode.tokens)
        if self.max_length is not None:
            room = min(room, self.max_length - len(episode.prompt) - len(episode.tokens))
        return room

    def start(self, index: int, env: Any, seed: int, env_seed: int, task: Any) -> _Episode:
        episode = _Episode(index, env, int(seed), [])
        try:
            observation, _ = env.reset(int(env_seed), task)
        except Exception as error:
            raise MarlhfError(f"{self.where(episode)}: reset raised {type(error).__name__}: {error}") from None
        self.check(episode, observation)
        episode.prompt = self.encoder.first(observation)
        episode.states.append(state_key(observation))
        if self.room(episode) < 1:
            raise MarlhfError(f"{self.where(episode)}: the first observation has {len(episode.prompt)} tokens, "
                              f"which leaves no room in max_length {self.max_length}: shorten it or raise max_length")
        return episode

    def resume(self, index: int, env: Any, seed: int, prefix: EpisodePrefix, states: list[str]) -> _Episode:
        """An episode that goes on from `prefix` (its tokens kept as they are), `env` already in the prefix's state
        and `states` the observations before its turns so far."""
        return _Episode(index, env, int(seed), list(prefix.prompt), list(prefix.tokens), list(prefix.turn_of),
                        [0.0] * len(prefix.tokens), list(prefix.turn_rewards), list(states))

    def check(self, episode: _Episode, observation: Any) -> None:
        problem = check_observation(observation)
        if problem is not None:
            raise MarlhfError(f"{self.where(episode)}: the observation is {problem}, not text or a list of "
                              "{'role', 'content'} messages")

    def act(self, live: list[_Episode]) -> list[str]:
        """One round's generation: the next turn of every live episode, in as few `generate` calls as fit the
        positions (one when they all fit: then continuing the last round's KV cache where the engine has one); each
        action appended to its row. Returns the actions' texts, in the order of `live`."""
        caps = [min(self.options.max_turn_tokens, self.room(episode)) for episode in live]
        contexts = [len(episode.prompt) + len(episode.tokens) for episode in live]
        groups = _fitting_groups(contexts, caps, self.max_length)
        if len(groups) == 1 and callable(getattr(self.generate, "new_cache", None)):
            return self.act_continuing(live, caps)
        self.layout = None
        texts = [""] * len(live)
        for group in groups:
            ids, mask = pad_sequences([live[i].prompt + live[i].tokens for i in group],
                                      self.tokenizer.pad_token_id, "left")
            generation = self.call([live[i] for i in group], ids.to(self.device), mask.bool().to(self.device),
                                   max(caps[i] for i in group))
            for row, i in enumerate(group):
                texts[i] = self.take(live[i], generation, row, caps[i])
        return texts

    def act_continuing(self, live: list[_Episode], caps: list[int]) -> list[str]:
        """`act` in one call that continues the KV cache of the last round's (`_Layout`), or starts one."""
        layout = self.layout
        if layout is None or [episode.index for episode in layout.episodes] != [episode.index for episode in live]:
            ids, mask = pad_sequences([episode.prompt + episode.tokens for episode in live],
                                      self.tokenizer.pad_token_id, "left")
            layout = _Layout(live, ids.to(self.device), mask.bool().to(self.device), self.generate.new_cache())
        generation = self.call(live, layout.ids, layout.mask, max(caps), layout.cache)
        texts = [self.take(episode, generation, row, cap) for row, (episode, cap) in enumerate(zip(live, caps))]
        kept = torch.tensor([len(episode.tokens) - episode.round_start for episode in live], device=self.device)
        width = generation.response_ids.shape[1]
        layout.ids = torch.cat([layout.ids, generation.response_ids], dim=1)
        layout.mask = torch.cat([layout.mask, torch.arange(width, device=self.device)[None, :] < kept[:, None]], 1)
        self.layout = layout if layout.cache is not None else None
        return texts

    def call(self, episodes: list[_Episode], ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
             cache: Any = None) -> Generation:
        """One `generate` call for these episodes' next turns (timed, counted, its log-probs checked)."""
        seeds = [turn_seed(episode.seed, episode.turn) for episode in episodes]
        started = time.perf_counter()
        continued = {} if cache is None else {"cache": cache}
        generation = self.generate(ids, mask, seeds, max_new_tokens, **continued)
        self.seconds["generate"] += time.perf_counter() - started
        self.counts["generate_calls"] += 1
        if generation.logprobs is None:
            raise ValueError("the multi-turn rollout needs the sampled tokens' log-probs: generate with "
                             "return_logprobs=True (EngineSampler does)")
        return generation

    def take(self, episode: _Episode, generation: Generation, row: int, cap: int) -> str:
        """Append row `row` of `generation`, cut at `cap` tokens, to the episode as its turn's action; its text."""
        length = min(int(generation.response_mask[row].sum()), cap)
        action = generation.response_ids[row, :length].tolist()
        episode.round_start = len(episode.tokens)
        episode.tokens += action
        episode.turn_of += [episode.turn] * length
        episode.logprobs += generation.logprobs[row, :length].float().tolist()
        return self.tokenizer.decode(action, skip_special_tokens=True)

    def advance(self) -> None:
        """After a round's steps: the continued layout without the episodes that ended, with the others' replies
        right-aligned before the next turn, since the next call reads each row's last column. A row with an empty
        reply moves its last real token there (masked where it was: the moved copy gets its position, and its keys
        and values are computed again)."""
        layout = self.layout
        keep = [row for row, episode in enumerate(layout.episodes) if not episode.done] if layout else []
        if not keep:
            self.layout = None
            return
        mask = layout.mask.clone()
        last_columns = (mask.shape[1] - 1 - mask.flip(1).int().argmax(1)).tolist()
        tails = []
        for row in keep:
            episode = layout.episodes[row]
            tails.append(episode.tokens[episode.round_end:])
            if not tails[-1]:
                tails[-1] = [int(layout.ids[row, last_columns[row]])]
                mask[row, last_columns[row]] = False
        width = max(len(tail) for tail in tails)
        block = torch.full((len(keep), width), self.tokenizer.pad_token_id, dtype=torch.long)
        for row, tail in enumerate(tails):
            block[row, width - len(tail):] = torch.tensor(tail, dtype=torch.long)
        filled = torch.arange(width)[None, :] >= torch.tensor([width - len(tail) for tail in tails])[:, None]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        if len(keep) < len(layout.episodes):
            layout.cache.batch_select_indices(index)
        layout.ids = torch.cat([layout.ids[index], block.to(self.device)], dim=1)
        layout.mask = torch.cat([mask[index], filled.to(self.device)], dim=1)
        layout.episodes = [layout.episodes[row] for row in keep]

    def step(self, episode: _Episode, action_text: str) -> None:
        """Step the episode's environment with its turn's action, credit the reward, and end the episode or append
        the reply (module docstring: limits and faults)."""
        episode.round_end = len(episode.tokens)
        started = time.perf_counter()
        try:
            result = _call_step(episode.env, action_text, self.options.step_timeout)
        except _StepFault as fault:
            self.seconds["step"] += time.perf_counter() - started
            if self.options.env_errors == "raise":
                raise MarlhfError(f"{self.where(episode)}: step failed: {fault} (env_errors: truncate ends "
                                  "such an episode instead)") from None
            self.counts[fault.kind] += 1
            episode.turn_rewards.append(0.0)
            self.end(episode, truncated=True)
            return
        self.seconds["step"] += time.perf_counter() - started
        observation, reward, terminated, truncated = self.checked(episode, result)
        episode.turn_rewards.append(reward)
        if terminated or truncated:
            self.end(episode, truncated=truncated, terminated=terminated)
        elif episode.turn >= self.options.max_turns:
            self.counts["turn_limit"] += 1
            self.end(episode, truncated=True)
        else:
            reply = self.encoder.reply(observation)
            if self.room(episode) - len(reply) < 1:
                self.counts["context_overflow"] += 1
                self.end(episode, truncated=True)
                return
            episode.tokens += reply
            episode.turn_of += [-1] * len(reply)
            episode.logprobs += [0.0] * len(reply)
            episode.states.append(state_key(observation))

    def checked(self, episode: _Episode, result: Any) -> tuple[Observation, float, bool, bool]:
        """(observation, reward, terminated, truncated) of a step's result, or a MarlhfError naming the fault."""
        if not isinstance(result, tuple) or len(result) != 5:
            raise MarlhfError(f"{self.where(episode)}: step returned {type(result).__name__} {result!r:.40}, not "
                              "(observation, reward, terminated, truncated, info)")
        observation, reward, terminated, truncated, _ = result
        self.check(episode, observation)
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise MarlhfError(f"{self.where(episode)}: the reward {reward!r:.40} is not a finite number")
        return observation, float(reward), bool(terminated), bool(truncated)

    def end(self, episode: _Episode, *, truncated: bool, terminated: bool = False) -> None:
        episode.done, episode.terminated, episode.truncated = True, terminated, truncated and not terminated

    def batch(self, episodes: list[_Episode]) -> MultiTurnRollout:
        """The episodes as one MultiTurnRollout (the layout of docs/multiturn.md)."""
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = pad_sequences([e.prompt for e in episodes], pad, "left")
        response_ids, response_mask = pad_sequences([e.tokens for e in episodes], pad, "right")
        turn_ids, _ = pad_sequences([e.turn_of for e in episodes], -1, "right")
        logprobs = torch.zeros(response_ids.shape)
        rewards = torch.zeros(response_ids.shape)
        most_turns = max(e.turn for e in episodes)
        turn_rewards = torch.zeros(len(episodes), most_turns)
        turn_state_ids = torch.full((len(episodes), most_turns), -1, dtype=torch.long)
        state_ids: dict[str, int] = {}
        for row, episode in enumerate(episodes):
            logprobs[row, :len(episode.logprobs)] = torch.tensor(episode.logprobs)
            last_tokens = {turn: position for position, turn in enumerate(episode.turn_of) if turn >= 0}
            for turn, reward in enumerate(episode.turn_rewards):
                rewards[row, last_tokens[turn]] = reward
                turn_rewards[row, turn] = reward
            for turn, state in enumerate(episode.states[:episode.turn]):
                turn_state_ids[row, turn] = state_ids.setdefault(state, len(state_ids))
        rollout = MultiTurnRollout(
            prompt_ids, prompt_mask.bool(), response_ids, response_mask.bool(), turn_ids >= 0, turn_ids, logprobs,
            rewards, turn_rewards, turn_state_ids, torch.tensor([e.turn for e in episodes]),
            torch.tensor([e.terminated for e in episodes]), torch.tensor([e.truncated for e in episodes]),
            list(state_ids), self.metrics(episodes))
        return rollout.to(self.device)

    def metrics(self, episodes: list[_Episode]) -> dict[str, float]:
        actions = sum(turn >= 0 for e in episodes for turn in e.turn_of)
        return {"env/episodes": float(len(episodes)),
                "env/turns": sum(e.turn for e in episodes) / len(episodes),
                "env/terminated": float(sum(e.terminated for e in episodes)),
                "env/truncated": float(sum(e.truncated for e in episodes)),
                **{f"env/{kind}": float(self.counts[kind])
                   for kind in ("turn_limit", "context_overflow", "errors", "timeouts", "generate_calls")},
                "env/action_tokens": float(actions),
                "env/observation_tokens": float(sum(len(e.tokens) for e in episodes) - actions),
                "env/step_seconds": self.seconds["step"], "env/generate_seconds": self.seconds["generate"]}


def rollout_episodes(envs: Sequence[Any], generate: Generate, tokenizer: Any, *, seeds: Sequence[int],
                     env_seeds: Sequence[int] | None = None, tasks: Sequence[Any] | None = None,
                     options: MultiTurnOptions | None = None,
                     max_length: int | None = None, env_name: str | None = None,
                     device: torch.device | str = "cpu") -> MultiTurnRollout:
    """Run one episode per environment (fresh instances, one each) to its end, all in the same rounds: reset env b
    with `env_seeds[b]` (default `seeds[b]`) and `tasks[b]` (None without tasks), sample its turns from `seeds[b]`
    (`turn_seed`), then each round generate every live episode's next turn
    together and step each environment (module docstring). `generate(ids, mask, row_seeds, max_new_tokens)`
    samples each row from its seed and returns its log-probs (`EngineSampler`); `max_length`: the most positions
    of prompt + response (the model's, `marlhf.engines.model_positions`, or the run's context; None: no limit but
    `options.max_response_tokens`); `env_name` names the environment in errors (default: its class name);
    `device`: where the engine's inputs and the returned tensors go."""
    options = options or MultiTurnOptions()
    env_seeds = seeds if env_seeds is None else env_seeds
    if len(seeds) != len(envs) or len(env_seeds) != len(envs) or (tasks is not None and len(tasks) != len(envs)):
        raise ValueError(f"rollout_episodes: {len(envs)} environments need as many seeds (got {len(seeds)}), "
                         f"env_seeds (got {len(env_seeds)}) and tasks (got {'none' if tasks is None else len(tasks)})")
    if not envs:
        raise ValueError("rollout_episodes needs at least one environment")
    runner = _Runner(generate, tokenizer, options, max_length, env_name, device)
    episodes = [runner.start(index, env, seed, env_seed, None if tasks is None else tasks[index])
                for index, (env, seed, env_seed) in enumerate(zip(envs, seeds, env_seeds))]
    return _play(runner, episodes)


def _play(runner: _Runner, episodes: list[_Episode]) -> MultiTurnRollout:
    """The rounds: every live episode's next turn generated together, each environment stepped, to the end."""
    while live := [episode for episode in episodes if not episode.done]:
        for episode, action_text in zip(live, runner.act(live)):
            runner.step(episode, action_text)
        runner.advance()
    return runner.batch(episodes)


@dataclasses.dataclass(frozen=True)
class EpisodePrefix:
    """An episode up to the start of one of its turns, to continue (`continue_episodes`): its environment's reset
    seed and task; its prompt and response tokens before the turn, kept exactly; each token's turn (-1 on
    observations); the completed turns' action texts (what the environment was stepped with) and rewards."""

    env_seed: int
    task: Any
    prompt: list[int]
    tokens: list[int]
    turn_of: list[int]
    actions: list[str]
    turn_rewards: list[float]


def episode_prefixes(rollout: Any, rows: Sequence[int], starts: Sequence[int], tokenizer: Any,
                     env_seeds: Sequence[int], tasks: Sequence[Any]) -> list[EpisodePrefix]:
    """Episode `rows[n]` of `rollout` (a MultiTurnRollout, or an Experience of episodes: the same prompt_ids,
    prompt_mask, response_ids, turn_ids and turn_rewards) up to response token `starts[n]`, which must start a turn
    (the first action token of turn k: the prefix holds turns 0..k-1 and the observation after them); `env_seeds`,
    `tasks`: each row's (those its episode was reset with)."""
    prefixes = []
    for row, start in zip(rows, starts):
        turns = rollout.turn_ids[row].tolist()
        if start >= len(turns) or turns[start] < 0 or (start > 0 and turns[start - 1] == turns[start]):
            raise ValueError(f"episode {row}: response token {start} does not start a turn; multi-turn Monte-Carlo "
                             "continuations start at turn starts only (termination 'turn')")
        tokens = rollout.response_ids[row].tolist()
        # the texts the environment was stepped with: each turn's action tokens decoded as the rollout decoded them
        actions = [tokenizer.decode([t for t, k in zip(tokens, turns) if k == turn], skip_special_tokens=True)
                   for turn in range(turns[start])]
        prefixes.append(EpisodePrefix(int(env_seeds[row]), tasks[row],
                                      rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist(), tokens[:start],
                                      turns[:start], actions, rollout.turn_rewards[row, :turns[start]].tolist()))
    return prefixes


def _restored_envs(make: Callable[[], Any], prefix: EpisodePrefix, k: int) -> tuple[list[Any], list[str]]:
    """`k` environments in the state at the prefix's end, and the observations before its turns (state keys): one
    reset with the prefix's seed and task and stepped with its actions, the others its clones (`clone()`; replayed
    again where the environment has none)."""
    env = make()
    observation, _ = env.reset(prefix.env_seed, prefix.task)
    states = [state_key(observation)]
    for action in prefix.actions:
        states.append(state_key(env.step(action)[0]))
    clone = getattr(env, "clone", None)
    others = [clone() if callable(clone) else _restored_envs(make, prefix, 1)[0][0] for _ in range(k - 1)]
    return [env, *others], states


def continue_episodes(make: Callable[[], Any], generate: Generate, tokenizer: Any, prefixes: Sequence[EpisodePrefix],
                      k: int, seeds: Sequence[int], *, options: MultiTurnOptions | None = None,
                      max_length: int | None = None, env_name: str | None = None,
                      device: torch.device | str = "cpu") -> MultiTurnRollout:
    """`k` continuations of each prefix's episode to its end, all in the same rounds (`rollout_episodes`'s, with
    its limits): row n * k + j, continuation j of prefix n, has an environment made by `make` and restored to the
    prefix's state (`_restored_envs`), keeps the prefix's tokens and samples its turns from `seeds[n * k + j]`
    (`turn_seed(seed, turn)` for turn k on). Its rows hold the whole episodes, prefix included; their
    `turn_rewards` the prefix's turns' rewards, then the continuation's."""
    if len(seeds) != len(prefixes) * k:
        raise ValueError(f"continue_episodes: {len(prefixes)} prefixes x k={k} need as many seeds, got {len(seeds)}")
    runner = _Runner(generate, tokenizer, options or MultiTurnOptions(), max_length, env_name, device)
    episodes = []
    for n, prefix in enumerate(prefixes):
        envs, states = _restored_envs(make, prefix, k)
        episodes += [runner.resume(n * k + j, env, seeds[n * k + j], prefix, states) for j, env in enumerate(envs)]
    return _play(runner, episodes)


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """What runs a batch of episodes besides the engine, all picklable, so that a rollout worker gets it with a
    request and makes its environments itself: the environment as `make_env` names it and its options, the
    tokenizer, the limits, the positions (`max_length`) and the engine's sampling settings (EngineSampler's)."""

    env: str
    env_options: dict[str, Any] | None
    tokenizer: Any
    options: MultiTurnOptions
    max_length: int | None
    sampling: dict[str, Any]


def run_episodes(engine: RolloutEngine, spec: EpisodeSpec, seeds: Sequence[int], env_seeds: Sequence[int] | None,
                 tasks: Sequence[Any] | None, device: torch.device | str = "cpu") -> MultiTurnRollout:
    """One episode per seed, each of a fresh environment made from `spec`, on `engine` (`rollout_episodes`): what
    the trainer's process and a rollout worker run for a step's rows."""
    envs = [make_env(spec.env, spec.env_options) for _ in seeds]
    return rollout_episodes(envs, EngineSampler(engine, **spec.sampling), spec.tokenizer, seeds=seeds,
                            env_seeds=env_seeds, tasks=tasks, options=spec.options, max_length=spec.max_length,
                            env_name=spec.env, device=device)


# how each [B, ...] field of a MultiTurnRollout is padded: the side and the fill (None: the pad id)
_PADDING = {"prompt_ids": ("left", None), "prompt_mask": ("left", False), "response_ids": ("right", None),
            "response_mask": ("right", False), "action_mask": ("right", False), "turn_ids": ("right", -1),
            "logprobs": ("right", 0.0), "rewards": ("right", 0.0), "turn_rewards": ("right", 0.0),
            "turn_state_ids": ("right", -1)}


def concat_rollouts(rollouts: Sequence[MultiTurnRollout], pad_token_id: int) -> MultiTurnRollout:
    """The episodes of several rollouts as one, rows in order (the shares of a step's rows that rollout workers
    ran): each field padded to the widest (`_PADDING`), the states numbered as one rollout of all the rows numbers
    them (in order of first appearance, row by row), the metrics' counts and times summed, `env/turns` the mean
    over all episodes."""
    if len(rollouts) == 1:
        return rollouts[0]
    numbers: dict[str, int] = {}
    renumbered = []
    for rollout in rollouts:
        ids = rollout.turn_state_ids
        for i in ids.flatten().tolist():
            if i >= 0:
                numbers.setdefault(rollout.states[i], len(numbers))
        lookup = torch.tensor([numbers[state] for state in rollout.states] or [-1], device=ids.device)
        renumbered.append(dataclasses.replace(rollout, turn_state_ids=torch.where(ids >= 0, lookup[ids.clamp(0)], -1)))
    fields: dict[str, Any] = {}
    for name, (side, fill) in _PADDING.items():
        parts = [getattr(rollout, name) for rollout in renumbered]
        width = max(part.shape[1] for part in parts)
        fields[name] = torch.cat([torch.nn.functional.pad(
            part, (width - part.shape[1], 0) if side == "left" else (0, width - part.shape[1]),
            value=pad_token_id if fill is None else fill) for part in parts])
    for name in ("num_turns", "terminated", "truncated"):
        fields[name] = torch.cat([getattr(rollout, name) for rollout in rollouts])
    metrics = {name: sum(rollout.metrics[name] for rollout in rollouts) for name in rollouts[0].metrics}
    metrics["env/turns"] = int(fields["num_turns"].sum()) / len(fields["num_turns"])
    return MultiTurnRollout(**fields, states=list(numbers), metrics=metrics)
