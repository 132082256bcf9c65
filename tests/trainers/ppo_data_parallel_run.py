"""One PPO run for tests/trainers/test_ppo_distributed.py, under `torchrun` (any number of processes) or alone:

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/ppo_data_parallel_run.py \
        OUT PROMPTS_PER_PROCESS ADVANTAGE [ddp|fsdp|zero2|zero3] [--max_steps N] [--save_steps N] [--resume ...] \
        [--rollout_engine vllm] [--env tests/fixtures/guess_env.py:GuessNumber]

fsdp: the policy and the critic sharded by FSDP2 with the settings of configs/accelerate/fsdp.yaml, in float32
on CPU (see `_fsdp_on_cpu`). zero2, zero3: an engine each for policy and critic under DeepSpeed ZeRO-2 / ZeRO-3
with the settings of configs/accelerate/deepspeed_zero2.yaml / deepspeed_zero3.yaml, in float32 on CPU (see
`_deepspeed_on_cpu`; needs deepspeed installed). --max_steps (default 2), --save_steps (default 0: no checkpoints) and --resume
set PPOConfig's options of these names. --rollout_engine vllm (in the vLLM venv) samples with one vLLM engine per
process from a model vLLM supports (head size 64, tests/test_engine_vllm.py) and logs rollout/logprob_diff.
--env trains on episodes of that environment (termination `turn`, its rewards instead of count_e).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml
from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer
from tests.trainers.test_ppo import RECORDS, count_e

from marlhf.trainers.ppo import PPOConfig, train_ppo

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
FSDP_CONFIG = ACCELERATE_CONFIGS / "fsdp.yaml"


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


# The variables `accelerate launch` sets from a config's deepspeed_config (accelerate/utils/launch.py).
DEEPSPEED_VARIABLES = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                       "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                       "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
                       "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                       "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                       "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
                       "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"}


def _deepspeed_on_cpu(stage: int) -> None:
    """Turn DeepSpeed on as `accelerate launch --config_file configs/accelerate/deepspeed_zero<stage>.yaml` does
    (ACCELERATE_* variables from its deepspeed_config), on CPU. Accelerate 1.15 does not run DeepSpeed on CPU:
    with cpu=True (make_accelerator's choice on a machine without an accelerator) it ignores
    ACCELERATE_USE_DEEPSPEED and runs DDP; without it, it opens DeepSpeed's process group (gloo, DeepSpeed's CPU
    accelerator) but counts 1 process, as it finds no backend of its own. So the process counts are set here
    from the opened group, and train_ppo's Accelerator is made with cpu=False (the device stays the CPU)."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import PartialState

    from marlhf.trainers import common

    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    settings = yaml.safe_load((ACCELERATE_CONFIGS / f"deepspeed_zero{stage}.yaml").read_text())["deepspeed_config"]
    for key, value in settings.items():
        os.environ[DEEPSPEED_VARIABLES[key]] = str(value).lower() if isinstance(value, bool) else str(value)
    PartialState()
    PartialState._shared_state.update(backend="gloo", num_processes=dist.get_world_size(),
                                      process_index=dist.get_rank(), local_process_index=int(os.environ["LOCAL_RANK"]))
    common.Accelerator = lambda **kwargs: Accelerator(**{**kwargs, "cpu": False})


def main(output_dir: str, prompts_per_process: int, advantage: str, sharding: str = "ddp", max_steps: int = 2,
         save_steps: int = 0, resume: str | None = None, rollout_engine: str = "hf", env: str | None = None) -> None:
    if sharding == "fsdp":
        _fsdp_on_cpu()
    elif sharding.startswith("zero"):
        _deepspeed_on_cpu(int(sharding.removeprefix("zero")))
    tokenizer = build_tiny_tokenizer()
    rollout_size = prompts_per_process * 2
    task_options = dict(max_length=64, ngram=2) if env is None else dict(
        env=env, termination="turn", max_length=128,
        multi_turn_options={"max_turns": 3, "max_turn_tokens": 4, "max_response_tokens": 48})
    config = PPOConfig(output_dir=output_dir, model_name_or_path="unused", per_device_batch_size=prompts_per_process,
                       num_samples_per_prompt=2, mini_batch_size=rollout_size, gradient_accumulation_steps=2,
                       max_prompt_length=32, max_response_length=6, max_steps=max_steps,
                       advantage=advantage, whiten_advantages=advantage == "gae", learning_rate=1e-2,
                       critic_learning_rate=1e-2, warmup_ratio=0.0, lr_scheduler="constant", save_steps=save_steps,
                       resume=resume, seed=5,
                       # the reinforce runs sample with the counter-hash noise, so it is checked across processes too
                       sampling_noise="counter_hash" if advantage == "reinforce" else "row_generators",
                       rollout_engine=rollout_engine, log_rollout_logprob_diff=rollout_engine == "vllm",
                       rollout_engine_options={"kv_cache_gib": 1} if rollout_engine == "vllm" else None,
                       **task_options)
    if rollout_engine == "vllm":
        from tests.test_engine_vllm import _model

        model = _model(tokenizer, head_scale=1.0).train()
    else:
        model = build_tiny_causal_lm(tokenizer)
    policy = train_ppo(config, RECORDS, policy=model, tokenizer=tokenizer, reward_fn=None if env else count_e)
    if sharding == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(policy, FSDPModule):  # the run fell back to plain data parallelism
            raise SystemExit(f"fsdp run: the policy is a {type(policy).__name__}, not an FSDP-sharded module")
    if sharding.startswith("zero"):
        from accelerate.state import AcceleratorState

        state = AcceleratorState()
        if state.distributed_type.value != "DEEPSPEED" or state.deepspeed_plugin.zero_stage != int(sharding[-1]):
            raise SystemExit(f"{sharding} run: Accelerate set up {state.distributed_type.value}, not DeepSpeed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("prompts_per_process", type=int)
    parser.add_argument("advantage")
    parser.add_argument("sharding", nargs="?", choices=("ddp", "fsdp", "zero2", "zero3"), default="ddp")
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--rollout_engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--env")
    main(**vars(parser.parse_args()))
