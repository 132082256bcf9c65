"""A rollout engine in its own process: `RolloutWorker` runs any registered engine (hf, vllm, or one named by
dotted path) with its options in a child process started by torch.multiprocessing (spawn), on the CPU threads it
is given, and answers the trainer's requests (prompts, per-row seeds, sampling settings) with `Generation`s that
carry the sampling log-probs, or runs a function of its engine that a higher layer sends (`submit_call`: the
episodes of an environment, marlhf.trainers.staleness).

    worker = RolloutWorker(WorkerSpec("hf", HFOptions(), max_length=64, threads=1, log_path="out/rollout_worker_0.log"))
    worker.send_weights(policy)              # the whole model the first time, then only what training changes
    worker.submit(7, prompt_ids, prompt_mask, row_seeds=[...], max_new_tokens=..., ...)
    generation, seconds, tokens = worker.result(7)  # waits at most `timeout` s; dead or hung worker: MarlhfError
    worker.close()

The worker holds a plain copy of the policy (built from its config, LoRA adapters merged in) that it hands to its
engine's `sync_weights` before each request that follows new weights; requests are served in order, so a request
is sampled with the last weights sent before it. Weights travel as torch.multiprocessing shared-memory tensors: the
trainer copies each tensor once into shared memory and the worker copies it into its model, with no serialisation
and no socket, which is what a worker on the same machine wants (docs/async.md; a worker on another machine is
the vLLM server mode's job). After the first sync only the tensors training can change move (with LoRA: the
adapted layers, merged; the rule of the vllm engine's weight sync).

Life cycle: the child dies with the trainer (Linux: PR_SET_PDEATHSIG; elsewhere it polls its parent every
second), ignores Ctrl-C (the trainer handles it and stops the worker), and writes its stdout and stderr to
`log_path`. `close()` asks it to stop, then terminates and kills it if it does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from marlhf.config import option
from marlhf.engines.base import EngineContext, Generation, make_engine
from marlhf.errors import MarlhfError, one_line

__all__ = ["AsyncRolloutOptions", "WorkerSpec", "RolloutWorker"]

_POLL_SECONDS = 0.2  # how often a waiting trainer checks that its worker is alive


@dataclasses.dataclass
class AsyncRolloutOptions:
    """The asynchronous rollouts' options (docs/async.md), the one home of their declarations and of the rules
    between them: PPOConfig holds their values in its block `async_rollout_options`, reads them as
    `config.async_rollout` and takes each flat too (`--max_staleness 1`; marlhf.trainers.ppo_config.BLOCKS)."""

    max_staleness: int = option(
        0, "sample step t's responses with the policy after step max(start, t - k) in rollout worker processes, "
           "which work k steps ahead while the trainer trains; the loss corrects for the lag (the ppo loss's "
           "staleness_correction and behaviour_cap). 0: each step samples with its own policy (synchronous)", ge=0)
    rollout_workers: int = option(
        0, "rollout engine processes per training process, each step's responses (or episodes) split between them "
           "(0: the engine runs in the trainer, between the other stages; max_staleness > 0 needs >= 1)", ge=0)
    rollout_worker_threads: int = option(1, "torch CPU threads of each rollout worker", ge=1)
    rollout_worker_timeout: float = option(
        600.0, "seconds a waiting trainer gives a silent rollout worker (no result, no request started) before "
               "it stops the run: a hung worker", gt=0)

    def __post_init__(self) -> None:
        if self.max_staleness and not self.rollout_workers:
            raise ValueError(f"max_staleness={self.max_staleness} samples ahead of training in rollout worker "
                             "processes: set rollout_workers >= 1")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker process runs: the engine by name (or dotted path) with its options and the run's context
    budget (EngineContext), `threads` torch CPU threads, its log file, its number among the run's workers, and how
    long the trainer waits for one result before it calls the worker hung (seconds)."""

    engine: str
    options: Any = None
    max_length: int | None = None
    threads: int = 1
    log_path: str = "rollout_worker_0.log"
    index: int = 0
    timeout: float = 600.0


