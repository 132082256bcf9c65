"""reasoning-gym's procedural tasks as single-turn tasks: `reasoning_gym:NAME` (docs/envs.md#reasoning-gym).

A task's entries come from `reasoning_gym.create_dataset(NAME, seed=, size=, **config)`, deterministic by seed; the
prompt is one of the library's system prompts followed by the entry's question, and the reward is the library's
own scorer on the answer the library extracts (`extract_answer`: the last `<answer>...</answer>`). A scorer that
raises on a malformed answer (prime_factorization's does) scores 0 and is counted, never a crash.

Three uses, one set of options (`ReasoningGymOptions`):

    marlhf ppo --dataset 'reasoning_gym:chain_sum{size: 256, config: {min_terms: 2}}' \\
        --reward_fns marlhf.envs.reasoning_gym:score ...          # single turn: PPO, GRPO, RLOO
    make_env("reasoning_gym:chain_sum", {"seed": 0})             # an environment of one turn
    --reward_fns marlhf.envs.reasoning_gym:score marlhf.envs.reasoning_gym:scorer_errors --reward_weights 1 0
                                                                  # logs the share of raising scorers

Each record carries `reasoning_gym`, the reference of its entry (dataset, seed, size, config, index), from which the
reward rebuilds the entry (its metadata included) instead of storing it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import yaml

from marlhf.config import option
from marlhf.envs.base import Env
from marlhf.envs.libraries import require
from marlhf.errors import did_you_mean
from marlhf.plugins import Plugin

__all__ = ["ReasoningGymOptions", "ReasoningGymEnv", "plugin", "available", "records", "load_generated", "score",
           "scorer_errors", "score_entry", "dataset_spec"]

HELD_OUT = 2**31  # the evaluation records' dataset seed is the run's seed plus this (mod 2**32): disjoint streams


@dataclasses.dataclass(frozen=True)
class ReasoningGymOptions:
    """A reasoning-gym task: which entries, and how they are asked."""

    size: int = option(1000, "entries of the dataset (its index runs over 0..size-1)", ge=1)
    seed: int | None = option(None, "the dataset's seed (none: the run's seed; an environment's: 0)", ge=0)
    config: dict[str, Any] | None = option(
        None, "the generator's own options (its config dataclass's fields), e.g. '{min_terms: 2}'")
    system_prompt: str = option("default", "one of reasoning_gym.utils.SYSTEM_PROMPTS, or 'none'")


def available() -> list[str]:
    """The names of the installed library's tasks."""
    return sorted(require("reasoning_gym").factory.DATASETS)


@functools.lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    """The library's dataset (cached: the reward rebuilds it for every batch); a ValueError for an unknown name or
    an option its config refuses."""
    reasoning_gym = require("reasoning_gym")
    names = available()
    if name not in names:
        raise ValueError(f"reasoning_gym has no task {name!r}{did_you_mean(name, names)}; `marlhf envs` lists them")
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"reasoning_gym:{name}: its options are refused: {error}") from None


def dataset(name: str, seed: int, size: int, config: dict[str, Any] | None) -> Any:
    return _dataset(name, seed, size, json.dumps(config or {}, sort_keys=True))


def _system_prompt(name: str) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name == "none":
        return ""
    if name not in SYSTEM_PROMPTS:
        raise ValueError(f"reasoning_gym system_prompt must be 'none' or one of {sorted(SYSTEM_PROMPTS)}, got {name!r}")
    return SYSTEM_PROMPTS[name]


def prompt_of(entry: dict[str, Any], system_prompt: str) -> str:
    """The text the policy sees: the system prompt (if any), then the question."""
    system = _system_prompt(system_prompt)
    return f"{system}\n{entry['question']}\n" if system else f"{entry['question']}\n"


def score_entry(completion: str, entry: dict[str, Any], data: Any) -> tuple[float, bool]:
    """(score, scorer_failed): the library's score of the answer it extracts from `completion`; 0 and True when its
    scorer raises or returns no finite number."""
    from reasoning_gym.utils import extract_answer

    try:
        value = float(data.score_answer(extract_answer(completion), entry))
    except Exception:  # noqa: BLE001 - a scorer's exception on a malformed answer is the answer's fault: 0
        return 0.0, True
    return (value, False) if math.isfinite(value) else (0.0, True)


