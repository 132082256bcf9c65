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
    checkpoint_problem(path) -> str | None               # why a checkpoint is not usable (None: it is complete)

Layout of checkpoint-<step>/:
    <model name>/            save_pretrained (safetensors) + tokenizer: loadable with from_pretrained;
                             a LoRA model (peft.PeftModel) holds its adapters only (adapter_model.safetensors),
                             a LoRA critic (ScalarHeadModel) its backbone's adapters + scalar_head.safetensors
    optimizer.<name>.{json,safetensors}, scheduler.<name>.{json,safetensors}
    rng_state.<process index>.{json,safetensors}   python, numpy, torch (+cuda) generators
    trainer_state.{json,safetensors}                step + whatever the trainer passes
    config.yaml                                     the run's config when the checkpoint was written
    manifest.json                                   every other file's size and sha256, written last
Non-tensor structure goes to the .json file and tensors to the .safetensors file (no pickle anywhere).
A checkpoint is written to a temporary directory and renamed into place, so a crash never leaves a
partial checkpoint-<step>; a checkpoint damaged later (a file deleted, truncated or changed) no longer
matches its manifest, and resume skips it (`latest`) or refuses it (a path), naming the file. Models must provide save_pretrained / from_pretrained (Hugging Face models
and marlhf.modeling.ScalarHeadModel do) or be peft models; they may be wrapped by accelerator.prepare.
Under FSDP (version 2) the checkpoint holds the full weights and optimizer states, gathered from the
processes' shards, in the same files as an unsharded run; on resume the main process reads them and sends
each process its shards.
Adapters are loaded into the model passed to load_checkpoint: its frozen base weights must be the run's
(the trainer loads them again from the same path).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from marlhf.errors import MarlhfError
from marlhf.modeling import ScalarHeadModel

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = ".tmp-checkpoint-"
MANIFEST = "manifest.json"


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

