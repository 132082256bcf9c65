"""`marlhf vllm-serve`: the command's flags; the server itself is marlhf.engines.vllm_serve, imported when the
command runs (it needs torch, transformers and vLLM)."""

from __future__ import annotations

import argparse
import json

from marlhf.commands.base import Tool

DESCRIPTION = ("serve rollouts with vLLM over HTTP for rollout_engine='vllm_server' (weights come over "
               "torch.distributed: gloo on CPU, NCCL on GPUs)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the policy to serve at start: a local model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument("--group_port", type=int, default=51216,
                        help="port of the weight group's TCPStore (the vllm_server option group_port; default 51216)")
    parser.add_argument("--dtype", default="auto", help="the weights' dtype in vLLM (default: the checkpoint's)")
    parser.add_argument("--kv_cache_gib", type=int, default=None, help="CPU: GiB of KV cache (the vllm option)")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9,
                        help="GPU: share of the device's memory vLLM takes (default: 0.9, a device of its own)")
    parser.add_argument("--max_model_len", type=int, default=None, help="longest prompt + response (tokens)")
    parser.add_argument("--engine_kwargs", type=json.loads, default=None,
                        help="further vLLM engine arguments as JSON (the vllm option engine_kwargs)")


def _run(arguments: argparse.Namespace) -> int:
    from marlhf.engines.vllm_serve import run

    return run(arguments)


VLLM_SERVE = Tool(add_arguments, _run, DESCRIPTION)
