"""`marlhf demo --quick` end to end: every file written, summary schema, the reward-model score rises."""

from __future__ import annotations

import json

import pytest
import yaml

from marlhf import cli
from marlhf.demo import DemoConfig
from marlhf.demo.config import parse_termination
from tests.conftest import DEMO_BASELINES as BASELINES
from tests.conftest import DEMO_TERMINATIONS, SLOW_DEMO_BASELINES, SLOW_DEMO_TERMINATIONS, run_quick_demo

METHODS = ("ppo", "ma_ppo")
EXTRA_METHODS = tuple(parse_termination(spec)[0] for spec in DEMO_TERMINATIONS)  # ma_ppo_fixed_inf
STEPS = DemoConfig.quick().ppo_steps


def test_every_file_is_written(demo_run):
    out, _, _ = demo_run
    for name in ("summary.json", "curves.png", "report.md", "demo_config.yaml"):
        assert (out / name).stat().st_size > 0, name
    for stage in ("base", "sft", "reward"):
        assert (out / "models" / stage / "config.json").is_file(), stage
    config = DemoConfig.quick()
    for name, fields, rows in (("sft", {"prompt", "response"}, config.sft_records),
                               ("preferences", {"prompt", "chosen", "rejected"}, config.preference_records),
                               ("prompts", {"prompt"}, config.ppo_steps * config.ppo_batch_size),
                               ("eval_prompts", {"prompt"}, config.eval_prompts)):
        records = [json.loads(line) for line in (out / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert len(records) == rows and all(set(r) == fields for r in records), name
    for method in METHODS + EXTRA_METHODS:
        run_dir = out / "runs" / method / "seed0"
        for name in ("metrics.jsonl", "gold.jsonl", "eval_samples.jsonl", "config.yaml"):
            assert (run_dir / name).stat().st_size > 0, (method, name)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "![" in report and "curves.png" in report
    assert "MA-PPO's segment values: `value_weighting: first` (" in report  # the default
    assert "GAE lambda of the methods with a critic: `lam: 1` (" in report  # the default, Study II's tuned choice
    assert "detected no difference between MA-PPO" in report and "±0.020 to ±0.062 gold" in report  # Study II
    assert all(yaml.safe_load((out / "runs" / m / "seed0" / "config.yaml").read_text())["lam"] == 1.0 for m in METHODS)
    assert all(f"| {m} |" in report for m in METHODS + EXTRA_METHODS + BASELINES)
    for name in ("metrics.jsonl", "eval_samples.jsonl", "config.yaml"):
        assert (out / "runs" / "dpo" / "seed0" / name).stat().st_size > 0, name


def test_console_shows_stage_lines_and_the_results_table(demo_run):
    out, _, printed = demo_run
    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert len(table) == 3 + len(METHODS + EXTRA_METHODS + BASELINES)
    assert "\n".join(table) in printed  # the report's table, printed as it stands
    for stage in ("pretrain", "sft", "reward model", "ppo"):
        assert f"[demo] {stage} done in" in printed


def test_summary_schema(demo_run):
    out, summary, _ = demo_run
    assert json.loads((out / "summary.json").read_text()) == summary
    assert list(summary["methods"]) == list(METHODS + EXTRA_METHODS + BASELINES)
    assert isinstance(summary["wall_seconds"], float) and summary["wall_seconds"] > 0
    for entry in summary["methods"].values():
        for key in ("gold_reward_final", "rm_reward_final", "kl_final"):
            assert isinstance(entry[key], float), key
        assert -1.0 <= entry["gold_reward_final"] <= 1.0
        assert entry["steps_to_parity"] is None or 1 <= entry["steps_to_parity"] <= STEPS
    assert summary["methods"]["ppo"]["steps_to_parity"] is not None  # PPO reaches its own final value
    dpo = summary["methods"]["dpo"]  # no training rollouts: no curve, no parity
    assert dpo["train_gold_reward_final"] is dpo["steps_to_parity"] is dpo["speedup_vs_ppo"] is None
    assert dpo["kl_final"] != 0.0  # DPO moved the policy away from the SFT model


def test_logs_have_one_row_per_step(demo_run):
    _assert_one_row_per_step(demo_run[0], METHODS + EXTRA_METHODS)


@pytest.mark.slow  # a second quick demo (minutes); the default run's demo has a rule and a baseline of its own
def test_a_rule_on_the_policys_log_probs_and_a_critic_free_baseline_run_in_the_demo(tmp_path):
    out, summary, _ = run_quick_demo(tmp_path, SLOW_DEMO_TERMINATIONS, SLOW_DEMO_BASELINES)
    methods = METHODS + tuple(parse_termination(spec)[0] for spec in SLOW_DEMO_TERMINATIONS) + SLOW_DEMO_BASELINES
    assert list(summary["methods"]) == list(methods)  # ppo, ma_ppo, ma_ppo_perplexity, reinforce
    report = (out / "report.md").read_text()
    assert all(f"| {m} |" in report for m in methods)
    _assert_one_row_per_step(out, methods)


def _assert_one_row_per_step(out, methods: tuple[str, ...]) -> None:
    for method in methods:
        run_dir = out / "runs" / method / "seed0"
        gold = [json.loads(line) for line in (run_dir / "gold.jsonl").read_text().splitlines()]
        trainer = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in gold] == [row["step"] for row in trainer] == list(range(1, STEPS + 1))
        # The reward function's RM scores are the ones PPO logged.
        for g, t in zip(gold, trainer):
            assert g["rm_reward"] == pytest.approx(t["objective/rm_score"], abs=1e-4)
        # Each method segmented its responses by its own rule.
        lengths = [t["macro/mean_segment_length"] for t in trainer]
        if method == "ppo":
            assert lengths == [1.0] * STEPS
        elif method == "ma_ppo":
            assert all(1.0 < x <= 5.0 for x in lengths)
        elif method == "ma_ppo_fixed_inf":  # one segment per response
            assert lengths == pytest.approx([t["objective/response_length"] for t in trainer])
        elif method == "reinforce":  # token-level ratios, no critic
            assert lengths == [1.0] * STEPS and all("loss/value" not in t for t in trainer)


def test_reward_model_score_rises_during_ppo(demo_run):
    out, summary, _ = demo_run
    for method in METHODS:
        rows = [json.loads(line) for line in (out / "runs" / method / "seed0" / "gold.jsonl").read_text().splitlines()]
        first, last = rows[:3], rows[-3:]
        assert sum(r["rm_reward"] for r in last) > sum(r["rm_reward"] for r in first), method
        assert summary["methods"][method]["rm_reward_final"] > summary["sft"]["rm_reward"], method


def test_command_line_quick_preset_keeps_given_options(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("marlhf.demo.pipeline.run_demo", seen.append)
    assert cli.main(["demo", "--out", str(tmp_path), "--quick", "--seeds", "3", "--terminations", "randomized"]) == 0
    (config,) = seen
    assert config.out == str(tmp_path) and config.seeds == (3,) and config.terminations == ("randomized",)
    assert config.ppo_steps == DemoConfig.quick().ppo_steps
    cli.main(["demo", "--out", str(tmp_path), "--quick", "--methods", "rloo", "dpo"])
    assert seen[-1].methods == ("rloo", "dpo") and seen[-1].ppo_steps == DemoConfig.quick().ppo_steps
    cli.main(["demo", "--out", str(tmp_path), "--ppo_steps", "7"])
    assert seen[-1].ppo_steps == 7 and seen[-1].seeds == DemoConfig().seeds


def test_a_methods_options_win_over_the_demos_ppo_settings(monkeypatch, tmp_path):
    """run_method: a method's options override the demo's (Study III plans a run's schedule with max_steps)."""
    from types import SimpleNamespace

    from marlhf.demo import pipeline

    class Stop(Exception):
        pass

    seen = {}

    def train_ppo(config, *args, **kwargs):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(pipeline, "train_ppo", train_ppo)
    monkeypatch.setattr(pipeline, "RewardWithGold", lambda *args: None)
    models = SimpleNamespace(reward_model=None, tokenizer=None, task=None, sft_dir=tmp_path, reward_dir=tmp_path)
    config = DemoConfig.quick()
    with pytest.raises(Stop):
        pipeline.run_method(config, models, {"max_steps": 7, "lam": 0.9}, 0, tmp_path / "run", [], [], "m")
    assert seen["config"].max_steps == 7 and seen["config"].plugin_options("advantage").lam == 0.9
    with pytest.raises(Stop):
        pipeline.run_method(config, models, {}, 0, tmp_path / "run", [], [], "m")
    assert seen["config"].max_steps == config.ppo_steps
