"""A vLLM rollout engine in another process, on another device or machine (`rollout_engine="vllm_server"`): the
client of `marlhf vllm-serve` (marlhf.engines.vllm_serve), as TRL's `vllm_mode="server"` is of `trl vllm-serve`.

    marlhf vllm-serve --model PATH --host 0.0.0.0 --port 8000          # on the machine (or device) that samples
    marlhf ppo ... --rollout_engine vllm_server \\
        --rollout_engine_options '{server_url: "http://HOST:8000"}'    # the trainer

Two channels, as in TRL:

- HTTP (JSON) for the requests: `/health`, `/generate` (prompts without their padding, one seed per row and the
  sampling settings; the server's vllm engine answers, so a row's response and log-probs are those the colocated
  `vllm` engine draws with the same weights and seed), `/init_communicator`, `/update_weights` (the names, dtypes
  and shapes of the tensors about to come), `/weights_loaded` (answered once they are in) and
  `/close_communicator`.
- torch.distributed for the weights: a process group of two, the server rank 0 (it hosts the group's TCPStore on
  `server_group_port`) and the trainer rank 1, made without touching the default process group (Accelerate's), gloo
  on CPU, NCCL between GPUs. Each sync broadcasts the policy's tensors from rank 1, one decoder layer (bucket)
  per `/update_weights`; after the first sync only the buckets training can change (with LoRA: the adapted
  layers, merged), the rule of the colocated engine (`marlhf.engines.vllm._policy_weights`). The server loads
  them into vLLM with its `reload_weights` and drops its prefix cache.

With several training processes each samples its own rows through the same server; the weights are sent by the
main process alone (the sharded gathers run on all, as they do for the colocated engine), and the processes
wait for each other after a sync, so that no process asks for a rollout before the new weights are in.
Episodes of an environment (`--env`) run in the trainer's process, which asks `/generate` once per round for every
live episode's whole context (marlhf.multiturn.EngineSampler): they are the colocated engine's episodes.
A server that does not answer `/health` within `server_connect_timeout` seconds (default 10) stops the run when the
engine is made, before the models load, with one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from marlhf.config import option
from marlhf.engines.base import EngineContext, Generation, check_sampling, register_engine
from marlhf.engines.vllm import _bucket, _policy_weights
from marlhf.errors import MarlhfError

__all__ = ["VLLMServerEngine", "VLLMServerOptions", "weight_group", "SERVER_RANK", "TRAINER_RANK"]

SERVER_RANK, TRAINER_RANK = 0, 1  # ranks in the weight group of two


@dataclasses.dataclass(frozen=True)
class VLLMServerOptions:
    """The vllm_server engine's options (`--rollout_engine_options '{server_url: "http://HOST:8000"}'`, or the
    flat `--server_url http://HOST:8000`)."""

    server_url: str = option("http://127.0.0.1:8000", "where `marlhf vllm-serve` listens (http://HOST:PORT)")
    server_timeout: float = option(600.0, "seconds one request (a rollout, a weight sync) may take", gt=0)
    server_connect_timeout: float = option(
        10.0, "seconds to wait for the server's /health when the engine is made (then one line)", gt=0)
    server_group_port: int = option(51216, "the port on the server's host of the weight group's TCPStore (`marlhf "
                                           "vllm-serve --group_port`'s default is the same)", ge=1, le=65535)
    server_backend: Literal["gloo", "nccl"] | None = option(
        None, "the weight group's torch.distributed backend: gloo (CPU tensors) or nccl (GPU tensors, both ends on "
              "GPUs); none: nccl where the trainer has CUDA, else gloo")

    def __post_init__(self) -> None:
        name = "rollout engine 'vllm_server' option"
        parsed = urllib.parse.urlparse(self.server_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{name} 'server_url' must be http://HOST:PORT, got {self.server_url!r}")
        for field in ("server_timeout", "server_connect_timeout"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name} {field!r} must be > 0 (seconds), got {getattr(self, field)}")
        if not 0 < self.server_group_port < 65536:
            raise ValueError(f"{name} 'server_group_port' must be a port number, got {self.server_group_port}")
        if self.server_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"{name} 'server_backend' must be 'gloo' or 'nccl', got {self.server_backend!r}")


def weight_group(host: str, port: int, rank: int, backend: str, timeout: float, address: str | None = None):
    """The weight group of two (server rank 0 hosts its TCPStore on host:port), a torch.distributed process group
    of its own: the default group (Accelerate's, vLLM's) is not touched. `address`: the local address gloo binds
    to (the one the other end reaches this process at)."""
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, 2, is_master=rank == SERVER_RANK, timeout=wait)
    prefixed = dist.PrefixStore("marlhf_weights", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options), store
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address or host)]
    options._timeout = wait
    return dist.ProcessGroupGloo(prefixed, rank, 2, options), store


def broadcast(group, tensor: torch.Tensor, root: int) -> None:
    """`tensor` from rank `root` to the other end of the weight group (in place on the receiving end)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    group.broadcast([tensor], options).wait()


