"""Pieces every trainer loop shares: run setup, data order, optimiser and schedule (the encoding of
records into token ids is marlhf.data.encoding).

API:
    accelerator = make_accelerator(config)                  # Accelerator + seeded python/numpy/torch RNGs
    records = records_from_config(config, stage)            # marlhf.data.load_records(config.dataset, ...)
    start_step, logger = start_run(config, accelerator, models, optimizers, schedulers)
        # locks output_dir (marlhf.run_lock), resumes from config.resume (the newest complete checkpoint;
        # restoring models/optimizers/schedulers/RNG; meaning-changing option changes refused), records the
        # config, opens the MetricsLogger (its close() releases the lock); start_step = optimizer steps done.
        # ValueError when output_dir holds an earlier run and neither resume nor overwrite_output_dir is set.
    plan = BatchPlan(num_records, config, accelerator)      # deterministic order: epoch e shuffled by seed + e
    plan.total_steps; plan.epoch_at(step); plan.pieces(step) -> this process's index lists
    optimizer = make_optimizer(model, config); scheduler = make_scheduler(optimizer, config, plan.total_steps)
    maybe_save_checkpoint(config, step, accelerator, models, optimizers, schedulers, tokenizer)
    what_was_saved(config) -> str   # the end of the Ctrl-C line (marlhf.cli): newest checkpoint, how to continue
    save_final_model(model, tokenizer, directory, accelerator)
    accumulation_context(accelerator, model, is_last_piece)
    configure_deepspeed(accelerator, config, piece_size)  # before accelerator.prepare; no-op unless DeepSpeed
    backward(accelerator, model, loss, is_last_piece)  # accelerator.backward, or the model's own engine's
    guard = FiniteUpdates(config.nonfinite_skip_limit)    # skips optimizer steps with a NaN/inf gradient norm
    grad_norm, learning_rate = optimizer_step(accelerator, model, optimizer, scheduler, max_grad_norm, guard)
    model = train_supervised(config, accelerator, model, tokenizer, examples, collate, loss_fn, desc)
        # the loop SFT, reward modelling and DPO share: each gives its batch collation and its loss

A step is one optimizer step over per_device_batch_size x gradient_accumulation_steps x num_processes
records. The record order depends only on (seed, epoch), so a resumed run sees exactly the batches the
uninterrupted run would have seen.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, parse_flag_from_env, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from marlhf.checkpoint import (MANIFEST, checkpoint_step, list_checkpoints, load_checkpoint, resolve_resume,
                               save_checkpoint)
from marlhf.envs.datasets import library_records
from marlhf.logging_utils import METRICS_FILE, MetricsLogger, reduce_metrics
from marlhf.modeling import merge_lora
from marlhf.run_config import RunConfig, TrainingConfig
from marlhf.run_lock import OutputDirLock


def make_accelerator(config: RunConfig) -> Accelerator:
    # cpu=True on machines without an accelerator lets `accelerate launch`/torchrun run multi-process on CPU.
    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=not torch.accelerator.is_available())
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and accelerator.distributed_type != DistributedType.FSDP:
        # Accelerate turns FSDP on only in distributed runs on GPUs (or NPUs, ...) and otherwise runs unsharded
        # without a word: on a CPU-only machine `accelerate launch --config_file fsdp.yaml` gives DDP.
        raise ValueError(f"the launch asks for FSDP (ACCELERATE_USE_FSDP=true) but Accelerate set up "
                         f"{accelerator.distributed_type.value} ({accelerator.num_processes} process(es)): it shards "
                         "with FSDP only in distributed runs on GPUs (or other accelerators), not on CPUs; launch "
                         "with configs/accelerate/ddp.yaml to train unsharded")
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise ValueError(f"the launch asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but Accelerate set up "
                         f"{accelerator.distributed_type.value} ({accelerator.num_processes} process(es)): it runs "
                         "DeepSpeed only on GPUs (or other accelerators), not on CPUs; launch with "
                         "configs/accelerate/ddp.yaml to train unsharded")
    if accelerator.distributed_type == DistributedType.FSDP and getattr(config, "use_lora", False):
        # Seen on CPU under FSDP2: peft's generate mixes sharded and plain tensors, and merging the adapters
        # into a copy of the sharded model fails.
        raise ValueError("use_lora does not work under FSDP yet: train LoRA adapters with DDP "
                         "(configs/accelerate/ddp.yaml), or train all weights under FSDP")
    set_seed(config.seed)
    return accelerator


def records_from_config(config: TrainingConfig, stage: str, env: str | None = None) -> list[dict[str, Any]]:
    """The records of config.dataset for `stage`; `env`: the environment whose episodes they are the tasks of (a
    SkyRL-Gym environment reads SkyRL's dataset files)."""
    if config.dataset is None:
        raise ValueError("dataset is required when no records are passed in")
    records = library_records(config.dataset, stage, env=env, seed=config.seed, max_samples=config.max_samples)
    if records is not None:
        return records
    from marlhf.data import load_records  # imported here: the trainers' Python API works without it

    return load_records(config.dataset, stage, task=config.dataset_task, seed=config.seed,
                        max_samples=config.max_samples, webgpt_ties=config.webgpt_ties)


# Options a resumed run may change without changing what the run computes (the rest need allow_config_change).
RESUMABLE_CHANGES = frozenset({"output_dir", "resume", "overwrite_output_dir", "allow_config_change", "logging_steps",
                               "save_steps", "save_total_limit", "report_to", "tracker_project", "run_name",
                               "max_steps", "forward_batch_size"})


def start_run(config: RunConfig, accelerator: Accelerator, models: dict[str, torch.nn.Module],
              optimizers: dict[str, torch.optim.Optimizer], schedulers: dict[str, Any]) -> tuple[int, MetricsLogger]:
    """Lock output_dir for this run, resume if asked, record the config, open the metrics logger. Call after
    accelerator.prepare; `logger.close()` releases the lock.

    Resume takes the newest complete checkpoint (`latest`, naming the ones it skips) or the one named, refuses
    option changes that alter the run's meaning unless allow_config_change, keeps the first launch's config.yaml
    and writes config.resume-<step>.yaml, and moves checkpoints newer than the one resumed aside (so `latest`
    stays this lineage's). A fresh run refuses a directory that holds an earlier run unless
    overwrite_output_dir."""
    output_dir = Path(config.output_dir)
    lock = _on_main_process(accelerator, lambda: _lock_output_dir(output_dir))
    try:
        # The main process checks the candidates' manifests (reading every file once, not once per process).
        checkpoint = _on_main_process(accelerator, lambda: resolve_resume(config.resume, output_dir),
                                      share_result=True)
        if checkpoint is None:
            _start_fresh(config, output_dir, accelerator)
        else:
            _continue_lineage(config, checkpoint, output_dir, accelerator)
        start_step = 0
        if checkpoint is not None:
            start_step = load_checkpoint(checkpoint, models, optimizers, schedulers, accelerator)["step"]
            accelerator.print(f"resumed from {checkpoint} at step {start_step}")
        logger = MetricsLogger(output_dir, config.report_to, accelerator.is_main_process,
                               resume_step=start_step if checkpoint is not None else None, lock=lock,
                               run_config=config.to_dict(), project=config.tracker_project, run_name=config.run_name)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return start_step, logger


def _on_main_process(accelerator: Accelerator, work, share_result: bool = False):
    """`work()` on the main process only. A ValueError there is raised on every process; with `share_result`
    every process gets the (picklable) result, else the others get None."""
    outcome = [None, None]  # result, error message
    if accelerator.is_main_process:
        try:
            outcome[0] = work()
        except ValueError as error:
            outcome[1] = str(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        shared = [outcome[0] if share_result else None, outcome[1]]
        broadcast_object_list(shared)  # in place
        outcome = [outcome[0] if accelerator.is_main_process else shared[0], shared[1]]
    if outcome[1] is not None:
        raise ValueError(outcome[1])
    return outcome[0]


def _lock_output_dir(output_dir: Path) -> OutputDirLock:
    """Lock output_dir for this run and clear the temporary files of crashed runs (they hold no lock)."""
    lock = OutputDirLock(output_dir)
    for leftover in [*output_dir.glob(".tmp-checkpoint-*"), output_dir / FINAL_MODEL_TMP]:
        shutil.rmtree(leftover, ignore_errors=True)
    return lock


def _earlier_run(output_dir: Path) -> list[str]:
    """What of an earlier run `output_dir` holds (empty: a fresh run may start there)."""
    return [what for what, there in (
        ("checkpoints", list_checkpoints(output_dir)),
        ("metrics.jsonl", (output_dir / METRICS_FILE).is_file() and (output_dir / METRICS_FILE).stat().st_size),
        ("a final model", (output_dir / "config.json").is_file())) if there]


def what_was_saved(config: RunConfig) -> str:
    """The end of the line of a run stopped by Ctrl-C: its newest finished checkpoint and how to continue, or how
    to start again. A checkpoint counts when its manifest (written last) is there; `--resume latest` then checks
    every file, without the wait of hashing them here."""
    output_dir = Path(config.output_dir)
    finished = [checkpoint for checkpoint in list_checkpoints(output_dir) if (checkpoint / MANIFEST).is_file()]
    if finished:
        return (f"the newest checkpoint is {finished[-1]} (step {checkpoint_step(finished[-1])}): run the same command "
                "with --resume latest to continue from it")
    again = " with --overwrite_output_dir" if _earlier_run(output_dir) else ""
    never = " (save_steps is 0)" if not config.save_steps else ""
    return f"no checkpoint was saved in {output_dir}{never}: run the command again{again} to start over"


def _start_fresh(config: RunConfig, output_dir: Path, accelerator: Accelerator) -> None:
    earlier = _earlier_run(output_dir)
    if earlier and not config.overwrite_output_dir:
        # A fresh run would mix its checkpoints with the old ones (and keep-last-K could delete the new ones).
        raise ValueError(f"output_dir {output_dir} already holds an earlier run ({', '.join(earlier)}): resume it "
                         "(resume: latest), choose another output_dir, or set overwrite_output_dir")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for checkpoint in list_checkpoints(output_dir):
            shutil.rmtree(checkpoint)
        for old in output_dir.glob("config.resume-*.yaml"):
            old.unlink()
        config.save_yaml(output_dir / "config.yaml")
    accelerator.wait_for_everyone()


def _continue_lineage(config: RunConfig, checkpoint: Path, output_dir: Path, accelerator: Accelerator) -> None:
    saved = checkpoint / "config.yaml"
    before = yaml.safe_load(saved.read_text()) if saved.is_file() else None
    if before is None:
        raise ValueError(f"{checkpoint} holds no config.yaml, so a resume cannot check what changed")
    now = config.to_dict()
    # An option the checkpoint's version did not have ran at its default; one renamed since is read by its new name.
    defaults = type(config).option_defaults()
    before = type(config).as_written(before)
    before = {name: before.get(name, defaults.get(name)) for name in now}
    changed = sorted(name for name in now if name not in RESUMABLE_CHANGES and before[name] != now[name])
    if changed and not config.allow_config_change:
        details = "; ".join(f"{name}: {before[name]!r} -> {now[name]!r}" for name in changed)
        raise ValueError(f"resuming {checkpoint} with options that change the run ({details}): keep them, or set "
                         "allow_config_change")
    step = checkpoint_step(checkpoint)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if not (output_dir / "config.yaml").is_file():
            (output_dir / "config.yaml").write_text(saved.read_text())
        config.save_yaml(output_dir / f"config.resume-{step if step is not None else checkpoint.name}.yaml")
        if checkpoint.parent.resolve() == output_dir.resolve() and step is not None:
            newer = [c for c in list_checkpoints(output_dir) if checkpoint_step(c) > step]
            if newer:
                aside = output_dir / f"superseded-after-{step}"
                aside.mkdir(exist_ok=True)
                for path in newer:
                    path.rename(aside / path.name)
                accelerator.print(f"resuming {checkpoint.name}: moved the newer {', '.join(p.name for p in newer)} "
                                  f"to {aside}, so that 'latest' is this run's")
    accelerator.wait_for_everyone()


def maybe_save_checkpoint(config: RunConfig, step: int, accelerator: Accelerator,
                          models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer],
                          schedulers: dict[str, Any], tokenizer=None) -> None:
    """Checkpoint after optimizer step `step` (1-based count of steps done) when save_steps says so."""
    if config.save_steps and step % config.save_steps == 0:
        save_checkpoint(config.output_dir, step, models, optimizers, schedulers, tokenizer=tokenizer,
                        save_total_limit=config.save_total_limit, accelerator=accelerator,
                        config_yaml=config.to_yaml())


FINAL_MODEL_TMP = ".tmp-final-model"


def save_final_model(model: torch.nn.Module, tokenizer, directory: str | Path, accelerator: Accelerator) -> None:
    """Write the model and tokenizer into `directory`: first into a temporary folder, then each file renamed
    into place with config.json last, so a crash never leaves a config.json beside partial weights."""
    accelerator.wait_for_everyone()
    # Collective: under FSDP each process holds a shard of the weights, gathered here into the main process's copy.
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        directory = Path(directory)
        tmp = directory / FINAL_MODEL_TMP
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for file in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(file, directory / file.name)
        tmp.rmdir()
    accelerator.wait_for_everyone()


class BatchPlan:
    """Which records each process uses at each optimizer step."""

    def __init__(self, num_records: int, config: TrainingConfig, accelerator: Accelerator,
                 accumulation: int | None = None) -> None:
        """`accumulation`: pieces per optimizer step (None: config.gradient_accumulation_steps)."""
        self.num_records = num_records
        self.seed = config.seed
        self.piece_size = config.per_device_batch_size
        self.accumulation = config.gradient_accumulation_steps if accumulation is None else accumulation
        self.process_index = accelerator.process_index
        self.num_processes = accelerator.num_processes
        self.records_per_step = self.piece_size * self.accumulation * self.num_processes
        self.steps_per_epoch = num_records // self.records_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(f"{num_records} records are fewer than one optimizer step needs "
                             f"({self.records_per_step} = per_device_batch_size x gradient_accumulation_steps "
                             "x processes)")
        self.total_steps = config.max_steps or math.ceil(config.num_epochs * self.steps_per_epoch)

    def epoch_at(self, step: int) -> float:
        return step / self.steps_per_epoch

    def pieces(self, step: int) -> list[list[int]]:
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.num_records, generator=torch.Generator().manual_seed(self.seed + epoch))
        start = step_in_epoch * self.records_per_step
        batches = []
        for piece in range(self.accumulation):
            offset = start + (piece * self.num_processes + self.process_index) * self.piece_size
            batches.append(order[offset:offset + self.piece_size].tolist())
        return batches


