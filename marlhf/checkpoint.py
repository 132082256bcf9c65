"""Atomic, resumable training checkpoints in safetensors, generic over several models.

API:
    path = save_checkpoint(output_dir, step, models={"policy": m, "critic": c},
                           optimizers={"policy": opt}, schedulers={"policy": sched},
                           trainer_state={"epoch": 1, ...}, tokenizer=tok,
                           save_total_limit=2, accelerator=accelerator)    # -> OUTPUT_DIR/checkpoint-<step>
    state = load_checkpoint(path, models=..., optimizers=..., schedulers=..., accelerator=accelerator)
        # restores weights in place, optimizer/scheduler states and this process's RNG states;
        # returns the trainer_state dict with "step" added
    latest_checkpoint(output_dir) -> Path | None;  list_checkpoints(output_dir) -> [Path] (oldest first)
    resolve_resume(resume, output_dir) -> Path | None    # RunConfig.resume: None, "latest" or a path

Layout of checkpoint-<step>/:
    <model name>/            save_pretrained (safetensors) + tokenizer: loadable with from_pretrained;
                             a LoRA model (peft.PeftModel) holds its adapters only (adapter_model.safetensors),
                             a LoRA critic (ScalarHeadModel) its backbone's adapters + scalar_head.safetensors
    optimizer.<name>.{json,safetensors}, scheduler.<name>.{json,safetensors}
    rng_state.<process index>.{json,safetensors}   python, numpy, torch (+cuda) generators
    trainer_state.{json,safetensors}                step + whatever the trainer passes
Non-tensor structure goes to the .json file and tensors to the .safetensors file (no pickle anywhere).
A checkpoint is written to a temporary directory and renamed into place, so a crash never leaves a
partial checkpoint-<step>. Models must provide save_pretrained / from_pretrained (Hugging Face models
and marlhf.modeling.ScalarHeadModel do) or be peft models; they may be wrapped by accelerator.prepare.
Adapters are loaded into the model passed to load_checkpoint: its frozen base weights must be the run's
(the trainer loads them again from the same path).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from marlhf.modeling import ScalarHeadModel

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = ".tmp-checkpoint-"


# ---- nested state <-> (json, tensors) ----------------------------------------------------------

def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": _encode(torch.from_numpy(value.copy()), tensors, where)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        # int keys (optimizer state) would turn into strings in JSON; keep them as pairs.
        return {"__items__": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                              for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint {where} of type {type(value).__name__}")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return _decode(value["__ndarray__"], tensors).numpy()
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _with_extension(stem: Path, extension: str) -> Path:
    return stem.parent / (stem.name + extension)  # not with_suffix: stems such as "optimizer.policy" hold dots


def save_state(stem: Path, state: Any) -> None:
    """Write a nested structure of tensors / numbers / strings to stem.json + stem.safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors, stem.name)
    _with_extension(stem, ".json").write_text(json.dumps(encoded))
    save_file(tensors, str(_with_extension(stem, ".safetensors")))


def load_state(stem: Path) -> Any:
    tensors = load_file(str(_with_extension(stem, ".safetensors")))
    return _decode(json.loads(_with_extension(stem, ".json").read_text()), tensors)


# ---- RNG --------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- checkpoints ------------------------------------------------------------------------------

