"""`relay`: the demo's multi-turn task, in the demo's word language (marlhf.demo.task; definition in
marlhf/demo/README.md, "Multi-turn task: relay"). Importing this module registers it as the environment `relay`
(marlhf.envs); it is also `marlhf.demo.env:RelayEnv`.

An episode has `turns` policy turns (3 by default). The first observation is a demo prompt (8 words and `|`). The
environment reads the first word of each action: turn 0 is right when that word is bright; after turn k < turns - 1
the environment replies with one word and `|` (`relayed[k]`, drawn from the episode's seed among the task's
`relay_words` clue words, 4 by default as Task 4's clues), and turn k + 1 is right when its first word is that word.
Each right turn earns 1 / turns at that turn (0 otherwise), so the gold outcome, the episode's return, is the share
of right turns, in [0, 1]; the episode terminates after its last turn.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

from marlhf.config import option
from marlhf.demo.task import SEPARATOR, SyntheticTask, TaskConfig
from marlhf.envs import Env, register_env

__all__ = ["RelayEnv", "RelayOptions", "relay_demonstrations"]


@dataclasses.dataclass(frozen=True)
class RelayOptions:
    """The relay task's options (README.md, "Multi-turn task: relay")."""

    turns: int = option(3, "policy turns of an episode: one bright word, then each relayed word repeated", ge=2)
    task_seed: int = option(1234, "the demo task's seed (TaskConfig.seed): which lexicon and classes")
    relay_words: int | None = option(
        4, "how many lexicon words the environment relays from (the task's clue words; None: all 48)", ge=1, le=48)


@functools.lru_cache(maxsize=4)
def _task(seed: int, relay_words: int | None) -> SyntheticTask:
    return SyntheticTask(TaskConfig(seed=seed, clue_words=relay_words))


@register_env("relay", options=RelayOptions)
class RelayEnv(Env):
    """The relay task (module docstring). `task`: a prompt record {"prompt"} or its text; None draws the prompt
    from the episode's seed."""

    def __init__(self, options: RelayOptions | None = None) -> None:
        self.options = options or RelayOptions()
        self.task = _task(self.options.task_seed, self.options.relay_words)

    def reset(self, seed: int, task: Any = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(f"relay-{self.options.task_seed}-{seed}")
        self.relayed = [rng.choice(self.task.clue_words) for _ in range(self.options.turns - 1)]
        self.turn = 0
        if task is None:
            task = self.task.prompts(1, seed)[0]
        return task["prompt"] if isinstance(task, dict) else str(task), {"relayed": list(self.relayed)}

    def right_word(self, turn: int) -> str | None:
        """The word turn `turn` should start with (None for turn 0, where any bright word is right)."""
        return None if turn == 0 else self.relayed[turn - 1]

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        words = action_text.split()
        first = words[0] if words else ""
        wanted = self.right_word(self.turn)
        right = self.task.word_class.get(first) == "bright" if wanted is None else first == wanted
        self.turn += 1
        done = self.turn >= self.options.turns
        reply = "" if done else f"{self.relayed[self.turn - 1]} {SEPARATOR}"
        return reply, (1.0 / self.options.turns) if right else 0.0, done, False, {"right": right}


ACTION_WORDS = 3  # words of a demonstrated turn: the first is what the environment reads, the others filler


def relay_demonstrations(options: RelayOptions, episodes: int, seed: int, right_rate: float,
                         eos: str) -> list[dict[str, str]]:
    """SFT records {"prompt", "response"}, one per turn of `episodes` demonstration episodes of the relay task: the
    prompt is the episode so far as the multi-turn rollout encodes it without a chat template (each action followed
    by `eos`, the tokenizer's EOS text, then the reply; the separating newlines are dropped by the demo tokenizer), the
    response ACTION_WORDS words whose first is right (a bright word at turn 0, the relayed word later) with chance
    `right_rate`, else a word drawn uniformly from the lexicon. Imperfect on purpose: the policy starts from a model
    that sometimes reads the reply, and training has to make it do so every time."""
    env = RelayEnv(options)
    rng = random.Random(f"relay-demonstrations-{options.task_seed}-{seed}")
    lexicon, bright = sorted(env.task.word_class), env.task.words_by_class["bright"]
    records = []
    for record in env.task.prompts(episodes, seed):
        context, _ = env.reset(rng.randrange(2**31), record)  # episode seeds of their own, unlike training's rows
        for turn in range(options.turns):
            right = rng.random() < right_rate
            wanted = env.right_word(turn)
            first = (rng.choice(bright) if wanted is None else wanted) if right else rng.choice(lexicon)
            action = " ".join([first, *(rng.choice(lexicon) for _ in range(ACTION_WORDS - 1))])
            records.append({"prompt": context, "response": action})
            reply = env.step(action)[0]
            context = f"{context} {action}{eos} {reply}"
    return records