def make_optimizer(model: torch.nn.Module, config: TrainingConfig,
                   learning_rate: float | None = None) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, at config.learning_rate unless `learning_rate` is given."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    lr = config.learning_rate if learning_rate is None else learning_rate
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=config.weight_decay,
                             betas=(config.adam_beta1, config.adam_beta2))


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainingConfig, total_steps: int):
    warmup_steps = config.warmup_steps if config.warmup_steps is not None else math.ceil(config.warmup_ratio * total_steps)
    # The option names the schedule after warmup; transformers' plain "constant" would skip the warmup.
    name = "constant_with_warmup" if config.lr_scheduler == "constant" else config.lr_scheduler
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    # A run drawn out past its plan (PPO's min_generated_tokens) keeps the schedule's last learning rate: cosine's
    # formula would otherwise rise again after its end.
    scheduler.lr_lambdas = [functools.partial(_held_after, schedule, total_steps) for schedule in scheduler.lr_lambdas]
    return scheduler


def _held_after(schedule, total_steps: int, step: int) -> float:
    return schedule(min(step, total_steps))


def accumulation_context(accelerator: Accelerator, model: torch.nn.Module, is_last_piece: bool):
    """Skip the gradient all-reduce on all but the last piece of an optimizer step."""
    return contextlib.nullcontext() if is_last_piece else accelerator.no_sync(model)


