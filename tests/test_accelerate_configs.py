"""configs/accelerate/*.yaml parse with Accelerate's own loader and pass `accelerate launch`'s validation
(no GPU and no DeepSpeed install needed for that)."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.launch import prepare_multi_gpu_env

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
EXPECTED = {
    "ddp.yaml": (DistributedType.MULTI_GPU, None),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 2),
    "deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, 3),
    "fsdp.yaml": (DistributedType.FSDP, None),
}


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_and_validates(name):
    path = str(CONFIG_DIR / name)
    distributed_type, zero_stage = EXPECTED[name]
    config = load_config_from_file(path)
    assert config.distributed_type == distributed_type
    assert config.mixed_precision == "bf16"
    assert Path(path).read_text().startswith("#")  # says when to use it

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    assert args.num_processes == 8
    assert args.use_deepspeed == (distributed_type == DistributedType.DEEPSPEED)
    assert args.use_fsdp == (distributed_type == DistributedType.FSDP)
    if zero_stage is not None:
        assert args.zero_stage == zero_stage
        assert config.deepspeed_config["gradient_accumulation_steps"] == 1
    else:  # the environment `accelerate launch` hands to each DDP / FSDP process
        env = prepare_multi_gpu_env(args)
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        if distributed_type == DistributedType.FSDP:
            assert env["FSDP_VERSION"] == "2" and env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
