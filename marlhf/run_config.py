"""The options every job that writes an output directory shares (`RunConfig`) and those of the gradient-based
trainers (`TrainingConfig`: model, data, optimisation, LoRA); the option machinery they are built with is
marlhf.config. They live a layer above it because their checks read the dataset registry (marlhf.data.tasks) and
the metrics sinks (marlhf.logging_utils), which marlhf.config, under every plug-in, must not import."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from marlhf.config import ConfigBase, option
from marlhf.data.tasks import get_task
from marlhf.logging_utils import check_report_to

LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # Llama / Gemma / Mistral / Qwen module names


@dataclasses.dataclass(kw_only=True)
class RunConfig(ConfigBase):
    """Options shared by every job that writes to an output directory."""

    output_dir: str = option("outputs/run", "directory for checkpoints, metrics.jsonl, config.yaml and the final model")
    seed: int = option(1234, "random seed (python, numpy, torch, data order)")
    report_to: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio", "none"], ...] = option(
        ("jsonl",), "metrics sinks: OUTPUT_DIR/metrics.jsonl always, plus any of tensorboard, wandb, mlflow, trackio "
                    "(Accelerate's trackers; a resumed run continues the same tracker run); none: nothing")
    tracker_project: str = option("marlhf", "project (wandb, trackio) or experiment (mlflow) the run is logged to")
    run_name: str | None = option(None, "run name shown by the trackers (none: output_dir's name)")
    logging_steps: int = option(1, "log metrics every N optimizer steps", ge=1)
    save_steps: int = option(500, "save a checkpoint every N optimizer steps (0: only the final model)", ge=0)
    save_total_limit: int | None = option(2, "keep only the newest K checkpoints (none: keep all)", ge=1)
    resume: str | None = option(
        None, "resume from a checkpoint: 'latest' (newest complete checkpoint in output_dir) or a checkpoint path")
    overwrite_output_dir: bool = option(
        False, "start afresh in an output_dir that holds an earlier run (its checkpoints are deleted)")
    allow_config_change: bool = option(
        False, "resume with options that change the run's meaning (model, data, rewards, macro actions, batch "
               "arithmetic, ...); the run's configs are kept as config.yaml and config.resume-<step>.yaml")
    mixed_precision: Literal["no", "fp16", "bf16"] = option("no", "Accelerate mixed precision mode")

    def validate(self) -> None:
        super().validate()
        if not self.output_dir.strip():
            raise ValueError("output_dir must not be empty")
        if self.resume is not None and not self.resume.strip():
            raise ValueError("resume must be 'latest', a checkpoint path or none, not empty")
        check_report_to(self.report_to)
        output_dir = Path(self.output_dir).resolve()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("name_or_path") and isinstance(value, str) and Path(value).resolve() == output_dir:
                raise ValueError(f"output_dir {self.output_dir!r} is the {f.name} directory: the run would write over "
                                 "its input; choose another output_dir")


@dataclasses.dataclass(kw_only=True)
class TrainingConfig(RunConfig):
    """Options shared by the gradient-based trainers (SFT, reward model, DPO, PPO)."""

    model_name_or_path: str = option("google/gemma-2b", "Hugging Face model id or local path to start from")
    dataset: str | None = option(None, "dataset id or local .jsonl/.parquet path (CLI; see marlhf.data.load_records)")
    dataset_task: str | None = option(
        None, "a local dataset file holds raw rows of this task's Hub schema: tldr, hh, webgpt, apps, another task "
              "registered with marlhf.data.tasks.register_task, or a dotted path package.module:TASK (none: rows "
              "already in the stage schema)")
    max_samples: int | None = option(None, "use at most N records of the dataset (none: all)", ge=1)
    webgpt_ties: Literal["answer_0", "skip"] = option(
        "answer_0", "WebGPT comparisons scored as ties: kept with answer_0 preferred (the authors' code) or skipped "
                    "by SFT and reward modelling")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("float32", "dtype to load the model weights in")
    gradient_checkpointing: bool = option(False, "trade compute for memory in the transformer blocks")
    learning_rate: float = option(1e-5, "peak AdamW learning rate", gt=0)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = option(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = option(0.95, "AdamW beta2", ge=0, lt=1)
    lr_scheduler: Literal["cosine", "linear", "constant"] = option("cosine", "learning-rate schedule after warmup")
    warmup_ratio: float = option(0.1, "fraction of the optimizer steps spent in linear warmup", ge=0, le=1)
    warmup_steps: int | None = option(None, "linear warmup in optimizer steps; overrides warmup_ratio (none: use "
                                            "the ratio)", ge=0)
    max_grad_norm: float | None = option(1.0, "clip the gradient norm to this value (none: no clipping)", gt=0)
    nonfinite_skip_limit: int = option(
        3, "an optimizer step with a NaN/inf gradient norm is skipped (train/skipped_steps); more than N in a row "
           "stop the run (0: stop at the first)", ge=0)
    per_device_batch_size: int = option(8, "records per micro-batch on each process", ge=1)
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", ge=1)
    num_epochs: float = option(1.0, "passes over the training records", gt=0)
    max_steps: int | None = option(None, "stop after N optimizer steps (overrides num_epochs)", ge=1)
    max_prompt_length: int = option(512, "prompts are truncated to their last N tokens", ge=1)
    max_length: int = option(1024, "prompt + response tokens, responses are truncated to fit", ge=2)

    # LoRA (peft); PPO and DPO restate use_lora's help for their models.
    use_lora: bool = option(
        False, "train LoRA adapters instead of all weights (a reward model's value head trains fully); checkpoints "
               "hold the adapters, the final model is saved with them merged in")
    lora_r: int = option(8, "LoRA rank", ge=1)
    lora_alpha: float = option(16.0, "LoRA scale numerator (scale = alpha / r)", gt=0)
    lora_target_modules: tuple[str, ...] = option(LLAMA_ATTENTION, "names of the linear layers that get adapters")

    def validate(self) -> None:
        super().validate()
        if self.dataset_task is not None:
            get_task(self.dataset_task)  # an unknown name or a path that does not import stops here
        if self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length ({self.max_prompt_length}) must be < max_length ({self.max_length})")