def checkpoint_step(path: str | Path) -> int | None:
    """The step of a `checkpoint-<step>` directory name (None for any other name)."""
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in output_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path, report=None) -> Path | None:
    """The newest complete checkpoint; `report(message)` hears of each newer one skipped and why."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if report is not None:
            report(f"skipping {path}: {problem}")
    return None


def resolve_resume(resume: str | None, output_dir: str | Path, report=print) -> Path | None:
    """Map RunConfig.resume to a complete checkpoint directory (None: start fresh)."""
    if resume is None:
        return None
    if resume == "latest":
        skipped: list[str] = []
        path = latest_checkpoint(output_dir, lambda message: (skipped.append(message), report(message)))
        if path is None:
            reasons = f" ({'; '.join(skipped)})" if skipped else ""
            raise MarlhfError(f"resume='latest' but {output_dir} holds no complete checkpoint-<step> directory"
                              f"{reasons}")
        return path
    path = Path(resume)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"cannot resume from {path}: {problem}")
    return path


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` is not a complete, intact checkpoint (None: it is one): every file its manifest lists is
    there with its size and sha256."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if (path / "config.json").exists() and not _with_extension(path / "trainer_state", ".json").exists():
            return "a model directory, not a checkpoint (resume takes OUTPUT_DIR/checkpoint-<step>)"
        return f"no {MANIFEST}: the save did not finish (or the checkpoint predates manifests)"
    try:
        files = json.loads(manifest_file.read_text())["files"]
        entries = [(name, int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{manifest_file} is unreadable ({error})"
    for name, size, digest in entries:
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, its manifest says {size}"
        if _sha256(file) != digest:
            return f"{file} does not match its manifest's checksum"
    return None


def _sha256(file: Path) -> str:
    with open(file, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_manifest(directory: Path) -> None:
    """List every file under `directory` with size and sha256, into MANIFEST, atomically and last."""
    files = {str(file.relative_to(directory)): {"size": file.stat().st_size, "sha256": _sha256(file)}
             for file in sorted(directory.rglob("*")) if file.is_file() and file.name != MANIFEST}
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / MANIFEST)


def _unwrap(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    return accelerator.unwrap_model(model) if accelerator is not None else model


def save_checkpoint(output_dir: str | Path, step: int, models: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer] | None = None,
                    schedulers: dict[str, Any] | None = None, trainer_state: dict[str, Any] | None = None,
                    tokenizer=None, save_total_limit: int | None = None, accelerator=None,
                    config_yaml: str | None = None) -> Path:
    """Write OUTPUT_DIR/checkpoint-<step> atomically, with its manifest last; every process must call this
    (collective). `config_yaml`: the run's config, kept in the checkpoint."""
    output_dir = Path(output_dir)
    is_main = accelerator is None or accelerator.is_main_process
    process_index = 0 if accelerator is None else accelerator.process_index
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{_TMP_PREFIX}{step}-{_run_token(accelerator)}"  # unique per run: never another run's
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during an earlier save
        tmp.mkdir(parents=True)
    _wait(accelerator)
    save_state(tmp / f"rng_state.{process_index}", rng_state())
    for name, model in models.items():
        model = _unwrap(model, accelerator)
        state_dict = _gathered_model_state(model)  # collective under FSDP; None: the model saves its own weights
        if is_main:
            model.save_pretrained(tmp / name, state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / name)
    for name, optimizer in (optimizers or {}).items():
        sharded_model = _sharded_model_of(name, optimizer, models, accelerator)
        if sharded_model is not None:
            state = _gathered_optimizer_state(sharded_model, optimizer, is_main)  # collective
        else:
            state = optimizer.state_dict()
        if is_main:
            save_state(tmp / f"optimizer.{name}", state)
    if is_main:
        for name, scheduler in (schedulers or {}).items():
            save_state(tmp / f"scheduler.{name}", scheduler.state_dict())
        save_state(tmp / "trainer_state", {**(trainer_state or {}), "step": step})
        if config_yaml is not None:
            (tmp / "config.yaml").write_text(config_yaml)
    _wait(accelerator)
    if is_main:
        _write_manifest(tmp)
        if final.exists():  # re-saving a step after resuming from an earlier checkpoint
            stale = tmp.with_name(tmp.name + ".stale")
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
        sharded_model = _sharded_model_of(name, optimizer, models, accelerator)
        if sharded_model is not None:
            _shard_optimizer_state(sharded_model, optimizer, path / f"optimizer.{name}")
        else:
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
    """Load what model.save_pretrained(directory) wrote into `model`, in place (under FSDP: its shards)."""
    from peft import PeftModel  # imported on resume only: it takes seconds

    adapters_only = any(isinstance(module, PeftModel) for module in model.modules())  # the frozen base stays
    if _is_sharded(model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Only the main process reads the full weights (one copy in host memory, not one per process); it
        # sends every process its shards.
        weights = _saved_weights(model, directory) if torch.distributed.get_rank() == 0 else {}
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                      strict=not adapters_only))
    else:
        model.load_state_dict(_saved_weights(model, directory), strict=not adapters_only)