@register_engine("vllm_server", options=VLLMServerOptions)
class VLLMServerEngine:
    """Samples through `marlhf vllm-serve` at the option `server_url` (see the module docstring)."""

    def __init__(self, context: EngineContext | None = None) -> None:
        options = context.options if context is not None else None
        self.options = options if isinstance(options, VLLMServerOptions) else VLLMServerOptions()
        accelerator = context.accelerator if context is not None else None
        self.accelerator = accelerator
        self.is_main = accelerator is None or accelerator.is_main_process
        self.backend = self.options.server_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.host = urllib.parse.urlparse(self.options.server_url).hostname
        self.group = self.store = None
        self.synced = False
        self.last_sync: list[str] = []  # the names the last sync sent (what changed)
        self.server = self._wait_for_server()

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.options.server_url.rstrip("/") + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.options.server_timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            with contextlib.suppress(Exception):
                detail = json.loads(detail)["error"]
            raise MarlhfError(f"vllm-serve at {self.options.server_url} refused {path}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            if path == "/health":
                raise  # _wait_for_server tries again
            reason = getattr(error, "reason", error)
            options = self.options
            raise MarlhfError(f"vllm-serve at {options.server_url} did not answer {path} ({reason}; the vllm_server "
                              f"option server_timeout is {options.server_timeout:g} s): is it still running?") from None

    def _wait_for_server(self) -> dict:
        """The server's /health, tried until server_connect_timeout: else one line naming the URL and what to do."""
        deadline = time.monotonic() + self.options.server_connect_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self._request("/health", timeout=max(min(left, 3.0), 0.1))
            except (urllib.error.URLError, OSError, ValueError) as error:  # refused, no route, timed out
                reason = getattr(error, "reason", error)
                if time.monotonic() + 0.5 > deadline:
                    options = self.options
                    raise MarlhfError(
                        f"rollout engine 'vllm_server': no server answers at {options.server_url} ({reason}) after "
                        f"{options.server_connect_timeout:g} s: start one with `marlhf vllm-serve --model PATH --port "
                        "PORT` and give its address in the vllm_server option server_url") from None
                time.sleep(0.5)

    # -- weights --------------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Join the weight group as rank 1 (the server makes its end on /init_communicator)."""
        timeout = self.options.server_timeout
        self._request("/init_communicator", {"backend": self.backend, "group_port": self.options.server_group_port,
                                             "timeout": timeout})
        self.group, self.store = weight_group(self.host, self.options.server_group_port, TRAINER_RANK, self.backend,
                                              timeout, address=_local_address(self.host, self.options.server_url))

    def sync_weights(self, policy: nn.Module) -> None:
        """The policy's weights to the server: all of them the first time, then the buckets that can change."""
        if self.is_main and self.group is None:
            self._connect()
        device = "cuda" if self.backend == "nccl" else "cpu"
        sent = []
        for _, bucket in itertools.groupby(_policy_weights(policy, changed_only=self.synced),
                                           key=lambda pair: _bucket(pair[0])):
            bucket = list(bucket)  # a collective under ZeRO-3 / FSDP: every process iterates
            if not self.is_main:
                continue
            self._request("/update_weights", {"params": [[name, str(tensor.dtype).removeprefix("torch."),
                                                          list(tensor.shape)] for name, tensor in bucket]})
            for name, tensor in bucket:
                broadcast(self.group, tensor.detach().to(device).contiguous(), TRAINER_RANK)
                sent.append(name)
        if self.is_main:
            self._request("/weights_loaded", {})  # answered when they are in vLLM (a failed update: one line)
        self.synced, self.last_sync = True, sent
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()  # no process asks for a rollout before the weights are in

    # -- the engine seam --------------------------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, row_seeds: Sequence[int] | None = None,
                 max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 eos_token_id: int | Sequence[int], pad_token_id: int,
                 return_logprobs: bool = False) -> Generation:
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        if row_seeds is None:
            row_seeds = torch.randint(2**31 - 1, (prompt_ids.shape[0],)).tolist()
        if len(row_seeds) != prompt_ids.shape[0]:
            raise ValueError(f"`row_seeds` has {len(row_seeds)} seeds for {prompt_ids.shape[0]} prompts")
        prompts = [row[mask].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu().bool())]
        answer = self._request("/generate", {
            "prompts": prompts, "row_seeds": [int(seed) for seed in row_seeds], "max_new_tokens": max_new_tokens,
            "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "eos_token_id": torch.as_tensor(eos_token_id).reshape(-1).tolist(), "pad_token_id": int(pad_token_id),
            "return_logprobs": return_logprobs})
        device = prompt_ids.device
        response_ids = torch.tensor(answer["response_ids"], dtype=torch.long).reshape(len(prompts), -1)
        response_mask = torch.tensor(answer["response_mask"], dtype=torch.bool).reshape(response_ids.shape)
        logprobs = None if answer["logprobs"] is None else \
            torch.tensor(answer["logprobs"], dtype=torch.float32).reshape(response_ids.shape).to(device)
        return Generation(response_ids.to(device), response_mask.to(device), logprobs)

    def close(self) -> None:
        """Leave the weight group (the server goes on serving: stop it with Ctrl-C or SIGTERM)."""
        if self.group is not None:
            with contextlib.suppress(Exception):
                self._request("/close_communicator", {}, timeout=min(self.options.server_timeout, 30.0))
            self.group = self.store = None


def _local_address(host: str, url: str) -> str:
    """This machine's address on the route to `host` (where the server reaches the trainer's end of the group)."""
    port = urllib.parse.urlparse(url).port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"

