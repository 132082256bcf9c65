"""TextArena's games as environments: `textarena:ID` (docs/envs.md#textarena).

A single-player game is played by the policy alone; a two-player game by the policy against a fixed opponent,
`observation text -> action text` (TextArena's own `Agent` convention): a callable passed in, a dotted path
`package.module:function`, or a marlhf policy checkpoint directory played greedily. The policy sees the game's
messages addressed to it since its last move (the prompt and board first), one `[SENDER] message` line each; the
reward is the game's own at the end (single player: the game's score, often a completion share; two players: 1
win, 0 draw, -1 loss), 0 before; an invalid move is the library's: a retry with a message, then a loss.

TextArena seeds Python's process-wide `random` and draws from it during the game, so each game here runs inside its
own copy of `random`'s (and numpy's) global state, swapped in around every call into the game: a game depends only
on its seed and its moves, whatever else runs between its turns, and `clone()` (replay of seed and moves) gives the
same game. Before a game is made, its module is read (not imported) for what it would need that is not here: a
download (nltk data, about 20 word games), a network (an OpenRouter model), a package, or a syntax Python 3.11 does
not parse; such a game is refused in one line (`problems`, listed by `marlhf envs`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from marlhf.config import option
from marlhf.envs.base import Env
from marlhf.envs.libraries import require
from marlhf.errors import MarlhfError, did_you_mean
from marlhf.imports import import_function
from marlhf.plugins import Plugin

__all__ = ["TextArenaOptions", "TextArenaEnv", "CheckpointOpponent", "plugin", "available", "problems",
           "num_players", "format_messages"]

Opponent = Callable[[str], str]

NETWORK_MARKERS = ("OpenRouterAgent", "OpenRouterJury", "openai.", "requests.")
NLTK_CATEGORIES = ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc", "sentiment", "stemmers")
STATE_PLAYERS = {"SinglePlayerState": 1, "TwoPlayerState": 2}


@dataclasses.dataclass(frozen=True)
class TextArenaOptions:
    """How the policy plays a TextArena game."""

    player: int = option(0, "two-player games: the policy's seat (0 moves first)", ge=0, le=1)
    opponent: str | None = option(
        None, "two-player games: the fixed opponent, a dotted path package.module:function (observation text -> "
              "action text) or a marlhf policy checkpoint directory (played greedily)")
    opponent_max_tokens: int = option(64, "a checkpoint opponent's most new tokens per move", ge=1)
    game_options: dict[str, Any] | None = option(
        None, "the game's own constructor options, over those its id registers, e.g. '{max_turns: 5}'")


def _registry() -> dict[str, Any]:
    return require("textarena").envs.registration.ENV_REGISTRY


def available() -> list[str]:
    """The installed library's game ids (without the `-raw` and `-train` variants, which differ in wrappers only:
    this adapter formats observations itself)."""
    return sorted(i for i in _registry() if not i.endswith(("-raw", "-train")))


def _module_file(module: str) -> Path | None:
    """The source file of a textarena module, found without importing it (a game's module may download on import)."""
    root = Path(require("textarena").__file__).parent
    parts = module.split(".")[1:]
    for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def _sources(module: str) -> list[tuple[str, str]]:
    """(file, text) of the module and the textarena.envs modules it imports, transitively (package __init__ files
    other than its own are not followed: textarena.envs.utils's imports every word list)."""
    seen, todo, found = set(), [module], []
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        text = path.read_text(encoding="utf-8")
        found.append((str(path), text))
        todo += [m for m in re.findall(r"(?:from|import)\s+(textarena\.envs\.[\w.]+)", text)
                 if not m.endswith(".utils")]
    return found


def _nltk_missing(resources: set[str]) -> list[str]:
    """The nltk resources among `resources` that are not in any nltk data folder here."""
    import nltk

    def present(name: str) -> bool:
        for category in NLTK_CATEGORIES:
            try:
                nltk.data.find(f"{category}/{name}")
                return True
            except LookupError:
                continue
        return False

    return sorted(name for name in resources if not present(name))


def _parse(text: str) -> ast.Module:
    """The source's tree, without the warnings of its invalid escape sequences (the library's, not the user's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        return ast.parse(text)


def _imported(texts: Any) -> set[str]:
    """The top-level packages the sources import (absolute imports; a source that does not parse is skipped)."""
    names = set()
    for text in texts:
        try:
            tree = _parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@functools.lru_cache(maxsize=None)
def problems(game_id: str) -> tuple[str, ...]:
    """What game `game_id` would need that is not here, one phrase each (empty: it runs offline), read from its
    module's source without importing it."""
    entry = _registry()[game_id].entry_point
    if not isinstance(entry, str):
        return ()
    found: list[str] = []
    sources = _sources(entry.split(":")[0])
    for path, text in sources:
        try:
            _parse(text)
        except SyntaxError as error:
            found.append(f"its module does not parse on this Python ({Path(path).name}, line {error.lineno}: "
                         f"{error.msg})")
    text = "\n".join(text for _, text in sources)
    resources = set(re.findall(r"nltk\.download\(\s*\[?\s*['\"]([\w-]+)['\"]", text))
    resources |= {name for group in re.findall(r"nltk\.download\(\s*\[([^\]]*)\]", text)
                  for name in re.findall(r"['\"]([\w-]+)['\"]", group)}
    missing = _nltk_missing(resources)
    if missing:
        found.append(f"needs a download: nltk data {', '.join(map(repr, missing))} (python -m nltk.downloader "
                     f"{' '.join(missing)}, where there is a network)")
    markers = [marker.rstrip(".") for marker in NETWORK_MARKERS if marker in text]
    if markers:
        found.append(f"needs a network: it calls {', '.join(markers)}")
    absent = sorted(m for m in _imported(text for _, text in sources) if importlib.util.find_spec(m) is None)
    if absent:
        found.append(f"needs the package(s) {', '.join(absent)}, not installed")
    return tuple(found)


@functools.lru_cache(maxsize=None)
def num_players(game_id: str) -> int | None:
    """1 or 2 from the game state its module uses; None for a game of more players (not adapted here)."""
    entry = _registry()[game_id].entry_point
    text = "\n".join(text for _, text in _sources(entry.split(":")[0])) if isinstance(entry, str) else ""
    counts = {players for state, players in STATE_PLAYERS.items() if state in text}
    return counts.pop() if len(counts) == 1 else None


def check_game(game_id: str) -> None:
    """A ValueError for an unknown id or a game of more than two players, a MarlhfError in one line for a game that
    would download, reach a network, or does not parse: before any episode starts."""
    if game_id not in _registry():
        raise ValueError(f"textarena has no game {game_id!r}{did_you_mean(game_id, available())}; `marlhf envs` "
                         f"lists them")
    found = problems(game_id)
    if found:
        raise MarlhfError(f"textarena:{game_id} cannot run here: {'; '.join(found)}")
    if num_players(game_id) is None:
        raise ValueError(f"textarena:{game_id} is a game of more than two players; this adapter plays one- and "
                         f"two-player games")


def format_messages(messages: list[tuple[int, str, Any]], player: int, roles: dict[int, str]) -> str:
    """The game's messages to `player`, one `[SENDER] message` line each, without the echo of its own moves."""
    import textarena as ta

    lines = []
    for sender, message, kind in messages:
        if sender == player and kind == ta.ObservationType.PLAYER_ACTION:
            continue
        name = "GAME" if sender == ta.GAME_ID else roles.get(sender, f"Player {sender}")
        lines.append(f"[{name}] {message}")
    return "\n".join(lines)


class _OwnRandom:
    """A game's own copy of `random`'s and numpy's global states, swapped in for the duration of a `with`."""

    def __init__(self, seed: int) -> None:
        outer = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        self.state = random.getstate(), np.random.get_state()
        random.setstate(outer[0])
        np.random.set_state(outer[1])

    def __enter__(self) -> None:
        self.outer = random.getstate(), np.random.get_state()
        random.setstate(self.state[0])
        np.random.set_state(self.state[1])

    def __exit__(self, *exc: Any) -> None:
        self.state = random.getstate(), np.random.get_state()
        random.setstate(self.outer[0])
        np.random.set_state(self.outer[1])


class CheckpointOpponent:
    """A causal LM checkpoint (a marlhf policy's output directory) as an opponent: greedy, at most `max_new_tokens`,
    on the observation (through the chat template when the tokenizer has one), its context cut from the left to fit
    the model."""

    def __init__(self, path: str, max_new_tokens: int = 64) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.max_new_tokens = max_new_tokens
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id

    def __call__(self, observation: str) -> str:
        import torch

        if self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": observation}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = self.tokenizer(observation)["input_ids"]
        room = getattr(self.model.config, "max_position_embeddings", 2048) - self.max_new_tokens
        prompt = torch.tensor([ids[-max(room, 1):]])
        with torch.no_grad():
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=self.max_new_tokens,
                                      pad_token_id=self.pad_token_id)
        return self.tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)


