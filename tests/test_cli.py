from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch
import yaml

from marlhf import cli
from marlhf.logging_utils import read_metrics
from tests.hub_cache import UNREACHABLE_HUB, offline_env, put_in_datasets_cache, put_in_hub_cache
from tests.sweeps import sweep

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", ["sft", "reward", "dpo", "ppo"])
def test_help_lists_every_option_with_its_default(command, capsys):
    module_name, config_name, _, _ = cli.COMMANDS[command]
    config_class = getattr(pytest.importorskip(module_name), config_name)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "--config" in text
    for field in dataclasses.fields(config_class):
        assert f"--{field.name}" in text, field.name
        default = " ".join(map(str, field.default)) if isinstance(field.default, tuple) else str(field.default)
        assert f"(default: {default})" in text, field.name


def test_bad_option_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["dpo", "--beta", "0"])
    assert exit_info.value.code == 2
    assert "beta must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["sft", "--no_such_option", "1"])
    with pytest.raises(SystemExit):
        cli.main([])
    assert cli.main(["demo", "--methods", "foo"]) == 2
    assert "marlhf: error: demo: methods[0] must be one of" in capsys.readouterr().err
    assert cli.main(["demo", "--seeds", "-1"]) == 2  # was numpy's 'Seed must be between...' after the demo started
    assert capsys.readouterr().err.startswith("marlhf: error: demo: seeds must be 0 to 2**32 - 1, got (-1,)")


def test_sft_from_yaml_and_flags_end_to_end(tmp_path, tiny_model_dir, tiny_records):
    dataset = tmp_path / "sft.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))
    config_file = tmp_path / "sft.yaml"
    config_file.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset": str(dataset),
                                           "max_steps": 50, "per_device_batch_size": 4, "max_prompt_length": 32,
                                           "max_length": 64, "save_steps": 0}))
    output_dir = tmp_path / "run"
    assert cli.main(["sft", "--config", str(config_file), "--max_steps", "2", "--output_dir", str(output_dir)]) == 0
    assert [m["step"] for m in read_metrics(output_dir)] == [1, 2]  # the flag overrode the file
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    assert saved["max_steps"] == 2 and saved["dataset"] == str(dataset)
    assert (output_dir / "model.safetensors").exists()


