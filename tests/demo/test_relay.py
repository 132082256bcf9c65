"""`marlhf demo --task relay --quick`, shrunk further: every file written, the four methods in the summary and the
report in sentences; and the relay demonstrations the SFT model learns from."""

from __future__ import annotations

import json

import pytest

from marlhf import cli
from marlhf.demo.config import DemoConfig
from marlhf.demo.env import ACTION_WORDS, RelayEnv, RelayOptions, relay_demonstrations
from marlhf.demo.relay import RELAY_METHODS

SHRUNK = ["--ppo_steps", "2", "--ppo_batch_size", "8", "--pretrain_texts", "128", "--sft_records", "32",
          "--eval_prompts", "4"]


@pytest.fixture(scope="module")
def relay_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("relay")
    assert cli.main(["demo", "--task", "relay", "--quick", "--out", str(out), *SHRUNK]) == 0
    return out, json.loads((out / "summary.json").read_text())


def test_every_file_is_written_and_every_method_runs(relay_run):
    out, summary = relay_run
    for name in ("summary.json", "curves.png", "report.md", "demo_config.yaml", "data/sft.jsonl", "data/prompts.jsonl",
                 "data/eval_prompts.jsonl", "models/sft/eval_samples.jsonl"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "models" / "reward").exists()  # the environment scores: no reward model
    assert list(summary["methods"]) == list(RELAY_METHODS) and summary["task"] == "relay"
    for method in RELAY_METHODS:
        run_dir = out / "runs" / method / "seed0"
        gold = [json.loads(line) for line in (run_dir / "gold.jsonl").read_text().splitlines()]
        assert [row["step"] for row in gold] == [1, 2]
        episodes = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
        assert len(episodes) == 4 and all(len(e["relayed"]) == 2 and len(e["turn_rewards"]) == 3 for e in episodes)
        entry = summary["methods"][method]
        assert 0.0 <= entry["gold_reward_final"] <= 1.0 and "rm_reward_final" not in entry
        returns = [sum(e["turn_rewards"]) for e in episodes]  # the gold outcome: the episode's return
        assert entry["per_seed"]["0"]["gold_reward"] == pytest.approx(sum(returns) / len(returns))


def test_the_report_says_what_the_seeds_show_and_cannot(relay_run):
    out, _ = relay_run
    report = (out / "report.md").read_text()
    assert "smoke test (--quick)" in report.lower()
    assert "- ppo: held-out gold" in report and "one seed, no interval" in report
    assert "What these 1 seed cannot tell" in report
    assert "| ma_ppo_turn |" in report and "RM score" not in report
    assert "MA-PPO (one macro action per turn, value weighting first)" in report


def test_demonstrations_follow_the_rollout_encoding_and_their_right_rate():
    options = RelayOptions()
    records = relay_demonstrations(options, 200, seed=0, right_rate=0.5, eos="</s>")
    assert len(records) == 200 * options.turns
    env = RelayEnv(options)
    right = [0, 0, 0]
    for start in range(0, len(records), options.turns):
        episode = records[start:start + options.turns]
        assert all(len(r["response"].split()) == ACTION_WORDS for r in episode)
        for turn, record in enumerate(episode):
            assert record["prompt"].endswith("|")
            first = record["response"].split()[0]
            if turn == 0:
                right[0] += env.task.word_class[first] == "bright"
            else:  # the turn's context ends with the previous action, EOS and the relayed word
                previous = episode[turn - 1]
                relayed = record["prompt"].split()[-2]
                assert record["prompt"] == f"{previous['prompt']} {previous['response']}</s> {relayed} |"
                right[turn] += first == relayed
    assert all(0.4 < count / 200 < 0.75 for count in right)  # 0.5 + chance hits, about 0.5-0.67


def test_relay_refuses_single_turn_options():
    with pytest.raises(ValueError, match="relay compares its own four methods"):
        DemoConfig(task="relay", methods=("rloo",))


def test_options_of_the_other_task_are_refused_not_ignored():
    with pytest.raises(ValueError, match="task relay does not read gold, critic_init"):
        DemoConfig(task="relay", gold="decision", critic_init="sft").validate()
    with pytest.raises(ValueError, match="task single_turn does not read relay_rate"):
        DemoConfig(relay_rate=0.5).validate()
    DemoConfig.quick(task="relay").validate()
