"""The hostile-user probes: runs that would corrupt each other, damaged checkpoints, non-finite updates,
resumes with another config, metrics files torn by a crash. Each ends in a clear error naming the file or
option, or in correct behaviour; nothing is lost."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from marlhf.checkpoint import _write_manifest, checkpoint_problem, list_checkpoints, resolve_resume
from marlhf.config import ConfigBase
from marlhf.logging_utils import MetricsLogger, read_metrics
from marlhf.modeling import load_causal_lm
from marlhf.run_lock import OutputDirLock
from marlhf.trainers.ppo import PPOConfig, train_ppo
from marlhf.trainers.sft import SFTConfig, train_sft
from tests.trainers.test_ppo import RECORDS, count_e

REPO_ROOT = Path(__file__).resolve().parents[1]


def _sft(tmp_path, **overrides) -> SFTConfig:
    values = dict(output_dir=str(tmp_path / "sft"), learning_rate=1e-2, per_device_batch_size=4, max_steps=3,
                  warmup_ratio=0.0, save_steps=1, save_total_limit=None, max_prompt_length=32, max_length=64, seed=3)
    values.update(overrides)
    return SFTConfig(**values)


@pytest.fixture
def sft_run(tmp_path, make_tiny_causal_lm, tiny_tokenizer, tiny_records):
    """An SFT output directory with checkpoint-1..3 and its metrics, and a function that trains into it."""
    def train(**overrides):
        return train_sft(_sft(tmp_path, **overrides), tiny_records["sft"], model=make_tiny_causal_lm(),
                         tokenizer=tiny_tokenizer)

    train()
    return tmp_path / "sft", train


def test_a_second_run_into_a_locked_output_dir_stops(tmp_path, make_tiny_causal_lm, tiny_tokenizer, tiny_records):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from marlhf.run_lock import OutputDirLock; "
                               "lock = OutputDirLock(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
         str(tmp_path / "sft")], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"in use by pid {holder.pid} on "):
            train_sft(_sft(tmp_path), tiny_records["sft"], model=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
        assert not list_checkpoints(tmp_path / "sft") and not (tmp_path / "sft" / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    OutputDirLock(tmp_path / "sft").release()  # the holder's death released it


def test_a_leftover_temporary_checkpoint_does_not_block_a_save(sft_run):
    output_dir, train = sft_run
    (output_dir / ".tmp-checkpoint-3.stale" / "policy").mkdir(parents=True)
    (output_dir / ".tmp-checkpoint-3.stale" / "policy" / "x").write_text("left by a crash")
    shutil.rmtree(output_dir / "checkpoint-3")
    train(resume="latest")  # re-saves step 3
    assert checkpoint_problem(output_dir / "checkpoint-3") is None
    assert not list(output_dir.glob(".tmp-checkpoint-*"))


def _damage(output_dir: Path, how: str) -> Path:
    checkpoint = output_dir / "checkpoint-3"
    if how == "deleted config.json":
        (checkpoint / "model" / "config.json").unlink()
        return checkpoint / "model" / "config.json"
    if how == "truncated weights":
        weights = checkpoint / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        return weights
    if how in ("empty trainer state", "garbage trainer state"):
        state = checkpoint / "trainer_state.json"
        state.write_text("{}" if how == "empty trainer state" else "\x00garbage")
        return state
    if how == "no manifest":  # a save that never finished
        (checkpoint / "manifest.json").unlink()
        return checkpoint / "manifest.json"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["deleted config.json", "truncated weights", "empty trainer state",
                                 "garbage trainer state", "no manifest"])
def test_a_damaged_checkpoint_is_named_and_latest_takes_the_previous_one(sft_run, how):
    output_dir, train = sft_run
    damaged = _damage(output_dir, how)
    (output_dir / "checkpoint-99").mkdir()  # empty: never a candidate
    problem = checkpoint_problem(output_dir / "checkpoint-3")
    assert problem is not None and damaged.name in problem
    skipped = []
    assert resolve_resume("latest", output_dir, report=skipped.append) == output_dir / "checkpoint-2"
    assert [line.split(":")[0] for line in skipped] == [f"skipping {output_dir / 'checkpoint-99'}",
                                                        f"skipping {output_dir / 'checkpoint-3'}"]
    with pytest.raises(ValueError, match=damaged.name):
        resolve_resume(str(output_dir / "checkpoint-3"), output_dir)
    if how == "truncated weights":  # end to end: the run resumes from checkpoint-2 and finishes
        shutil.rmtree(output_dir / "checkpoint-99")
        train(resume="latest")
        assert [m["step"] for m in read_metrics(output_dir)] == [1, 2, 3]


def test_resume_from_a_model_directory_says_so(sft_run, tiny_model_dir):
    output_dir, _ = sft_run
    with pytest.raises(ValueError, match="a model directory, not a checkpoint"):
        resolve_resume(str(tiny_model_dir), output_dir)
    with pytest.raises(ValueError, match="does not exist"):
        load_causal_lm(str(output_dir / "no-such-model"))


def test_resume_with_a_changed_config_refuses_and_keeps_the_history(sft_run):
    output_dir, train = sft_run
    first = (output_dir / "config.yaml").read_text()
    shutil.rmtree(output_dir / "checkpoint-3")
    with pytest.raises(ValueError, match=r"per_device_batch_size: 4 -> 2"):
        train(resume="latest", per_device_batch_size=2)
    # A checkpoint written before an option existed ran at the option's default.
    saved = output_dir / "checkpoint-2" / "config.yaml"
    older = yaml.safe_load(saved.read_text())
    assert older.pop("max_grad_norm") == 1.0
    saved.write_text(yaml.safe_dump(older, sort_keys=False))
    _write_manifest(output_dir / "checkpoint-2")
    with pytest.raises(ValueError, match=r"max_grad_norm: 1.0 -> 0.5"):
        train(resume="latest", max_grad_norm=0.5)
    train(resume="latest", max_steps=4)  # a longer run changes nothing that was computed
    train(resume=str(output_dir / "checkpoint-4"), max_steps=5, per_device_batch_size=2, allow_config_change=True)
    assert (output_dir / "config.yaml").read_text() == first
    assert yaml.safe_load((output_dir / "config.resume-2.yaml").read_text())["max_steps"] == 4
    assert yaml.safe_load((output_dir / "config.resume-4.yaml").read_text())["per_device_batch_size"] == 2


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside(sft_run):
    output_dir, train = sft_run
    old_three = load_file(output_dir / "checkpoint-3" / "model" / "model.safetensors")
    train(resume=str(output_dir / "checkpoint-1"), learning_rate=1e-2, allow_config_change=False, max_steps=3,
          seed=3, save_total_limit=2)
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-2", "checkpoint-3"]
    assert [p.name for p in list_checkpoints(output_dir / "superseded-after-1")] == ["checkpoint-2", "checkpoint-3"]
    assert resolve_resume("latest", output_dir) == output_dir / "checkpoint-3"  # this lineage's
    new_three = load_file(output_dir / "checkpoint-3" / "model" / "model.safetensors")
    assert all(torch.equal(old_three[k], new_three[k]) for k in old_three)  # same seed and data: same weights


def test_a_finished_run_is_not_overwritten_by_accident(sft_run, tiny_model_dir, tmp_path):
    output_dir, train = sft_run
    with pytest.raises(ValueError, match="already holds an earlier run"):
        train()
    train(overwrite_output_dir=True, max_steps=2)
    assert [p.name for p in list_checkpoints(output_dir)] == ["checkpoint-1", "checkpoint-2"]
    with pytest.raises(ValueError, match="model_name_or_path directory"):
        _sft(tmp_path, output_dir=str(tiny_model_dir), model_name_or_path=str(tiny_model_dir))
    with pytest.raises(ValueError, match="output_dir must not be empty"):
        _sft(tmp_path, output_dir="")


def test_a_torn_metrics_line_is_dropped_and_a_bad_one_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="torn last line"):
        assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    with pytest.warns(UserWarning):
        MetricsLogger(tmp_path, resume_step=2).close()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_a_failed_metrics_rewrite_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    original = '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'
    path.write_text(original)
    real_open = builtins.open

    def full_disk(file, mode="r", *args, **kwargs):
        if str(file).endswith(".tmp") and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(OSError, match="No space left"):
        MetricsLogger(tmp_path, resume_step=1)
    monkeypatch.undo()
    assert path.read_text() == original


def test_non_finite_numbers_and_huge_rewards(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    for option in ("learning_rate", "kl_coef", "temperature"):
        with pytest.raises(ValueError, match=f"{option} must be a finite number"):
            PPOConfig(**{option: float("inf")})
    with pytest.raises(ValueError, match="temperature must be >= 0.01"):
        PPOConfig(temperature=1e-45)  # logits / 1e-45 overflow
    config = PPOConfig(output_dir=str(tmp_path / "ppo"), model_name_or_path="unused", per_device_batch_size=4,
                       mini_batch_size=4, max_prompt_length=32, max_response_length=8, max_length=64, max_steps=3,
                       save_steps=1, seed=3, warmup_ratio=0.0)
    try:  # a clear error, or a finished run: never non-finite weights on disk
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer,
                  reward_fn=lambda prompts, responses: [3e38] * len(responses))
    except (ValueError, FloatingPointError) as error:
        assert "NaN or inf" in str(error)
    saved = [checkpoint / "policy" / "model.safetensors" for checkpoint in list_checkpoints(config.output_dir)]
    if (Path(config.output_dir) / "model.safetensors").exists():
        saved.append(Path(config.output_dir) / "model.safetensors")
    assert saved
    for weights in saved:
        assert all(torch.isfinite(w).all() for w in load_file(weights).values()), weights
    count_e(["p"], ["e"])  # the shared reward stays importable for the PPO tests


def test_yaml_configs_read_like_users_write_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1e-4\noutput_dir: out\n")
    assert SFTConfig.from_yaml(path).learning_rate == 1e-4
    path.write_text("learning_rate: 1e-4\nlearning_rate: 2e-4\n")
    with pytest.raises(ValueError, match="'learning_rate' is given twice"):
        SFTConfig.from_yaml(path)
    assert issubclass(SFTConfig, ConfigBase)


def test_invalid_utf8_in_a_dataset_names_the_line(tmp_path):
    from marlhf.data.records import read_rows

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not valid UTF-8"):
        read_rows(path)


def test_the_lock_is_taken_again_by_the_same_process_after_a_crash(tmp_path):
    first = OutputDirLock(tmp_path)  # never released: a run of this process that raised
    second = OutputDirLock(tmp_path)
    assert json.dumps(str(second.path))
    second.release()
    first.release()  # a no-op: the second took it over
    time.sleep(0)


def test_core_functions_on_huge_finite_inputs_name_the_problem():
    """Huge but finite inputs (3e38) overflow inside the math: an error naming what overflowed, never a silent
    NaN or inf (and kl_coef must be finite)."""
    from marlhf.advantages import kl_penalized_rewards, macro_gae
    from marlhf.losses import policy_loss, value_loss
    from marlhf.segments import fixed_ngram

    mask = torch.ones(2, 6, dtype=torch.bool)
    ids, huge, zeros = fixed_ngram(mask, 2), torch.full((2, 6), 3e38), torch.zeros(2, 6)
    with pytest.raises(ValueError, match="overflow"):
        macro_gae(huge, huge, mask, ids)
    with pytest.raises(ValueError, match="advantages too large"):
        policy_loss(zeros, zeros, huge, mask, ids)
    with pytest.raises(ValueError, match="values or returns too large"):
        value_loss(huge, huge, -huge, mask, ids)
    with pytest.raises(ValueError, match="`kl_coef` must be a finite number"):
        kl_penalized_rewards(torch.zeros(2), zeros, zeros, mask, float("nan"))
    assert torch.isfinite(macro_gae(torch.full((2, 6), 1e30), zeros, mask, ids)[0]).all()  # large is fine


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mount point (mount needs root; skipped where it cannot be made), unmounted afterwards."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode})")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True)

    yield mount_point, resize
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_a_full_disk_loses_nothing_already_saved(tmp_path, small_disk, make_tiny_causal_lm, tiny_tokenizer,
                                                 tiny_records):
    disk, resize = small_disk
    train_sft(_sft(tmp_path, output_dir=str(tmp_path / "measure"), max_steps=1), tiny_records["sft"],
              model=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
    checkpoint_bytes = sum(f.stat().st_size for f in (tmp_path / "measure" / "checkpoint-1").rglob("*") if f.is_file())
    resize(int(checkpoint_bytes * 1.6))  # room for checkpoint-1, not for checkpoint-2
    config = _sft(tmp_path, output_dir=str(disk / "sft"))
    with pytest.raises(Exception, match="No space left on device"):  # OSError, or safetensors' error saying so
        train_sft(config, tiny_records["sft"], model=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
    assert checkpoint_problem(disk / "sft" / "checkpoint-1") is None
    assert resolve_resume("latest", disk / "sft") == disk / "sft" / "checkpoint-1"
    resize(int(checkpoint_bytes * 8))
    train_sft(_sft(tmp_path, output_dir=str(disk / "sft"), resume="latest"), tiny_records["sft"],
              model=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
    assert [m["step"] for m in read_metrics(disk / "sft")] == [1, 2, 3]


def _stderr_lines(stderr: str) -> list[str]:
    """stderr's lines without the trainer's progress bar."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("sft: ")]