def test_python_dash_m_marlhf():
    result = subprocess.run([sys.executable, "-m", "marlhf", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("sft", "reward", "dpo", "ppo"))


def test_the_libraries_are_quiet_unless_verbose(monkeypatch, tmp_path, tiny_model_dir, tiny_records):
    import warnings

    import transformers.utils.logging as transformers_logging

    from marlhf.cli import main

    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
                 "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))
    argv = ["sft", "--model_name_or_path", str(tiny_model_dir), "--dataset", str(records), "--max_steps", "1",
            "--save_steps", "0", "--max_prompt_length", "32", "--max_length", "64"]
    transformers_logging.enable_progress_bar()  # as a fresh process has it (earlier tests ran main quietly)
    with warnings.catch_warnings():
        try:
            assert main(["--verbose", *argv, "--output_dir", str(tmp_path / "loud")]) == 0
            assert transformers_logging.is_progress_bar_enabled()
            assert main([*argv, "--output_dir", str(tmp_path / "quiet")]) == 0
            assert not transformers_logging.is_progress_bar_enabled()
            assert transformers_logging.get_verbosity() == transformers_logging.ERROR
            assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
            assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
            deepspeed_logger = logging.getLogger("DeepSpeed")
            assert not deepspeed_logger.filter(logging.makeLogRecord({"levelno": logging.WARNING}))
            assert deepspeed_logger.filter(logging.makeLogRecord({"levelno": logging.ERROR}))
        finally:
            transformers_logging.enable_progress_bar()
            transformers_logging.set_verbosity_warning()


@pytest.mark.slow  # three trainings in child processes; by default: the sft stage's, in the test below
def test_hub_ids_load_offline_from_the_cache(tmp_path, tiny_model_dir, tiny_records):
    """`marlhf sft` then `marlhf reward` and `marlhf ppo` with org/name ids, as on a GPU box whose cache holds the
    models: HF_HUB_OFFLINE=1, nothing downloaded."""
    hf_home = tmp_path / "hf_home"
    put_in_hub_cache(hf_home / "hub", "tiny-org/tiny-llama", tiny_model_dir)
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))
    rm = tmp_path / "rm.jsonl"
    rm.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["rm"]))
    env = offline_env(hf_home)
    short = ["--max_steps", "1", "--save_steps", "0", "--per_device_batch_size", "4", "--max_prompt_length", "32",
             "--max_length", "64"]

    def marlhf(*arguments):
        child = subprocess.run([sys.executable, "-m", "marlhf", *arguments], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
        assert child.returncode == 0, child.stderr[-3000:]

    marlhf("sft", "--model_name_or_path", "tiny-org/tiny-llama", "--dataset", str(sft), "--output_dir", "sft", *short)
    put_in_hub_cache(hf_home / "hub", "tiny-org/tiny-sft", tmp_path / "sft")
    marlhf("reward", "--model_name_or_path", "tiny-org/tiny-sft", "--dataset", str(rm), "--output_dir", "rm",
           "--eval_fraction", "0", *short)
    put_in_hub_cache(hf_home / "hub", "tiny-org/tiny-rm", tmp_path / "rm")
    marlhf("ppo", "--model_name_or_path", "tiny-org/tiny-sft", "--reward_model_name_or_path", "tiny-org/tiny-rm",
           "--dataset", str(rm), "--output_dir", "ppo", "--mini_batch_size", "4", "--max_response_length", "8",
           *short)
    assert [m["step"] for m in read_metrics(tmp_path / "ppo")] == [1]


def test_hub_dataset_id_loads_offline_from_the_datasets_cache(tmp_path, tiny_model_dir):
    """`marlhf sft --dataset Dahoas/full-hh-rlhf` offline, as on a GPU box where an earlier online run cached the
    model and the dataset: the Arrow cache `datasets` wrote (full-size splits, so the row-count check passes
    unpatched) serves the id; HF_ENDPOINT is unroutable, so a network attempt fails rather than hangs.
    The reward/RL stages and a missing cache: tests/data/test_loading.py (in-process, faster)."""
    from marlhf.data import TASKS
    from marlhf.data.records import read_rows

    hf_home = tmp_path / "hf_home"
    put_in_hub_cache(hf_home / "hub", "tiny-org/tiny-llama", tiny_model_dir)
    fixture = read_rows(REPO_ROOT / "tests" / "fixtures" / "hh_rlhf.jsonl")
    sizes = TASKS["hh"].expected_rows  # {"train": 112052, "test": 12451}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    put_in_datasets_cache(hf_home / "datasets", "Dahoas/full-hh-rlhf",
                          {split: [fixture[i % len(fixture)] for i in range(n)] for split, n in sizes.items()}, scratch)
    child = subprocess.run(
        [sys.executable, "-m", "marlhf", "sft", "--model_name_or_path", "tiny-org/tiny-llama", "--dataset",
         "Dahoas/full-hh-rlhf", "--max_samples", "8", "--output_dir", "sft", "--max_steps", "1", "--save_steps", "0",
         "--per_device_batch_size", "4", "--max_prompt_length", "32", "--max_length", "64"],
        env=offline_env(hf_home), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "sft")] == [1]


