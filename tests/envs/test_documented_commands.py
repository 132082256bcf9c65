"""docs/envs.md's commands, one `marlhf ppo` (two steps) and one `marlhf evaluate` per library, run as written in a
fresh directory through the CLI on a tiny model (smaller batches, budgets and sample counts appended: the last
flag wins), each evaluation on the model its training wrote; and two PPO steps of a two-player TextArena game and
of reasoning-gym's tasks as episodes (`--env`)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from marlhf import cli
from marlhf.logging_utils import read_metrics
from tests.envs.episodes import GSM8K_RECORD

DOCS = Path(__file__).resolve().parents[2] / "docs" / "envs.md"
LIBRARIES = {"reasoning-gym": "reasoning_gym", "TextArena": "textarena", "SkyRL-Gym": "skyrl_gym"}
# appended to the documented flags: a tiny model's batch, budgets and sample counts
SMALL = {"ppo": ["--per_device_batch_size", "2", "--mini_batch_size", "4", "--num_samples_per_prompt", "2",
                 "--save_steps", "0"],
         "evaluate": ["--num_samples", "3", "--batch_size", "4"]}
EPISODES = ["--max_turn_tokens", "8", "--max_response_tokens", "400"]  # ppo --env's limits


def documented_commands(section: str) -> list[str]:
    """The command lines of the bash blocks of docs/envs.md's section `## SECTION`, continuations joined."""
    text = DOCS.read_text()
    text = text[text.index(f"## {section}\n"):]
    text = text[:text.find("\n## ", 1)] if "\n## " in text[1:] else text
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _run(line: str, model_dir: Path, extra: list[str]) -> list[str]:
    """A documented `marlhf ...` line through the CLI with the tiny model (training's, or the model it trained)."""
    argv = shlex.split(line)
    assert argv[0] == "marlhf"
    if argv[1] == "ppo":
        argv += ["--model_name_or_path", str(model_dir), *EPISODES * ("--env" in argv)]
    assert cli.main([*argv[1:], *SMALL[argv[1]], *extra]) == 0, line
    return argv


def _output_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--output_dir") + 1])


def _check(argv: list[str]) -> None:
    """Two logged steps of a training; an evaluation's summary with its intervals and its episodes."""
    if argv[1] == "ppo":
        assert [m["step"] for m in read_metrics(_output_dir(argv))] == [1, 2]
        return
    summary = json.loads((_output_dir(argv) / "summary.json").read_text())
    assert len(summary["mean_return_ci"]) == 2 and 0 <= summary["success_rate_ci"][0] <= summary["success_rate"]
    assert len((_output_dir(argv) / "episodes.jsonl").read_text().splitlines()) == summary["episodes"]
    if "--pass_at_k" in argv:
        assert set(summary["pass_at_k"]) == {"num_problems", "pass@1", "pass@4"}


@pytest.mark.parametrize("section", sorted(LIBRARIES))
def test_each_library_section_trains_two_steps_and_evaluates(section, tmp_path, monkeypatch, long_tiny_model_dir):
    pytest.importorskip(LIBRARIES[section], reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    monkeypatch.chdir(tmp_path)
    if section == "SkyRL-Gym":  # what SkyRL's gsm8k_dataset.py writes (it downloads GSM8K), one problem a file
        import pyarrow
        import pyarrow.parquet

        Path("gsm8k").mkdir()
        for split in ("train", "validation"):
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist([GSM8K_RECORD] * 4), f"gsm8k/{split}.parquet")
    lines = documented_commands(section)
    commands = [line for line in lines if line.startswith("marlhf ")]
    assert [shlex.split(line)[1] for line in commands] == ["ppo", "evaluate"], lines
    for line in lines[:-2]:  # the data a section makes first
        subprocess.run(line.replace("python ", f"{shlex.quote(sys.executable)} ", 1), shell=True, check=True)
    # reasoning-gym's prompts (its system prompt, then the question) in the tiny tokenizer's tokens
    extra = {"reasoning_gym": ["--max_prompt_length", "1024", "--max_length", "1100", "--max_response_length", "16"]}
    for line in commands:
        argv = shlex.split(line)
        more = extra.get(LIBRARIES[section], []) if argv[1] == "ppo" else []
        _check(_run(line, long_tiny_model_dir, more))


@pytest.mark.parametrize("env, options, dataset", [
    ("textarena:TicTacToe-v0", "{opponent: 'tests.envs.test_textarena:first_free_cell'}", None),
    ("reasoning_gym:chain_sum", "{size: 8, system_prompt: none}", "reasoning_gym:chain_sum{size: 8, system_prompt: none}"),
])
def test_two_ppo_steps_on_episodes(env, options, dataset, tmp_path, long_tiny_model_dir):
    """A two-player game against a scripted opponent (the tiny model's invalid moves lose: -1), and reasoning-gym's
    tasks as episodes of one turn whose records give the entries, two turn-level MA-PPO steps each."""
    pytest.importorskip(env.partition(":")[0], reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    if dataset is None:
        (tmp_path / "games.jsonl").write_text("".join(json.dumps({"prompt": f"game {i}"}) + "\n" for i in range(4)))
        dataset = str(tmp_path / "games.jsonl")
    argv = ["marlhf", "ppo", "--env", env, "--env_options", options, "--dataset", dataset, "--max_turns", "3",
            "--max_length", "1200", "--termination", "turn", "--advantage", "gae", "--value_weighting", "first",
            "--max_steps", "2", "--learning_rate", "1e-3", "--warmup_ratio", "0", "--lr_scheduler", "constant",
            "--output_dir", str(tmp_path / "run")]
    _run(shlex.join(argv), long_tiny_model_dir, [])
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["env/episodes"] == 4 for m in metrics)
    if env.startswith("textarena"):
        assert all(m["objective/rm_score"] == -1.0 and m["env/turns"] == 2 for m in metrics)
    else:
        assert all(m["env/turns"] == 1 and 0 <= m["objective/rm_score"] <= 1 for m in metrics)
    assert metrics[1]["objective/kl"] != 0  # step 1's update moved the policy