def _saved_weights(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The weights model.save_pretrained(directory) wrote, named as in model.state_dict()."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return _saved_adapters(model, directory)
    if isinstance(model, ScalarHeadModel):  # its save_pretrained: the backbone's files + the head's
        head = load_file(str(directory / ScalarHeadModel.HEAD_FILE))
        return {**{f"backbone.{name}": value for name, value in _saved_weights(model.backbone, directory).items()},
                **{f"head.{name}": value for name, value in head.items()}}
    if (directory / "adapter_config.json").exists():
        raise ValueError(f"{directory} holds LoRA adapters only: resume it with use_lora on")
    if not (directory / "config.json").is_file():  # from_pretrained would build a default config instead
        raise ValueError(f"{directory} has no config.json: the checkpoint is damaged")
    return type(model).from_pretrained(directory).state_dict()


def _saved_adapters(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """A peft model's save_pretrained writes its adapters only; its base weights stay those it holds."""
    from peft import get_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME

    adapter_file = directory / SAFETENSORS_WEIGHTS_NAME
    if not adapter_file.exists():
        raise ValueError(f"{directory} holds no LoRA adapters ({SAFETENSORS_WEIGHTS_NAME}): resume a LoRA run "
                         "from a checkpoint of a LoRA run")
    adapters = load_file(str(adapter_file))
    own = model.state_dict()
    own_by_saved_name = get_peft_model_state_dict(model, state_dict=own)  # entries of `own`, named as peft saves them
    if adapters.keys() != own_by_saved_name.keys():
        differing = sorted(adapters.keys() ^ own_by_saved_name.keys())
        raise ValueError(f"{adapter_file} holds other adapters than the model's (other lora_target_modules?): "
                         f"{len(differing)} weights differ, such as {differing[0]}")
    # peft saves an adapter weight without the adapter's name ("lora_A.weight" for "lora_A.default.weight"):
    # the model's own tensors, looked up under their saved names, give the model's name of each.
    model_name = {id(value): name for name, value in own.items()}
    return {model_name[id(own_by_saved_name[name])]: value for name, value in adapters.items()}


# ---- FSDP: full state on disk, shards in memory -------------------------------------------------
# Under FSDP (version 2) each process holds a shard of every parameter (a DTensor) and of its optimizer state.
# Checkpoints hold the full state, in the layout of an unsharded run: every process takes part in gathering
# it onto the main process, which writes it; on resume the main process reads it and sends each process its
# shards.

def _is_sharded(parameters) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in parameters)


def _gathered_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full weights on the main process (empty on the others) when `model` is sharded, else None."""
    if not _is_sharded(model.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _sharded_model_of(name: str, optimizer: torch.optim.Optimizer, models: dict[str, torch.nn.Module],
                      accelerator) -> torch.nn.Module | None:
    """The model whose sharded parameters `optimizer` updates (the model of the same name), or None."""
    if not _is_sharded(p for group in optimizer.param_groups for p in group["params"]):
        return None
    if name not in models:
        raise ValueError(f"optimizer {name!r} updates FSDP-sharded parameters: pass their model in models "
                         f"under the same name {name!r}")
    return _unwrap(models[name], accelerator)


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from accelerate.optimizer import AcceleratedOptimizer

    # torch.distributed.checkpoint steps an optimizer without state (lr 0, zero gradients) to create it: not
    # through Accelerate's wrapper, which may skip the step (gradient accumulation) or count it in its grad scaler.
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _gathered_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              is_main: bool) -> dict[str, Any] | None:
    """The full optimizer state on the main process (None on the others), as optimizer.state_dict() of an
    unsharded run has it: parameters numbered in param_groups order (torch.distributed.checkpoint names them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, _plain_optimizer(optimizer),
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    return _renamed_parameters(state, {fqn: index for index, fqn in enumerate(_parameter_names(state))})


def _shard_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, file: Path) -> None:
    """Load a full optimizer state (numbered parameters, as saved in `file`) into the optimizer of a sharded
    model: the main process reads it and sends every process its shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    optimizer = _plain_optimizer(optimizer)
    names = _parameter_names(get_optimizer_state_dict(model, optimizer))  # this process's state: names only
    named = {}
    if torch.distributed.get_rank() == 0:
        state = load_state(file)
        saved = sum(len(group["params"]) for group in state["param_groups"])
        if saved != len(names):
            raise ValueError(f"{file}: optimizer state for {saved} parameters, the optimizer has {len(names)}")
        named = _renamed_parameters(state, names)
    set_optimizer_state_dict(model, optimizer, named,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _parameter_names(optimizer_state: dict[str, Any]) -> list[str]:
    return [fqn for group in optimizer_state["param_groups"] for fqn in group["params"]]


def _renamed_parameters(optimizer_state: dict[str, Any], rename) -> dict[str, Any]:
    """`optimizer_state` with each parameter key k (in "state" and the param_groups) replaced by rename[k]:
    names to numbers (a dict) or numbers to names (a list)."""
    return {"state": {rename[key]: value for key, value in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [rename[key] for key in group["params"]]}
                             for group in optimizer_state["param_groups"]]}


def _run_token(accelerator) -> str:
    """The main process's pid and host, the same on every process (a collective under several processes)."""
    token = [f"{os.getpid()}-{socket.gethostname()}"]
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(token)
    return token[0]


def _wait(accelerator) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()