def _fails_in_one_line(tmp_path, *arguments, env=None) -> str:
    """Run `marlhf ARGUMENTS` in a child; it must exit 2 with one line on stderr and no traceback. Returns it."""
    child = subprocess.run([sys.executable, "-m", "marlhf", *arguments], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env=env or {**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in child.stderr.splitlines() if line.strip()]
    assert child.returncode == 2, child.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("marlhf: error: ") and "Traceback" not in child.stderr, lines
    return lines[0]


def test_expected_failures_are_one_line_errors_with_exit_2(tmp_path, tiny_model_dir, tiny_records, capsys,
                                                           monkeypatch):
    """In this process (each child process costs seconds of start-up); a child's stderr as the shell shows it:
    test_invalid_yaml_from_the_shell_is_one_line_with_exit_2 and the Hub tests below."""
    monkeypatch.chdir(tmp_path)
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))
    short = ["--dataset", str(sft), "--max_steps", "1", "--per_device_batch_size", "2", "--max_prompt_length", "32",
             "--max_length", "64", "--save_steps", "1"]

    def fails(*argv: str) -> str:
        code, line = _one_line_exit(capsys, list(argv))
        assert code == 2, line
        return line

    assert "model path" in fails("sft", "--model_name_or_path", str(tmp_path / "nothing"), *short)
    assert "does not exist" in fails("sft", "--model_name_or_path", str(tiny_model_dir), "--dataset", "missing.jsonl")
    no_response = tmp_path / "bad.jsonl"
    no_response.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert "'response'" in fails("sft", "--model_name_or_path", str(tiny_model_dir), "--dataset", str(no_response))
    run = ["sft", "--model_name_or_path", str(tiny_model_dir), "--output_dir", "out", *short]
    assert cli.main(run) == 0
    capsys.readouterr()
    assert "already holds an earlier run" in fails(*run)
    for checkpoint in (tmp_path / "out").glob("checkpoint-*"):
        (checkpoint / "trainer_state.json").write_text("")  # damaged
    line = fails(*run, "--resume", "latest")
    assert "no complete checkpoint" in line and "skipping" in line and "checkpoint-1" in line
    (tmp_path / "empty").mkdir()
    assert "metrics.jsonl" in fails("plot", "empty", "--out", "plots")
    assert "did you mean '--learning_rate'" in fails("sft", "--learnig_rate", "1e-5")
    assert "--learning_rat " in fails("sft", "--learning_rat", "1e-5") + " "  # no prefixes
    (tmp_path / "typo.yaml").write_text("learnig_rate: 0.1\n")
    assert "did you mean 'learning_rate'" in fails("sft", "--config", "typo.yaml")


@pytest.mark.parametrize("offline", sweep(["1", ""]))  # unreachable, in this process: the test after this one
def test_a_hub_id_without_network_fails_fast_in_one_line(tmp_path, tiny_records, offline):
    """Offline, or online with the Hub unreachable (HF_ENDPOINT at a closed local port): seconds, not the download's
    retries, and the line names the id and where the cache is."""
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))
    env = {**offline_env(tmp_path / "hf_home"), "HF_HUB_OFFLINE": offline}
    line = _fails_in_one_line(tmp_path, "sft", "--model_name_or_path", "not-a-user/not-a-model", "--dataset",
                              "sft.jsonl", env=env)
    assert "'not-a-user/not-a-model'" in line and "HF_HOME" in line
    assert ("HF_HUB_OFFLINE is set" if offline else "unreachable") in line