def list_checkpoints(output_dir: str | Path) -> list[Path]:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if p.is_dir() and (m := CHECKPOINT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """Map RunConfig.resume to a checkpoint directory (None: start fresh)."""
    if resume is None:
        return None
    path = latest_checkpoint(output_dir) if resume == "latest" else Path(resume)
    if path is None:
        raise ValueError(f"resume='latest' but {output_dir} holds no checkpoint-<step> directory")
    if not path.is_dir():
        raise ValueError(f"resume checkpoint {path} does not exist")
    return path


def _unwrap(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    return accelerator.unwrap_model(model) if accelerator is not None else model


def save_checkpoint(output_dir: str | Path, step: int, models: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer] | None = None,
                    schedulers: dict[str, Any] | None = None, trainer_state: dict[str, Any] | None = None,
                    tokenizer=None, save_total_limit: int | None = None, accelerator=None) -> Path:
    """Write OUTPUT_DIR/checkpoint-<step> atomically; every process must call this (collective)."""
    output_dir = Path(output_dir)
    is_main = accelerator is None or accelerator.is_main_process
    process_index = 0 if accelerator is None else accelerator.process_index
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{_TMP_PREFIX}{step}"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during an earlier save
        tmp.mkdir(parents=True)
    _wait(accelerator)
    save_state(tmp / f"rng_state.{process_index}", rng_state())
    if is_main:
        for name, model in models.items():
            _unwrap(model, accelerator).save_pretrained(tmp / name)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / name)
        for name, optimizer in (optimizers or {}).items():
            save_state(tmp / f"optimizer.{name}", optimizer.state_dict())
        for name, scheduler in (schedulers or {}).items():
            save_state(tmp / f"scheduler.{name}", scheduler.state_dict())
        save_state(tmp / "trainer_state", {**(trainer_state or {}), "step": step})
    _wait(accelerator)
    if is_main:
        if final.exists():  # re-saving a step after resuming from an earlier checkpoint
            stale = output_dir / f"{_TMP_PREFIX}{step}.stale"
            final.rename(stale)
            tmp.rename(final)
            shutil.rmtree(stale)
        else:
            tmp.rename(final)
        if save_total_limit is not None:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    _wait(accelerator)
    return final


def load_checkpoint(path: str | Path, models: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer] | None = None,
                    schedulers: dict[str, Any] | None = None, accelerator=None) -> dict[str, Any]:
    """Restore everything save_checkpoint wrote (in place); return the trainer state (with "step")."""
    path = Path(path)
    for name, model in models.items():
        _load_weights(_unwrap(model, accelerator), path / name)
    for name, optimizer in (optimizers or {}).items():
        optimizer.load_state_dict(load_state(path / f"optimizer.{name}"))
    for name, scheduler in (schedulers or {}).items():
        scheduler.load_state_dict(load_state(path / f"scheduler.{name}"))
    process_index = 0 if accelerator is None else accelerator.process_index
    rng_file = path / f"rng_state.{process_index}"
    if not _with_extension(rng_file, ".json").exists():
        raise ValueError(f"{path} has no RNG state for process {process_index}: "
                         "resume with the number of processes the checkpoint was written with")
    set_rng_state(load_state(rng_file))
    return load_state(path / "trainer_state")


def _load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load what model.save_pretrained(directory) wrote into `model`, in place."""
    from peft import PeftModel  # imported on resume only: it takes seconds

    if isinstance(model, PeftModel):
        _load_adapters(model, directory)
    elif isinstance(model, ScalarHeadModel):  # its save_pretrained: the backbone's files + the head's
        _load_weights(model.backbone, directory)
        model.head.load_state_dict(load_file(str(directory / ScalarHeadModel.HEAD_FILE)))
    elif (directory / "adapter_config.json").exists():
        raise ValueError(f"{directory} holds LoRA adapters only: resume it with use_lora on")
    else:
        loaded = type(model).from_pretrained(directory)
        model.load_state_dict(loaded.state_dict())


def _load_adapters(model: torch.nn.Module, directory: Path) -> None:
    """A peft model's save_pretrained writes its adapters only; its base weights stay those it holds."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME

    adapter_file = directory / SAFETENSORS_WEIGHTS_NAME
    if not adapter_file.exists():
        raise ValueError(f"{directory} holds no LoRA adapters ({SAFETENSORS_WEIGHTS_NAME}): resume a LoRA run "
                         "from a checkpoint of a LoRA run")
    adapters = load_file(str(adapter_file))
    expected = get_peft_model_state_dict(model).keys()
    if adapters.keys() != expected:
        differing = sorted(adapters.keys() ^ expected)
        raise ValueError(f"{adapter_file} holds other adapters than the model's (other lora_target_modules?): "
                         f"{len(differing)} weights differ, such as {differing[0]}")
    set_peft_model_state_dict(model, adapters)


def _wait(accelerator) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()
