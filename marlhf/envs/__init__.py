"""Multi-turn environments: what answers the policy between its turns (a game, a tool, a simulated user).

An environment is Gymnasium-shaped and speaks text (`base.py`, `Env`):

    observation, info = env.reset(seed, task)          # the first observation: the episode's prompt
    observation, reward, terminated, truncated, info = env.step(action_text)   # after each policy turn

An observation is text or chat messages (a list of {"role", "content"}); `reward` is the turn's reward (0 when the
environment rewards only the outcome, given with the last turn); `terminated` ends the episode with an outcome,
`truncated` cuts it. Subclassing `Env` is optional and adds `clone()`, which by default replays seed, task and
actions on a fresh instance (docs/multiturn.md). A complete environment fits in a 20-line file:

    class GuessNumber(Env):
        def reset(self, seed, task=None):
            ...
            return "Guess my number, from 1 to 10.", {}

        def step(self, action_text):
            ...
            return "No, higher.", 0.0, False, self.tries >= 3, {}

Environments are plug-ins like the engines (marlhf.plugins): `register_env(name, options=...)` on the class (made
as `cls(options)` with an options dataclass, `cls()` without), chosen by its name, its dotted path
`package.module:Class` or its file `path/to/file.py:Class` (`make_env(spec, options)`). marlhf.multiturn runs
episodes of them against a rollout engine. The demo's environment (`relay`, marlhf.demo.env) registers itself when
that module is imported.
"""

from marlhf.envs.base import (ENVS, REGISTRY, Env, Message, Observation, check_observation, clone_env, get_env,
                              make_env, register_env)

__all__ = ["Env", "Observation", "Message", "REGISTRY", "ENVS", "register_env", "get_env", "make_env",
           "check_observation", "clone_env"]