class RolloutWorker:
    """The trainer's handle on one rollout worker process (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        context = torch.multiprocessing.get_context("spawn")  # no fork: the trainer may hold threads, CUDA, locks
        self.requests = context.Queue()
        self.results = context.Queue()
        self.process = context.Process(target=_serve, args=(spec, os.getpid(), self.requests, self.results),
                                       name=f"marlhf-rollout-worker-{spec.index}", daemon=True)
        with _main_path_kept_if_it_exists():
            self.process.start()
        self.has_model = False
        self.pending: dict[int, tuple] = {}  # results that arrived before they were asked for
        self._sent: list = []  # the last message's shared tensors, kept alive until the worker has them

    @property
    def name(self) -> str:
        return f"rollout worker {self.spec.index} (pid {self.process.pid})"

    def send_weights(self, policy: nn.Module) -> None:
        """The policy's current weights: the worker's requests submitted after this are sampled with them."""
        from marlhf.engines.vllm import _is_peft, _policy_weights

        base = policy.get_base_model() if _is_peft(policy) else policy
        if not self.has_model:  # the architecture once: the worker builds an empty copy from the config
            dtype = next(base.parameters()).dtype
            self._put(("model", type(base), base.config, getattr(base, "generation_config", None), dtype))
        # clones: the trainer's own tensors change in place while the message waits in the queue
        weights = {name: tensor.detach().to("cpu", copy=True)
                   for name, tensor in _policy_weights(policy, changed_only=self.has_model)}
        self._sent = [weights]
        self._put(("weights", weights))
        self.has_model = True

    def submit(self, request_id: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
               row_seeds: Sequence[int], **sampling: Any) -> None:
        """Ask for a Generation of these prompts (the engine's `generate` arguments); `result(request_id)` returns
        it."""
        self.submit_call(request_id, _generate, prompt_ids=prompt_ids.cpu(), prompt_mask=prompt_mask.cpu(),
                         row_seeds=[int(s) for s in row_seeds], **sampling)

    def submit_call(self, request_id: int, function: Callable[..., tuple[Any, int, int]], **arguments: Any) -> None:
        """Ask for `function(engine, **arguments)`, run in the worker with its engine (synced with the last weights
        sent) and without gradients; `result(request_id)` returns its result. `function` travels by name (a
        module-level function) and returns (its result, CPU tensors only; the rows; the tokens generated): a
        layer above the engines runs its own work this way (the episodes of an environment)."""
        self._put(("call", request_id, function, arguments))

    def result(self, request_id: int) -> tuple[Any, float, int]:
        """(the result of request `request_id`, a Generation for `submit`; the worker's seconds on it; its tokens
        generated). A worker that dies or fails, or sends nothing for the spec's timeout while the trainer waits (it
        reports when it is ready and when it starts each request: a hang inside one request or in its start-up):
        MarlhfError, one line naming the worker, its exit status and its log file (a hung one is killed first)."""
        deadline = time.monotonic() + self.spec.timeout
        while request_id not in self.pending:
            try:
                message = self.results.get(timeout=_POLL_SECONDS)
                deadline = time.monotonic() + self.spec.timeout  # it made progress
            except queue.Empty:
                if not self.process.is_alive():
                    raise self._failure(f"exited with status {self.process.exitcode}") from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise self._failure(f"sent nothing for {self.spec.timeout:g} s (rollout_worker_timeout); "
                                        f"killed it (exit status {self.process.exitcode})") from None
                continue
            if message[0] == "error":
                self.process.join(5)
                raise self._failure(f"failed: {message[1]} (exit status {self.process.exitcode})")
            if message[0] == "done":
                self.pending[message[1]] = message[2:]
        return self.pending.pop(request_id)

    def close(self) -> None:
        """Stop the worker: ask, then terminate, then kill. Safe to call twice and on a dead worker."""
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.requests.put(("stop",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self.kill()
        for channel in (self.requests, self.results):
            channel.cancel_join_thread()  # unread messages must not keep the trainer from exiting
            channel.close()
        self._sent = []

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _put(self, message: tuple) -> None:
        if not self.process.is_alive():
            raise self._failure(f"exited with status {self.process.exitcode}")
        self.requests.put(message)

    def _failure(self, what: str) -> MarlhfError:
        return MarlhfError(f"{self.name} {what}; its log: {self.spec.log_path}")


# ---------------------------------------------------------------------------------------------- the child
def _serve(spec: WorkerSpec, parent_pid: int, requests, results) -> None:
    """The worker process: build the engine, then serve requests in order until told to stop or orphaned."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer decides
    log = open(spec.log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    torch.set_num_threads(spec.threads)
    print(f"rollout worker {spec.index}: pid {os.getpid()}, engine {spec.engine}, {spec.threads} thread(s)",
          flush=True)
    engine, model, synced = None, None, False
    try:
        engine = make_engine(spec.engine, EngineContext(None, spec.options, max_length=spec.max_length))
        results.put(("ready",))
        while True:
            try:
                message = requests.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:  # orphaned where PR_SET_PDEATHSIG does not exist
                    return
                continue
            kind = message[0]
            if kind == "stop":
                return
            if kind == "model":
                model_class, config, generation_config, dtype = message[1:]
                model = model_class._from_config(config, torch_dtype=dtype)
                if generation_config is not None:
                    model.generation_config = generation_config
                model.eval().requires_grad_(False)
            elif kind == "weights":
                missing = set(message[1]) - set(model.state_dict())
                if missing:
                    raise ValueError(f"the policy's weights {sorted(missing)[:3]} are not in the worker's model")
                model.load_state_dict(message[1], strict=False)
                synced = False
            elif kind == "call":
                request_id, function, arguments = message[1:]
                results.put(("started", request_id))
                start = time.perf_counter()
                if not synced:
                    engine.sync_weights(model)
                    synced = True
                with torch.no_grad():
                    value, rows, tokens = function(engine, **arguments)
                seconds = time.perf_counter() - start
                results.put(("done", request_id, value, seconds, tokens))
                print(f"request {request_id}: {rows} rows, {tokens} tokens, {seconds:.3f} s", flush=True)
    except BaseException as error:  # the trainer reads the line; the traceback stays in the log
        traceback.print_exc()
        results.put(("error", one_line(error)))
        sys.stdout.flush()
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()


def _generate(engine: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row_seeds: list[int],
              **sampling: Any) -> tuple[Generation, int, int]:
    """A `submit` request in the worker: the engine's Generation, on the CPU."""
    generation = engine.generate(prompt_ids, prompt_mask, row_seeds=row_seeds, **sampling)
    logprobs = generation.logprobs.cpu() if generation.logprobs is not None else None
    response_mask = generation.response_mask.cpu()
    return (Generation(generation.response_ids.cpu(), response_mask, logprobs), len(row_seeds),
            int(response_mask.sum()))


@contextlib.contextmanager
def _main_path_kept_if_it_exists():
    """spawn re-runs the trainer's main script in the child from its path: a main read from stdin (`python -`,
    a heredoc) has none ('<stdin>'), so for the start it is hidden and the child runs no main, as for `python -c`."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the trainer dies (Linux), and leave if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before the line above took effect
        os._exit(1)