def configure_deepspeed(accelerator: Accelerator, config: TrainingConfig, piece_size: int) -> None:
    """Under DeepSpeed, before accelerator.prepare: give its config the piece size (its micro-batch size) that
    Accelerate takes from a prepared dataloader (marlhf batches by itself), and refuse what does not work there yet."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    if config.save_steps or config.resume:
        # ZeRO partitions the optimizer states over the processes; a checkpoint would hold one process's part.
        raise ValueError("checkpoints and resume do not work under DeepSpeed yet (ZeRO partitions the optimizer "
                         "states over the processes): set save_steps 0 and no resume, or train under DDP "
                         "(configs/accelerate/ddp.yaml) or FSDP (fsdp.yaml), which checkpoint and resume")
    plugin = accelerator.state.deepspeed_plugin
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = piece_size


def backward(accelerator: Accelerator, model: torch.nn.Module, loss: torch.Tensor, is_last_piece: bool) -> None:
    """accelerator.backward(loss), except under DeepSpeed: there Accelerate sends every backward to the engine
    prepared first and steps it at once, so each model's own engine (PPO: policy and critic) runs its backward
    here and steps in optimizer_step, after the optimizer step's last piece."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        model.set_gradient_accumulation_boundary(is_last_piece)
        model.backward(loss, scale_wrt_gas=False)  # the trainers scale their losses for accumulation themselves
    else:
        accelerator.backward(loss)


