"""TextArena's games: full episodes with a tiny model (its moves are invalid, which the library scores: a retry, then
the end) and with scripted policies (the tiny model cannot play a valid game), a two-player game against a callable,
a dotted-path and a checkpoint opponent, clone by replay under a disturbed process-wide RNG, and the games refused
before they start (a download, a network, Python 3.11's parser)."""

from __future__ import annotations

import random
import re
import sys

import pytest

pytest.importorskip("textarena", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")

from marlhf.envs import check_observation, clone_env, make_env  # noqa: E402
from marlhf.envs import textarena as ta_adapter  # noqa: E402
from marlhf.errors import MarlhfError  # noqa: E402
from tests.envs.episodes import play  # noqa: E402


def first_free_cell(observation: str) -> str:
    """A scripted TicTacToe player: the first of the game's 'Available Moves'."""
    return re.findall(r"\[\d\]", re.findall(r"Available Moves:([^\n]*)", observation)[-1])[0]


class Bisect:
    """A scripted GuessTheNumber player: bisects 1..20 on the game's 'higher' / 'lower' hints."""

    def __init__(self) -> None:
        self.low, self.high, self.guess = 1, 20, None

    def __call__(self, observation: str) -> str:
        if self.guess is not None and "higher" in observation:
            self.low = self.guess + 1
        elif self.guess is not None and "lower" in observation:
            self.high = self.guess - 1
        self.guess = (self.low + self.high) // 2
        return f"My guess: [{self.guess}]"


@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "Mastermind-v0", "TicTacToe-v0"])
def test_a_tiny_model_plays_to_the_end_on_invalid_moves(game, tiny_policy):
    """The tiny model writes no valid move: the library answers the first with a retry message and ends the game on
    the second, with its own reward for it (a two-player game: a loss, -1)."""
    options = {"opponent": "tests.envs.test_textarena:first_free_cell"} if game == "TicTacToe-v0" else {}
    env = make_env(f"textarena:{game}", options)
    observations, rewards, terminated, info = play(env, lambda o: "(" + tiny_policy(o).replace("[", "") + ")", 1)
    assert terminated and len(rewards) == 2 and rewards[0] == 0.0 and info["invalid_move"]
    assert "attempted an invalid move" in observations[1]
    assert all(check_observation(o) is None for o in observations)
    if game == "TicTacToe-v0":
        assert rewards[-1] == -1.0 and not info["success"]


def test_a_scripted_player_wins_guess_the_number_with_reward_1():
    observations, rewards, terminated, info = play(make_env("textarena:GuessTheNumber-v0"), Bisect(), seed=5)
    assert terminated and rewards[-1] == 1.0 and set(rewards[:-1]) <= {0.0} and info["success"]
    assert observations[0].startswith("[GAME] You are Player 0. You are playing Guess The Number.")


def test_two_players_against_a_fixed_opponent_in_either_seat(tiny_model_dir):
    """Seat 0 with the first free cell against the same strategy wins; seat 1 sees the opponent's first move in its
    first observation; a checkpoint opponent (the tiny model, greedy) moves invalidly and loses."""
    _, rewards, terminated, info = play(make_env("textarena:TicTacToe-v0", {
        "opponent": "tests.envs.test_textarena:first_free_cell"}), first_free_cell, seed=1)
    assert terminated and rewards[-1] == 1.0 and info["reason"] == "Player 0 has won!"
    env = ta_adapter.TextArenaEnv("TicTacToe-v0", ta_adapter.TextArenaOptions(player=1), opponent=first_free_cell)
    assert "Player 0 placed their symbol (O) in cell 0" in env.reset(1)[0]
    env = make_env("textarena:TicTacToe-v0", {"opponent": str(tiny_model_dir), "opponent_max_tokens": 4})
    _, rewards, terminated, info = play(env, first_free_cell, seed=2)
    assert terminated and rewards == [1.0]  # its second invalid move ends the game at the policy's first move


def test_a_two_player_game_needs_an_opponent():
    with pytest.raises(ValueError, match="two-player game: give an opponent"):
        make_env("textarena:TicTacToe-v0")


def _moves(env, actions):
    return [env.step(action)[:3] for action in actions]


def test_clone_replays_seed_and_moves_and_equals_the_original_game():
    """2048 draws a new tile from `random` after every move: a clone made mid-game, stepped while other code draws
    from the process-wide RNG and another game is played, gives the original's next boards; the caller's RNG is
    left as it was."""
    moves = ["[up]", "[left]", "[down]", "[right]"] * 3
    env = make_env("textarena:2048-v0")
    env.reset(11)
    first = _moves(env, moves[:4])
    copy = clone_env(env)
    random.seed(123)
    state = random.getstate()
    other = make_env("textarena:2048-v0")
    other.reset(12)
    _moves(other, moves[:3])
    assert random.getstate() == state  # the games drew from their own copies of the global state
    cloned = []
    for move in moves[4:]:
        random.random()  # other code drawing between the clone's moves
        cloned.append(copy.step(move)[:3])
    rest = _moves(env, moves[4:])
    assert rest == cloned and len({observation for observation, _, _ in rest}) > 1
    fresh = make_env("textarena:2048-v0")
    fresh.reset(11)
    assert _moves(fresh, moves) == first + rest
    fresh.reset(12)
    assert _moves(fresh, moves[:4]) != first  # another seed, another game: the comparison can fail


def test_a_game_that_would_download_is_refused_in_one_line_before_it_starts(monkeypatch):
    """Wordle downloads nltk's word list when its module is imported: refused from its source, in one line, with
    nothing downloaded and its module never imported."""
    import nltk

    monkeypatch.setattr(nltk.data, "find", lambda *a, **k: (_ for _ in ()).throw(LookupError("absent")))
    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk.download was called"))
    ta_adapter.problems.cache_clear()
    try:
        with pytest.raises(MarlhfError) as error:
            make_env("textarena:Wordle-v0")
    finally:
        ta_adapter.problems.cache_clear()
    message = str(error.value)
    assert message.startswith("textarena:Wordle-v0 cannot run here: needs a download: nltk data "
                              "'averaged_perceptron_tagger_eng', 'words'") and "\n" not in message
    assert "textarena.envs.Wordle.env" not in sys.modules


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 parses these f-strings (PEP 701)")
def test_games_that_do_not_parse_on_python_3_11_are_unavailable():
    for game in ("Chess-v0", "Checkers-v0", "ReverseTicTacToe-v0"):
        assert "does not parse on this Python" in ta_adapter.problems(game)[0]
        with pytest.raises(MarlhfError, match="cannot run here"):
            make_env(f"textarena:{game}")


def test_games_that_need_a_network_are_refused():
    assert ta_adapter.problems("TwentyQuestions-v0") == ("needs a network: it calls OpenRouterAgent",)
    assert ta_adapter.problems("GuessTheNumber-v0") == () and ta_adapter.num_players("GuessTheNumber-v0") == 1
    with pytest.raises(ValueError, match="no game 'TicTacToe-v9'"):
        make_env("textarena:TicTacToe-v9")