def test_the_hub_check_takes_seconds_not_the_downloads_retries(monkeypatch, tmp_path):
    """The check itself, in this process (a child's start-up time depends on the machine's load)."""
    import huggingface_hub.constants as hub

    from marlhf.errors import MarlhfError
    from marlhf.modeling import check_model_path

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", UNREACHABLE_HUB)
    monkeypatch.setattr(hub, "HUGGINGFACE_CO_URL_TEMPLATE", UNREACHABLE_HUB + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    started = time.perf_counter()
    with pytest.raises(MarlhfError, match="unreachable"):
        check_model_path("not-a-user/not-a-model")
    assert time.perf_counter() - started < 15


def test_verbose_shows_the_traceback(tmp_path):
    """Through the `marlhf` console script that `pip install` put beside this Python (test_python_dash_m_marlhf
    starts the module)."""
    command = Path(sys.executable).with_name("marlhf")
    assert command.is_file(), f"no console script {command}: install the project (pip install -e '.[test]')"
    child = subprocess.run([str(command), "--verbose", "plot", "nowhere", "--out", "p"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert child.returncode != 0 and "Traceback" in child.stderr


def _one_line_exit(capsys, argv: list[str]) -> tuple[int, str]:
    """Run `marlhf ARGV` in this process: (exit code, its one stderr line); no traceback."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("marlhf: error: ") and "Traceback" not in err, err[-3000:]
    return code, lines[0]


@pytest.mark.parametrize("name, data, says", [
    ("tab.yaml", b"learning_rate: 1e-4\n\tmax_steps: 3\n", "line 2, column 1: found character '\\t' that cannot start"),
    ("bracket.yaml", b"lora_target_modules: [q_proj, v_proj\nmax_steps: 3\n", "line 2, column 10: expected ',' or ']'"),
    ("list.yaml", b"- max_steps: 3\n", "must hold a mapping of option: value"),
    ("empty.yaml", b"", "holds no options (it is empty or only comments)"),
    ("latin1.yaml", b"max_steps: 3\nrun_name: caf\xe9\n", "line 2: byte 0xe9 is not UTF-8; save the file as UTF-8"),
    ("twice.yaml", b"max_steps: 3\nmax_steps: 4\n", "line 2: option 'max_steps' is given twice"),
    ("numbers.yaml", b"1: 2\n", "option names are words, got 1"),
    ("a_directory", None, "is a directory: --config takes a YAML file"),
    ("missing.yaml", None, "does not exist: check the --config path"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, capsys, name, data, says):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    elif name == "a_directory":
        path.mkdir()
    code, line = _one_line_exit(capsys, ["sft", "--config", str(path)])
    assert code == 2
    assert line.startswith(f"marlhf: error: sft: config file {path}") and says in line, line


def test_invalid_yaml_from_the_shell_is_one_line_with_exit_2(tmp_path):
    (tmp_path / "bad.yaml").write_text("max_steps: [1\n")
    line = _fails_in_one_line(tmp_path, "sft", "--config", "bad.yaml")
    assert "config file bad.yaml, line 2, column 1" in line and "fix the YAML" in line


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_switch_takes_true_and_false_as_in_yaml(command):
    """`--flag`, `--flag true`, `--flag false` for every bool option of every config command."""
    module_name, config_name, _, _ = cli.COMMANDS[command]
    config_class = getattr(pytest.importorskip(module_name), config_name)
    hints = typing.get_type_hints(config_class)
    switches = [f.name for f in dataclasses.fields(config_class) if hints[f.name] is bool]  # evaluate has none
    parser = cli.build_parser(command)
    for name in switches:
        for words, value in (([], True), (["true"], True), (["false"], False), (["no"], False), (["1"], True)):
            assert getattr(cli._parse(parser, [command, f"--{name}", *words]), name) is value, (name, words)


def test_a_switch_from_the_docs_parses_and_a_bad_word_is_one_line(capsys):
    from marlhf.trainers.ppo import PPOConfig

    parser = cli.build_parser("ppo")
    assert PPOConfig.from_arguments(cli._parse(parser, ["ppo", "--log_rollout_logprob_diff", "true"])
                                    ).log_rollout_logprob_diff is True
    assert PPOConfig.from_arguments(cli._parse(parser, ["ppo", "--log_rollout_logprob_diff", "false"])
                                    ).log_rollout_logprob_diff is False
    code, line = _one_line_exit(capsys, ["ppo", "--log_rollout_logprob_diff", "maybe"])
    assert code == 2
    assert line.startswith("marlhf: error: ppo: argument --log_rollout_logprob_diff: expects true or false"), line


def test_a_bug_keeps_its_traceback_and_asks_for_a_report(monkeypatch, tmp_path, capsys):
    from marlhf.evaluation import plots

    def broken(*args, **kwargs):
        raise TypeError("a bug in marlhf")

    monkeypatch.setattr(plots, "plot_diagnostics", broken)
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "TypeError: a bug in marlhf" in err
    assert err.splitlines()[-1] == ("marlhf: error: this is a bug in marlhf (TypeError), not in your input; please "
                                    "report it with the output of the same command run with --verbose")


@pytest.mark.parametrize("raised, code, says", [
    (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1 GiB"), 4,
     "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB): lower per_device_batch_size (4) or max_length "
     "(64), or set gradient_checkpointing"),
    (lambda: MemoryError(), 4, "out of memory (MemoryError): lower per_device_batch_size (4)"),
    (lambda: ModuleNotFoundError("No module named 'spacy'", name="spacy"), 3,
     "this needs the Python package 'spacy', which is not installed here: pip install 'marlhf[nlp]'"),
    (KeyboardInterrupt, 130, "interrupted (Ctrl-C); no checkpoint was saved in"),
])
def test_the_environments_failures_have_their_exit_codes(monkeypatch, tmp_path, tiny_model_dir, capsys, raised, code,
                                                         says):
    from marlhf.trainers import sft

    def train(config):
        raise raised()

    monkeypatch.setattr(sft, "train_sft", train)
    got, line = _one_line_exit(capsys, ["sft", "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                                        str(tmp_path / "out"), "--per_device_batch_size", "4",
                                        "--max_prompt_length", "32", "--max_length", "64"])
    assert got == code and says in line, line


def test_sigterm_stops_a_trainer_as_ctrl_c_does_and_gives_the_handler_back(monkeypatch, tmp_path, tiny_model_dir,
                                                                           capsys):
    """`kill PID` mid-training: the Ctrl-C path (what was saved, how to resume) with exit 143; the handler that was
    installed before the command is installed again afterwards."""
    import signal

    from marlhf.trainers import sft

    def train(config):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal's handler runs at the next bytecode: this never finishes

    def callers_handler(signum, frame):
        raise AssertionError("the caller's handler ran during the command")

    monkeypatch.setattr(sft, "train_sft", train)
    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        code, line = _one_line_exit(capsys, ["sft", "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                                             str(tmp_path / "out")])
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143
    assert line.startswith("marlhf: error: terminated (SIGTERM); no checkpoint was saved in"), line


def test_evaluate_on_a_model_without_tokenizer_files_names_them(tmp_path, tiny_model_dir, capsys):
    model_only = tmp_path / "model_only"
    model_only.mkdir()
    for file in ("config.json", "model.safetensors"):
        (model_only / file).write_bytes((tiny_model_dir / file).read_bytes())
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "Human: hi\n\nAssistant:"}) + "\n")
    code, line = _one_line_exit(capsys, ["evaluate", "--model_name_or_path", str(model_only), "--reward_model",
                                         str(tiny_model_dir), "--dataset", str(tmp_path / "eval.jsonl"),
                                         "--output_dir", str(tmp_path / "out")])
    assert code == 2 and f"no tokenizer files in {model_only}" in line and "tokenizer.json" in line, line


@pytest.mark.parametrize("argv", [["plot", "{run}", "--out", "{file}"], ["plot", "{run}", "--out", "{file}/plots"],
                                  ["demo", "--quick", "--out", "{file}"]])
def test_an_output_directory_where_a_file_is_is_one_line(tmp_path, capsys, argv):
    """Was 'File exists: PATH' / 'Not a directory: PATH', which named no cause."""
    run, file = tmp_path / "run", tmp_path / "taken"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "objective/rm_score": 0.1}) + "\n")
    file.write_text("x")
    argv = [part.format(run=run, file=file) for part in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"marlhf: error: cannot make the directory {argv[-1]}: a file is in "
                                               "the way"), err
    assert file.read_text() == "x"