class FiniteUpdates:
    """The finite-update guard: an optimizer step whose gradient norm is NaN or inf is skipped (the weights and
    optimizer state stay as they were, so nothing non-finite is ever saved) and counted; more than `limit` in a
    row stop the run. Its check is the one device read of an optimizer step."""

    def __init__(self, limit: int) -> None:
        self.limit, self.skipped, self.in_a_row = limit, 0, 0

    def allows(self, grad_norm: torch.Tensor) -> bool:
        if bool(torch.isfinite(grad_norm)):
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > self.limit:
            raise FloatingPointError(
                f"{self.in_a_row} optimizer steps in a row had a NaN or inf gradient norm (a loss or reward out of "
                f"range, or a learning rate too large); the run stops, and its checkpoints hold only finite "
                f"weights (nonfinite_skip_limit={self.limit})")
        return False


def optimizer_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                   max_grad_norm: float | None, guard: FiniteUpdates | None = None) -> tuple[torch.Tensor, float]:
    """Clip the gradients (when max_grad_norm is set), step the optimizer (unless `guard` refuses a non-finite
    gradient) and the schedule, zero the gradients. Returns the gradient norm before clipping and the learning
    rate the step used.

    Under DeepSpeed the model's engine steps: it clips to its config's gradient_clipping (instead of
    max_grad_norm) and itself skips a step with a non-finite gradient norm (in float32; in bf16 with
    `check_grad_overflow`), which `guard` then counts."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        learning_rate = scheduler.get_last_lr()[0]
        model.step()  # also zeroes the gradients
        grad_norm = torch.as_tensor(model.get_global_grad_norm(), device=accelerator.device)
        if guard is not None:
            guard.allows(grad_norm)
        scheduler.step()
        return grad_norm, learning_rate
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm is not None else math.inf)
    learning_rate = scheduler.get_last_lr()[0]
    stepped = guard is None or guard.allows(grad_norm)
    if stepped:
        optimizer.step()
    with warnings.catch_warnings():
        if not stepped:  # a skipped step advances the schedule, as DeepSpeed's engine does; before the first real
            # optimizer step torch warns that the order looks wrong
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()
    optimizer.zero_grad()
    return grad_norm, learning_rate


def train_supervised(config: TrainingConfig, accelerator: Accelerator, model: torch.nn.Module, tokenizer,
                     examples: list, collate, loss_fn, desc: str, evaluate=None) -> torch.nn.Module:
    """The supervised loop of SFT, reward modelling and DPO, from optimiser setup to the saved final model.

    `collate(examples, pad_token_id, device) -> batch`; `loss_fn(model, batch) -> (loss, stats)` with 0-dim
    detached stats, logged with the loss as their means over the step's pieces;
    `evaluate(model, step, total_steps) -> dict` (optional) adds metrics after a step (empty: none this step). Returns the
    trained model unwrapped (with LoRA: the adapters merged).
    """
    plan = BatchPlan(len(examples), config, accelerator)
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config, plan.total_steps)
    configure_deepspeed(accelerator, config, config.per_device_batch_size)
    model, optimizer = accelerator.prepare(model, optimizer)
    models, optimizers, schedulers = {"model": model}, {"model": optimizer}, {"model": scheduler}
    start_step, logger = start_run(config, accelerator, models, optimizers, schedulers)

    guard = FiniteUpdates(config.nonfinite_skip_limit)
    model.train()
    # closed on any exception too, so that an error's line starts on a line of its own
    with tqdm(range(start_step, plan.total_steps), initial=start_step, total=plan.total_steps, desc=desc,
              disable=not accelerator.is_local_main_process) as progress:
        for step in progress:
            pieces = plan.pieces(step)
            step_stats = []
            for index, indices in enumerate(pieces):
                batch = collate([examples[i] for i in indices], tokenizer.pad_token_id, accelerator.device)
                with accumulation_context(accelerator, model, index == len(pieces) - 1):
                    loss, stats = loss_fn(model, batch)
                    backward(accelerator, model, loss / len(pieces), index == len(pieces) - 1)
                step_stats.append({"loss": loss.detach(), **stats})
            grad_norm, learning_rate = optimizer_step(accelerator, model, optimizer, scheduler, config.max_grad_norm,
                                                      guard)

            done = step + 1
            metrics = {}
            if done % config.logging_steps == 0 or done == plan.total_steps:
                means = {name: torch.stack([s[name] for s in step_stats]).mean() for name in step_stats[0]}
                metrics = reduce_metrics({**means, "grad_norm": grad_norm}, accelerator)
                metrics.update({"learning_rate": learning_rate, "epoch": plan.epoch_at(done),
                                "train/skipped_steps": guard.skipped})
            if evaluate is not None:
                metrics.update(evaluate(model, done, plan.total_steps))
            if metrics:
                logger.log(metrics, done)
                progress.set_postfix({k: f"{v:.4f}" for k, v in metrics.items() if k in ("loss", "eval/accuracy")})
            maybe_save_checkpoint(config, done, accelerator, models, optimizers, schedulers, tokenizer)

    logger.close()
    if config.use_lora:
        model = merge_lora(accelerator.unwrap_model(model))
    save_final_model(model, tokenizer, config.output_dir, accelerator)
    return accelerator.unwrap_model(model)


# ---- rows of all processes, and device-synchronised time (PPO's stages)
def gather_rows(accelerator, x: torch.Tensor) -> torch.Tensor:
    """The rows of every process stacked in process order ([B, T] rows right-padded to one width)."""
    if x.dim() == 2:  # Accelerate pads by adding its pad index, which turns a bool mask into int64
        x = accelerator.pad_across_processes(x, dim=1).to(x.dtype)
    return accelerator.gather(x)


def own_rows(accelerator, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's rows of a `gather_rows` result, cut to the width of `like`."""
    start = accelerator.process_index * like.shape[0]
    x = x[start : start + like.shape[0]]
    return x[:, : like.shape[1]] if x.dim() == 2 else x


def device_clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def random_states_kept(device: torch.device):
    """Python's, NumPy's and torch's random states (the device's too) as they were before the block."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)
