"""The libraries' names `LIBRARY:ID`: a missing library is one line naming the extra (this runs without the envs
extra), and `marlhf envs` lists what is installed and what each environment needs."""

from __future__ import annotations

import importlib.util

import pytest

from marlhf import cli
from marlhf.envs import make_env
from marlhf.envs.libraries import library_of
from marlhf.errors import MissingPackage


@pytest.fixture
def no_libraries(monkeypatch):
    """As if none of the three libraries were installed."""
    find_spec = importlib.util.find_spec
    missing = {"reasoning_gym", "textarena", "skyrl_gym"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name, *a))


@pytest.mark.parametrize("spec, distribution", [("reasoning_gym:chain_sum", "reasoning-gym"),
                                                ("textarena:Wordle-v0", "textarena"), ("skyrl_gym:gsm8k", "skyrl-gym")])
def test_a_missing_library_is_one_line_naming_the_extra(no_libraries, spec, distribution, capsys):
    with pytest.raises(MissingPackage) as error:
        make_env(spec)
    assert str(error.value).endswith(f"need the package {distribution!r}, which is not installed: pip install "
                                     f"\"marlhf[envs]\"")
    assert cli.main(["envs"]) == 0
    assert f"{spec.partition(':')[0]}: not installed (pip install \"marlhf[envs]\")" in capsys.readouterr().out


def test_only_the_three_prefixes_are_libraries():
    assert [library_of(s) for s in ("textarena:TicTacToe-v0", "my_pkg.envs:Game", "relay", "skyrl_gym:")] == \
        ["textarena", None, None, "skyrl_gym"]
    with pytest.raises(ValueError, match="names no environment of skyrl_gym"):
        make_env("skyrl_gym:")


def test_marlhf_envs_lists_the_installed_libraries_and_what_they_need(capsys):
    for package in ("reasoning_gym", "textarena", "skyrl_gym"):
        pytest.importorskip(package, reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    assert cli.main(["envs", "skyrl_gym", "textarena"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["skyrl_gym:gsm8k"].endswith("offline") and "skyrl-gym" not in lines
    assert "needs a network: a retrieval server" in lines["skyrl_gym:search"]
    from marlhf.envs.textarena import _nltk_missing

    wordle = "needs a download: nltk data" if _nltk_missing({"words"}) else "offline"  # absent here, unless fetched
    assert wordle in lines["textarena:Wordle-v0"] and "more than two players" in lines["textarena:SecretMafia-v0"]
    assert lines["textarena:TicTacToe-v0"].endswith("offline") and "reasoning_gym:chain_sum" not in lines
    assert cli.main(["envs", "reasoning_gym", "--offline"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert rows["reasoning_gym:chain_sum"] == ["reasoning_gym", "0.1.25", "offline"] and len(rows) > 100
    assert cli.main(["envs", "registered"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["relay"] == ["built-in", "(marlhf.demo.env)", "offline"]
    assert cli.main(["envs", "gym"]) == 2 and "no source 'gym'" in capsys.readouterr().err