def _entry_of(reference: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    data = dataset(reference["dataset"], reference["seed"], reference["size"], reference["config"])
    return data[reference["index"]], data


def _scores(completions: list[str], references: list[dict[str, Any]]) -> list[tuple[float, bool]]:
    if references is None or any(not isinstance(r, dict) for r in references):
        raise ValueError("reasoning_gym rewards need the records' 'reasoning_gym' field: train on --dataset "
                         "reasoning_gym:NAME")
    return [score_entry(completion, *_entry_of(reference)) for completion, reference in zip(completions, references)]


def score(prompts: list[str], completions: list[str], reasoning_gym: list[dict[str, Any]] | None = None,
          **_: Any) -> list[float]:
    """Reward function (TRL's convention, `--reward_fns marlhf.envs.reasoning_gym:score`): the library's score of
    each completion's answer; 0 where its scorer raises."""
    return [value for value, _ in _scores(completions, reasoning_gym)]


def scorer_errors(prompts: list[str], completions: list[str], reasoning_gym: list[dict[str, Any]] | None = None,
                  **_: Any) -> list[float]:
    """1 where the library's scorer raised on a completion, else 0: with weight 0 beside `score`, logged as
    rewards/scorer_errors (the share of responses whose scoring failed)."""
    return [float(failed) for _, failed in _scores(completions, reasoning_gym)]


def dataset_spec(spec: str) -> tuple[str, ReasoningGymOptions]:
    """`NAME` or `NAME{yaml mapping of ReasoningGymOptions}` (the part after `reasoning_gym:`)."""
    name, brace, rest = spec.partition("{")
    values: Any = {}
    if brace:
        try:
            values = yaml.safe_load("{" + rest)
        except yaml.YAMLError as error:
            raise ValueError(f"reasoning_gym:{spec}: the options after the name are not a YAML mapping "
                             f"({str(error).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise ValueError(f"reasoning_gym:{spec}: the options after the name must be a mapping such as "
                             f"'{{size: 256, config: {{min_terms: 2}}}}'")
    return name.strip(), plugin(name.strip()).make_options(values)


def records(spec: str, stage: str, seed: int) -> list[dict[str, Any]]:
    """The records of `reasoning_gym:SPEC` for `stage`: rl and eval records with the
    prompt, the reference `answer` and the entry's `reasoning_gym` reference; the eval records come from a held-out
    seed (the dataset seed plus 2**31). Other stages have no records (reasoning-gym has no responses to imitate)."""
    if stage not in ("rl", "eval"):
        raise ValueError(f"reasoning_gym datasets have rl and eval records only (no responses to learn from), "
                         f"not {stage!r}")
    name, options = dataset_spec(spec)
    base = seed if options.seed is None else options.seed
    dataset_seed = (base + HELD_OUT) % 2**32 if stage == "eval" else base
    data = dataset(name, dataset_seed, options.size, options.config)
    reference = {"dataset": name, "seed": dataset_seed, "size": options.size, "config": options.config}
    return [{"prompt": prompt_of(entry, options.system_prompt), "answer": str(entry["answer"]),
             "reasoning_gym": {**reference, "index": index}} for index, entry in enumerate(data)]


def load_generated(dataset: str, stage: str, *, seed: int, max_samples: int | None = None) -> list[dict[str, Any]]:
    """The records of `--dataset reasoning_gym:SPEC` for `stage` (what the trainers read in place of
    marlhf.data.load_records), `max_samples` of them drawn with `seed` as load_records draws."""
    from marlhf.data.records import subsample

    return subsample(records(dataset.removeprefix("reasoning_gym:"), stage, seed), max_samples, seed)


class ReasoningGymEnv(Env):
    """One reasoning-gym entry as an episode of one turn: the prompt, then the library's score of the answer.

    `reset(seed, task)`: `task` a record of `records` (its entry), or None for entry `seed mod size` of the dataset
    seeded by the options' seed (0 when unset)."""

    def __init__(self, name: str, options: ReasoningGymOptions | None = None) -> None:
        self.name, self.options = name, options or ReasoningGymOptions()
        dataset(name, self.options.seed or 0, self.options.size, self.options.config)  # a bad option stops here
        self.entry: dict[str, Any] | None = None
        self.data: Any = None

    def reset(self, seed: int, task: Any = None) -> tuple[str, dict[str, Any]]:
        if isinstance(task, dict) and isinstance(task.get("reasoning_gym"), dict):
            self.entry, self.data = _entry_of(task["reasoning_gym"])
        elif task is None:
            self.data = dataset(self.name, self.options.seed or 0, self.options.size, self.options.config)
            self.entry = self.data[seed % self.options.size]
        else:
            raise ValueError(f"reasoning_gym:{self.name}: a task must be None or a record of the dataset "
                             f"reasoning_gym:{self.name} (with its 'reasoning_gym' field), got {task!r:.60}")
        return prompt_of(self.entry, self.options.system_prompt), {"answer": self.entry["answer"]}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.entry is None:
            raise RuntimeError("ReasoningGymEnv.step was called before reset")
        value, failed = score_entry(action_text, self.entry, self.data)
        return "", value, True, False, {"scorer_error": failed, "success": value >= 1.0}


def plugin(name: str) -> Plugin:
    """The environment plug-in of `reasoning_gym:NAME` (made as `ReasoningGymEnv(NAME, options)`)."""
    names = available()
    if name not in names:
        raise ValueError(f"reasoning_gym has no task {name!r}{did_you_mean(name, names)}; `marlhf envs` lists them")
    return Plugin("environment", f"reasoning_gym:{name}", functools.partial(ReasoningGymEnv, name),
                  ReasoningGymOptions, {})
