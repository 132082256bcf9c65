"""The evaluation subcommands of `marlhf`, end to end on tiny inputs."""

import dataclasses
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from marlhf import cli
from marlhf.evaluation.evaluate import EvaluateConfig
from marlhf.evaluation.judge import write_jsonl
from marlhf.modeling import ScalarHeadModel
from tests.evaluation.conftest import write_run


def test_plot_command(tmp_path, capsys):
    for seed in (1, 2):
        write_run(tmp_path / "runs" / "ma_ppo" / f"seed{seed}", seed, num_steps=5)
    out = tmp_path / "plots"
    assert cli.main(["plot", str(tmp_path / "runs" / "ma_ppo" / "seed1"), str(tmp_path / "runs" / "ma_ppo" / "seed2"),
                     "--out", str(out), "--smooth", "2", "--metrics", "objective/kl"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["diagnostics.png", "objective_kl.png"]
    assert str(out / "objective_kl.png") in capsys.readouterr().out


@pytest.fixture
def response_files(tmp_path):
    prompts = [f"question {i}" for i in range(6)]
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": p, "response": f"GOOD answer {i} with more words", "score": 1.0}
                                       for i, p in enumerate(prompts)])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": p, "response": f"poor {i}", "score": 0.0}
                                       for i, p in enumerate(reversed(prompts))])
    return tmp_path / "a.jsonl", tmp_path / "b.jsonl"


def test_judge_command_with_an_endpoint(tmp_path, response_files, judge_server, monkeypatch, capsys):
    monkeypatch.setenv("JUDGE_KEY", "secret")
    argv = ["judge", "--a", str(response_files[0]), "--b", str(response_files[1]), "--out", str(tmp_path / "j.jsonl"),
            "--judge-url", judge_server.url, "--judge-model", "m", "--api-key-env", "JUDGE_KEY",
            "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["wins"] == 6 and summary["win_rate"] == 1.0
    assert json.loads((tmp_path / "j.summary.json").read_text()) == summary
    assert len((tmp_path / "j.jsonl").read_text().splitlines()) == 6
    assert cli.main(argv) == 0
    assert len(judge_server.requests) == 6  # the rerun was served from the cache
    template = tmp_path / "template.txt"
    template.write_text("MY JUDGE PROMPT {prompt}\n[Response 1]\n{first}\n\n[Response 2]\n{second}\n1, 2 or tie?")
    assert cli.main(argv + ["--template", str(template)]) == 0
    assert len(judge_server.requests) == 12
    assert judge_server.requests[-1]["body"]["messages"][0]["content"].startswith("MY JUDGE PROMPT question")


def test_judge_command_with_a_reward_model(tmp_path, response_files, tiny_model_dir, tiny_tokenizer, capsys):
    torch.manual_seed(0)
    ScalarHeadModel.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    assert cli.main(["judge", "--a", str(response_files[0]), "--b", str(response_files[1]),
                     "--out", str(tmp_path / "j.jsonl"), "--reward-model", str(tmp_path / "rm")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["wins"] + summary["ties"] + summary["losses"] == 6


def test_judge_command_needs_a_judge(response_files, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["judge", "--a", str(response_files[0]), "--b", str(response_files[1]), "--out", str(tmp_path / "j")])


def test_human_eval_summary_command(tmp_path, capsys):
    for name, choices in (("one", ["A", "B", "A"]), ("two", ["A", "B", "tie"])):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"index": i, "prompt": f"p{i}", "choice": c} for i, c in enumerate(choices)])
    assert cli.main(["human-eval", "--summary", str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["agreement"]["raw"] == pytest.approx(2 / 3)
    assert cli.main(["human-eval", "--a", "x.jsonl"]) == 2
    assert "--a, --b and --out are required" in capsys.readouterr().err


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_human_eval_command_serves_until_interrupted(tmp_path, response_files, stop_signal):
    out = tmp_path / "choices.jsonl"
    # SIGINT ignored on entry, as in a background job of a shell script: the server must still stop on it
    process = subprocess.Popen([sys.executable, "-m", "marlhf", "human-eval", "--a", str(response_files[0]),
                                "--b", str(response_files[1]), "--out", str(out), "--port", "0"],
                               cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        url = process.stdout.readline().split("open ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert "Prompt 1 of 6" in urllib.request.urlopen(url, timeout=10).read().decode()
        request = urllib.request.Request(url + "choose", data=b"index=0&side=tie", method="POST")
        assert "Prompt 2 of 6" in urllib.request.urlopen(request, timeout=10).read().decode()  # after the redirect
    finally:
        process.send_signal(stop_signal)
        remaining, _ = process.communicate(timeout=10)
    assert json.loads(remaining.strip().splitlines()[-1])["ties"] == 1
    assert json.loads(out.read_text())["choice"] == "tie"


def test_evaluate_command(tmp_path, tiny_model_dir, tiny_tokenizer, capsys):
    torch.manual_seed(0)
    ScalarHeadModel.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"Human: question {i}\n\nAssistant:"} for i in range(6)])
    assert cli.main(["evaluate", "--model_name_or_path", str(tiny_model_dir), "--reward_model", str(tmp_path / "rm"),
                     "--dataset", str(tmp_path / "eval.jsonl"), "--num_samples", "4", "--max_response_length", "4",
                     "--output_dir", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["count"] == 4  # a seeded sample of 4 of the 6 prompts
    assert json.loads(capsys.readouterr().out) == summary
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--model_name_or_path", str(tiny_model_dir)])  # no reward model: usage error


def test_evaluate_pass_at_k_on_apps_records(tmp_path, tiny_model_dir):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "apps.jsonl"
    assert cli.main(["evaluate", "--model_name_or_path", str(tiny_model_dir), "--dataset", str(fixture),
                     "--dataset_task", "apps", "--num_samples", "3", "--pass_at_k", "1", "2", "--samples_per_prompt", "2",
                     "--max_response_length", "4", "--output_dir", str(tmp_path / "apps")]) == 0
    result = json.loads((tmp_path / "apps" / "pass_at_k.json").read_text())
    assert result["all"]["num_problems"] == 3
    assert result["all"]["pass@1"] == 0.0 and result["all"]["pass@2"] == 0.0  # random weights write no program
    rows = [json.loads(line) for line in (tmp_path / "apps" / "programs.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(row["programs"]) == 2 for row in rows)
    assert sum(result[d]["num_problems"] for d in result if d != "all") == 3


def test_evaluate_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["evaluate", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(EvaluateConfig):
        assert f"--{field.name}" in text, field.name