def _opponent(spec: str | None, max_new_tokens: int) -> Opponent | None:
    if spec is None:
        return None
    if Path(spec).is_dir():
        return CheckpointOpponent(spec, max_new_tokens)
    if ":" not in spec:
        raise ValueError(f"textarena opponent must be a checkpoint directory or a dotted path "
                         f"package.module:function, got {spec!r}")
    return import_function(spec, "opponent")


class TextArenaEnv(Env):
    """One TextArena game per episode, the policy in seat `options.player` (`reset(seed, task)`: `task` is unused,
    the game is drawn from `seed`)."""

    def __init__(self, game_id: str, options: TextArenaOptions | None = None, opponent: Opponent | None = None) -> None:
        check_game(game_id)
        self.game_id, self.options = game_id, options or TextArenaOptions()
        self.players = num_players(game_id)
        self.player = self.options.player if self.players == 2 else 0
        self.opponent = opponent or _opponent(self.options.opponent, self.options.opponent_max_tokens)
        if self.players == 2 and self.opponent is None:
            raise ValueError(f"textarena:{game_id} is a two-player game: give an opponent (the option 'opponent': a "
                             f"dotted path or a checkpoint directory, or TextArenaEnv(..., opponent=callable))")
        self.game: Any = None

    def _make_game(self) -> Any:
        """The game without TextArena's observation wrappers (this adapter formats the messages), with its action
        wrappers (brackets added to a bare move, as the library's default)."""
        import textarena as ta

        spec = _registry()[self.game_id]
        module, name = spec.entry_point.split(":")
        game = getattr(importlib.import_module(module), name)(**{**spec.kwargs, **(self.options.game_options or {})})
        for wrapper in spec.default_wrappers or ():
            if issubclass(wrapper, ta.ActionWrapper):
                game = wrapper(game)
        return game

    def reset(self, seed: int, task: Any = None) -> tuple[str, dict[str, Any]]:
        self.rng = _OwnRandom(seed)
        self.opponent_view = ""
        with self.rng:
            self.game = self._make_game()
            self.game.reset(num_players=self.players, seed=seed)
            done = self._opponent_moves()
        if done:
            raise MarlhfError(f"textarena:{self.game_id} ended before the policy's first move (seed {seed})")
        return self._observation(), {"player": self.player}

    def _observation(self) -> str:
        player, messages = self.game.get_observation()
        return format_messages(messages, player, self.game.state.role_mapping)

    def _opponent_moves(self) -> bool:
        """The opponent's moves until the policy's turn or the end; whether the game ended."""
        done = False
        while not done and self.game.state.current_player_id != self.player:
            player, messages = self.game.get_observation()
            self.opponent_view += "\n" + format_messages(messages, player, self.game.state.role_mapping)
            done, _ = self.game.step(str(self.opponent(self.opponent_view.strip())))
        return done

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.game is None:
            raise RuntimeError("TextArenaEnv.step was called before reset")
        with self.rng:
            done, _ = self.game.step(action_text)
            done = done or self._opponent_moves()
            if not done:
                return self._observation(), 0.0, False, False, {}
            observation = self._observation()
            rewards, game_info = self.game.close()
        reward = float(rewards[self.player])
        mine = game_info.get(self.player, {})
        return observation, reward, True, False, {"invalid_move": bool(mine.get("invalid_move")),
                                                  "reason": str(mine.get("reason", "")), "success": reward > 0}


def plugin(game_id: str) -> Plugin:
    """The environment plug-in of `textarena:ID` (made as `TextArenaEnv(ID, options)`), refused in one line for a
    game that cannot run here."""
    check_game(game_id)
    return Plugin("environment", f"textarena:{game_id}", functools.partial(TextArenaEnv, game_id), TextArenaOptions,
                  {})
