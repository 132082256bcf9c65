"""The environment seam: registry, names, dotted and file paths, options, clone by replay, the 20-line example."""

from __future__ import annotations

import dataclasses
import pathlib
import random

import pytest

from marlhf.config import option
from marlhf.envs import Env, check_observation, clone_env, get_env, make_env, register_env

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "guess_env.py"


@dataclasses.dataclass(frozen=True)
class CounterOptions:
    start: int = option(0, "the first count", ge=0)


@register_env("test_counter", options=CounterOptions)
class Counter(Env):
    """Counts its steps from `start`; draws its replies from the process-wide RNG (what deep copies lose)."""

    def __init__(self, options: CounterOptions) -> None:
        self.start = options.start

    def reset(self, seed, task=None):
        random.seed(seed)
        self.count = self.start
        return f"count {self.count}", {}

    def step(self, action_text):
        self.count += 1
        return f"count {self.count} {random.random():.6f} {action_text}", float(self.count), False, False, {}


def test_example_environment_fits_in_20_lines():
    lines = EXAMPLE.read_text().splitlines()
    assert len(lines) <= 20
    env = make_env(f"{EXAMPLE}:GuessNumber")
    observation, info = env.reset(3)
    assert observation.startswith("Guess") and info == {}
    target = random.Random(3).randint(1, 10)
    assert env.step(str(target % 10 + 1))[1:4] == (0.0, False, False)
    assert env.step(str(target)) == ("Right!", 1.0, True, False, {})


def test_names_dotted_paths_and_file_paths_give_the_same_class():
    assert get_env("test_counter").obj is Counter
    assert get_env("tests.envs.test_base:Counter").obj is Counter
    by_file = get_env(f"{EXAMPLE}:GuessNumber").obj
    assert by_file is get_env(f"{EXAMPLE}:GuessNumber").obj  # the file is loaded once
    with pytest.raises(ValueError, match="env must be one of"):
        get_env("no_such_env")
    with pytest.raises(ValueError, match="cannot import it"):
        get_env("tests/fixtures/missing.py:Env")


def test_options_are_typed_and_checked():
    assert make_env("test_counter", {"start": 5}).start == 5
    assert make_env("test_counter").start == 0
    with pytest.raises(ValueError, match="has no option 'stop'"):
        make_env("test_counter", {"stop": 1})
    with pytest.raises(ValueError, match=">= 0"):
        make_env("test_counter", {"start": -1})


def test_clone_replays_seed_task_and_actions_with_the_process_wide_rng():
    env = make_env("test_counter", {"start": 2})
    env.reset(7)
    env.step("a")
    expected = env.step("b")  # drawn from the process-wide RNG, in the state that seed 7 and one step left
    env = make_env("test_counter", {"start": 2})
    env.reset(7)
    env.step("a")
    random.seed(123)  # a deep copy would now draw from this state; the clone replays its own draws
    clone = clone_env(env)
    assert clone is not env and clone.count == env.count == 3 and clone.start == 2
    assert clone.step("b") == expected
    assert clone._history[2] == ["a", "b"] and env._history[2] == ["a"]


def test_a_subclass_calling_its_parents_step_records_the_action_once():
    class Louder(Counter):
        def step(self, action_text):
            return super().step(action_text.upper())

    env = Louder(CounterOptions())
    env.reset(0)
    env.step("x")
    assert env._history[2] == ["x"]
    assert env.clone().count == 1


def test_clone_needs_env_or_a_clone_method():
    class Plain:
        def reset(self, seed, task=None):
            return "", {}

    with pytest.raises(ValueError, match="cannot be cloned"):
        clone_env(Plain())


@pytest.mark.parametrize("observation,problem", [
    ("text", None), ([{"role": "user", "content": "hi"}], None), ([], None),
    (3, "a int"), (None, "a NoneType"), ([{"role": "user"}], "without string"), (["hi"], "without string"),
])
def test_check_observation(observation, problem):
    found = check_observation(observation)
    assert found == problem if problem is None else problem in found
