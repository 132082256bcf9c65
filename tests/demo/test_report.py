"""Summary arithmetic of the demo report (steps to parity, speed-up) on hand-made curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlhf.demo.config import DemoConfig, parse_termination
from marlhf.demo.report import first_step_reaching, load_method_runs, summarize
from marlhf.evaluation.plots import RunMetrics


def run(label: str, gold: list[float]) -> RunMetrics:
    return RunMetrics(label, Path("."), [{"step": i + 1, "gold_reward": g} for i, g in enumerate(gold)])


def final(gold: float) -> dict:
    return {"gold_reward": gold, "rm_reward": 2 * gold, "kl": 1.0}


def test_first_step_reaching():
    assert first_step_reaching([1, 2, 3], [0.1, 0.5, 0.4], 0.45) == 2
    assert first_step_reaching([1, 2, 3], [0.1, 0.2, 0.3], 0.5) is None


def test_summarize_steps_to_parity_over_seed_means():
    runs = {
        "ppo": [run("ppo", [0.0, 0.1, 0.2, 0.3, 0.4]), run("ppo", [0.0, 0.1, 0.2, 0.3, 0.6])],  # final mean 0.5
        "ma_ppo": [run("ma_ppo", [0.2, 0.5, 0.6, 0.6, 0.7]), run("ma_ppo", [0.0, 0.5, 0.6, 0.6, 0.7])],
        "slow": [run("slow", [0.0] * 5), run("slow", [0.1] * 5)],
    }
    finals = {"ppo": [final(0.4), final(0.6)], "ma_ppo": [final(0.6), final(0.8)], "slow": [final(0.0), final(0.1)]}
    summary = summarize(runs, finals, [0, 1], smoothing=1, wall_seconds=12.0)
    assert summary["parity_target_gold_reward"] == pytest.approx(0.5)
    ppo, ma_ppo, slow = (summary["methods"][m] for m in ("ppo", "ma_ppo", "slow"))
    assert (ppo["steps_to_parity"], ma_ppo["steps_to_parity"], slow["steps_to_parity"]) == (5, 2, None)
    assert ma_ppo["speedup_vs_ppo"] == pytest.approx(2.5) and slow["speedup_vs_ppo"] is None
    assert ma_ppo["gold_reward_final"] == pytest.approx(0.7)
    assert ma_ppo["gold_reward_final_std"] == pytest.approx(0.1)
    assert ma_ppo["per_seed"]["1"]["rm_reward"] == pytest.approx(1.6)
    # Smoothing over 2 steps delays ma_ppo's crossing: (0.25 + 0.5) / 2 < 0.5 at step 2, 0.55 at step 3.
    smoothed = summarize(runs, finals, [0, 1], smoothing=2, wall_seconds=12.0)
    assert smoothed["methods"]["ma_ppo"]["steps_to_parity"] == 3
    # A method evaluated without training rollouts (DPO) has no curve, hence no parity.
    with_dpo = summarize(runs, {**finals, "dpo": [final(0.3), final(0.5)]}, [0, 1], 1, 12.0)
    dpo = with_dpo["methods"]["dpo"]
    assert dpo["gold_reward_final"] == pytest.approx(0.4)
    assert dpo["train_gold_reward_final"] is dpo["steps_to_parity"] is dpo["speedup_vs_ppo"] is None
    with pytest.raises(ValueError, match="baseline"):
        summarize({"ma_ppo": runs["ma_ppo"]}, finals, [0, 1], 1, 0.0)


def test_load_method_runs_merges_trainer_and_gold_rows(tmp_path):
    run_dir = tmp_path / "ma_ppo" / "seed3"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "objective/kl": 0.5}) + "\n")
    (run_dir / "gold.jsonl").write_text(json.dumps({"step": 1, "gold_reward": 0.2, "rm_reward": 1.0}) + "\n")
    (loaded,) = load_method_runs(tmp_path / "ma_ppo", [3], "gold.jsonl")
    assert loaded.label == "ma_ppo"
    assert loaded.rows == [{"step": 1, "objective/kl": 0.5, "gold_reward": 0.2, "rm_reward": 1.0}]


def test_parse_termination_and_config_checks():
    assert parse_termination("fixed:3") == ("ma_ppo_fixed3", {"termination": "fixed", "ngram": 3})
    assert parse_termination("fixed:none") == ("ma_ppo_fixed_inf", {"termination": "fixed", "ngram": None})
    with pytest.raises(ValueError, match="fixed:none"):
        parse_termination("fixed:inf")  # one spelling of "whole response", as `--ngram none`
    assert parse_termination("randomized") == ("ma_ppo_randomized", {"termination": "randomized"})
    assert parse_termination("perplexity")[0] == "ma_ppo_perplexity"
    assert parse_termination("word") == ("ma_ppo_word", {"termination": "word"})
    for bad in ("fixed", "fixed:0", "fixed:x", "parsing", "randomized:2", "word:2"):
        with pytest.raises(ValueError, match="terminations"):
            parse_termination(bad)
    with pytest.raises(ValueError, match="terminations"):
        DemoConfig(terminations=("fixed:5",))  # ma_ppo already runs n=5
    with pytest.raises(ValueError, match="ppo_batch_size"):
        DemoConfig(ppo_batch_size=33)
    with pytest.raises(ValueError, match="seeds"):
        DemoConfig(seeds=(1, 1))
    assert DemoConfig.quick(out="x").ppo_steps < DemoConfig().ppo_steps
    assert (DemoConfig().reward, DemoConfig().gold, DemoConfig().num_words) == ("model", "word_scores", 20)
    for bad in (dict(reward="both"), dict(gold="lcs"), dict(num_words=0), dict(gold_reward_scale=0)):
        with pytest.raises(ValueError):
            DemoConfig(**bad)


def test_methods_option_checks():
    assert DemoConfig(methods=["rloo", "grpo", "reinforce", "dpo"]).methods == ("rloo", "grpo", "reinforce", "dpo")
    assert DemoConfig().methods == ()
    with pytest.raises(ValueError, match=r"methods\[1\] must be one of \['rloo', 'grpo', 'reinforce', 'dpo'\]"):
        DemoConfig(methods=("dpo", "ppo"))  # ppo always runs; not a --methods choice
    with pytest.raises(ValueError, match="methods repeat"):
        DemoConfig(methods=("rloo", "rloo"))
    with pytest.raises(ValueError, match="ppo_batch_size must be a multiple of 4"):
        DemoConfig(methods=("grpo",), ppo_batch_size=10)  # 10 responses are not groups of 4
    assert DemoConfig(methods=("reinforce", "dpo"), ppo_batch_size=10).ppo_batch_size == 10