@pytest.mark.parametrize("stop, code, what", [  # SIGTERM's line and exit code by default: tests/test_cli.py
    (signal.SIGINT, 130, "interrupted (Ctrl-C)"),
    pytest.param(signal.SIGTERM, 143, "terminated (SIGTERM)", marks=pytest.mark.slow)])
def test_ctrl_c_says_what_was_saved_and_resume_latest_continues(tmp_path, tiny_model_dir, tiny_records, stop, code,
                                                                what):
    """SIGINT mid-training (a user's Ctrl-C) or SIGTERM (`kill PID`, a scheduler's preemption): exit 130 or 143 with
    one line naming the newest checkpoint and `--resume latest`; the same command with it continues from that
    checkpoint."""
    dataset = tmp_path / "sft.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in tiny_records["sft"]))
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "marlhf", "sft", "--model_name_or_path", str(tiny_model_dir), "--dataset",
               str(dataset), "--output_dir", str(output_dir), "--max_steps", "100000", "--save_steps", "1",
               "--per_device_batch_size", "2", "--max_prompt_length", "32", "--max_length", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # SIGINT as a terminal's Ctrl-C delivers it, also when pytest runs in a background job (which ignores it)
    child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not list(output_dir.glob("checkpoint-*/manifest.json")) and child.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
    finally:
        child.send_signal(stop)
        _, stderr = child.communicate(timeout=120)
    assert child.returncode == code, stderr[-2000:]
    lines = _stderr_lines(stderr)
    newest = list_checkpoints(output_dir)[-1]
    assert lines == [f"marlhf: error: {what}; the newest checkpoint is {newest} (step "
                     f"{newest.name.split('-')[1]}): run the same command with --resume latest to continue from it"]
    assert "Traceback" not in stderr
    step = int(newest.name.split("-")[1])
    resumed = subprocess.run([*command, "--resume", "latest", "--max_steps", str(step + 2)], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {newest} at step {step}" in resumed.stdout
    assert [m["step"] for m in read_metrics(output_dir)][-3:] == [step, step + 1, step + 2]


def test_ctrl_c_before_any_checkpoint_says_nothing_was_saved(tmp_path):
    from marlhf.trainers.common import what_was_saved

    config = _sft(tmp_path, save_steps=0)
    assert what_was_saved(config) == (f"no checkpoint was saved in {config.output_dir} (save_steps is 0): run the "
                                      "command again to start over")
    Path(config.output_dir).mkdir()
    (Path(config.output_dir) / "metrics.jsonl").write_text('{"step": 1}\n')
    assert what_was_saved(config).endswith("run the command again with --overwrite_output_dir to start over")


def test_config_files_users_save_on_windows_read_as_any_other(tmp_path):
    """CRLF line ends and a byte-order mark change nothing."""
    plain = tmp_path / "plain.yaml"
    plain.write_bytes(b"learning_rate: 1e-4\nmax_steps: 3\nlora_target_modules: [q_proj, v_proj]\n")
    for name, data in {"crlf": plain.read_bytes().replace(b"\n", b"\r\n"),
                       "bom": b"\xef\xbb\xbf" + plain.read_bytes(),
                       "bom_crlf": b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n")}.items():
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(data)
        assert SFTConfig.from_yaml(path) == SFTConfig.from_yaml(plain), name


def test_a_model_directory_without_a_tokenizer_names_the_missing_files(tmp_path, tiny_model_dir):
    from marlhf.errors import MarlhfError
    from marlhf.modeling import load_tokenizer

    model_only = tmp_path / "model_only"
    model_only.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / file, model_only / file)
    with pytest.raises(MarlhfError, match=rf"no tokenizer files in {model_only} \(it holds config.json, "
                                          r"model.safetensors; a tokenizer is tokenizer.json, or tokenizer_config"):
        load_tokenizer(str(model_only))
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(tiny_model_dir, checkpoint / "policy")
    with pytest.raises(MarlhfError, match=rf"did you mean {checkpoint / 'policy'}\?"):
        load_tokenizer(str(checkpoint))
    assert load_tokenizer(str(checkpoint / "policy")).pad_token == "<pad>"
