"""One PPO run for tests/trainers/test_ppo_distributed.py, under `torchrun` (any number of processes) or alone:

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/ppo_data_parallel_run.py \
        OUT PROMPTS_PER_PROCESS ADVANTAGE [ddp|fsdp] [--max_steps N] [--save_steps N] [--resume latest|PATH]

fsdp: the policy and the critic sharded by FSDP2 with the settings of configs/accelerate/fsdp.yaml, in float32
on CPU (see `_fsdp_on_cpu`). --max_steps (default 2), --save_steps (default 0: no checkpoints) and --resume
set PPOConfig's options of these names.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml
from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer
from tests.trainers.test_ppo import RECORDS, count_e

from marlhf.trainers.ppo import PPOConfig, train_ppo

FSDP_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / "fsdp.yaml"


def _fsdp_on_cpu() -> None:
    """Turn FSDP on as `accelerate launch --config_file configs/accelerate/fsdp.yaml` does (FSDP_* variables from
    its fsdp_config), on CPU. Accelerate 1.15 ignores ACCELERATE_USE_FSDP on CPU: AcceleratorState picks FSDP
    only when the process group's type is MULTI_GPU / MULTI_NPU / ..., so MULTI_CPU stays DDP; torch's
    fully_shard itself shards on a CPU mesh over gloo. So the gloo process group is opened here and labelled
    MULTI_GPU: the Accelerator that train_ppo makes then takes the FSDP path, on the CPU device."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_USE_FSDP"] = "true"
    os.environ["FSDP_SYNC_MODULE_STATES"] = "true"  # accelerate launch's default
    for key, value in yaml.safe_load(FSDP_CONFIG.read_text())["fsdp_config"].items():
        value = str(value).lower() if isinstance(value, bool) else str(value)
        os.environ["FSDP_" + key.removeprefix("fsdp_").upper()] = value
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def main(output_dir: str, prompts_per_process: int, advantage: str, sharding: str = "ddp", max_steps: int = 2,
         save_steps: int = 0, resume: str | None = None) -> None:
    if sharding == "fsdp":
        _fsdp_on_cpu()
    tokenizer = build_tiny_tokenizer()
    rollout_size = prompts_per_process * 2
    config = PPOConfig(output_dir=output_dir, model_name_or_path="unused", per_device_batch_size=prompts_per_process,
                       num_samples_per_prompt=2, mini_batch_size=rollout_size, gradient_accumulation_steps=2,
                       max_prompt_length=32, max_response_length=6, max_length=64, max_steps=max_steps, ngram=2,
                       advantage=advantage, whiten_advantages=advantage == "gae", learning_rate=1e-2,
                       critic_learning_rate=1e-2, warmup_ratio=0.0, lr_scheduler="constant", save_steps=save_steps,
                       resume=resume, seed=5)
    policy = train_ppo(config, RECORDS, policy=build_tiny_causal_lm(tokenizer), tokenizer=tokenizer,
                       reward_fn=count_e)
    if sharding == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(policy, FSDPModule):  # the run fell back to plain data parallelism
            raise SystemExit(f"fsdp run: the policy is a {type(policy).__name__}, not an FSDP-sharded module")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("prompts_per_process", type=int)
    parser.add_argument("advantage")
    parser.add_argument("sharding", nargs="?", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume")
    main(**vars(parser.parse_args()))
