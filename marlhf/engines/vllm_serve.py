"""`marlhf vllm-serve --model PATH [--host HOST] [--port PORT] [--group_port PORT]`: the colocated vllm engine
(marlhf.engines.vllm) behind HTTP, for the trainer's `rollout_engine="vllm_server"` (marlhf.engines.vllm_server,
whose docstring has the API) on another device or machine.

The engine runs in the main thread, one job at a time from a queue: HTTP threads put jobs there (a rollout, the
weight group's set-up, a weight update, its close) and the jobs run in the order their requests came, so a
rollout asked for after a weight update is sampled with the new weights. A weight update answers its request at
once and then receives the tensors (the trainer broadcasts them after that answer); the trainer's
`/weights_loaded` is answered when they are in vLLM. A failed update is kept and refuses the rollouts after it, so
that no rollout comes from half-updated weights.

Stopped by Ctrl-C or SIGTERM: the HTTP server closes, the job in progress ends, the weight group and vLLM are
released, and the command exits 0 with one line.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import threading
import traceback
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from marlhf.engines.base import EngineContext
from marlhf.errors import MarlhfError, one_line

__all__ = ["run", "VLLMServer"]

def run(arguments: argparse.Namespace) -> int:
    """The command: load the model, build vLLM, serve until Ctrl-C or SIGTERM."""
    from transformers import AutoModelForCausalLM

    from marlhf.engines.vllm import VLLMEngine, VLLMOptions
    from marlhf.modeling import check_model_path

    check_model_path(arguments.model)
    options = VLLMOptions(kv_cache_gib=arguments.kv_cache_gib, max_model_len=arguments.max_model_len,
                          gpu_memory_utilization=arguments.gpu_memory_utilization,
                          engine_kwargs=arguments.engine_kwargs)
    engine = VLLMEngine(EngineContext(options=options))
    try:  # the port first: a taken one stops the command before the model loads
        server = VLLMServer(engine, arguments.host, arguments.port, arguments.group_port)
    except OSError as error:
        raise MarlhfError(f"vllm-serve cannot listen on {arguments.host}:{arguments.port} ({error.strerror}): "
                          "choose another --port or --host") from None
    model = AutoModelForCausalLM.from_pretrained(arguments.model, dtype=arguments.dtype).eval()
    engine.sync_weights(model)
    engine.build()  # requests that come meanwhile wait for it (they are served once the job loop runs)
    print(f"vllm-serve: {arguments.model} at http://{arguments.host}:{server.port} (weight group port "
          f"{arguments.group_port}); Ctrl-C stops it", flush=True)
    server.serve()
    print("vllm-serve: stopped", flush=True)
    return 0


class VLLMServer:
    """The HTTP front and the engine's job loop (see the module docstring)."""

    def __init__(self, engine, host: str, port: int, group_port: int) -> None:
        self.engine, self.group_port = engine, group_port
        self.jobs: queue.Queue = queue.Queue()
        self.group = self.store = None
        self.failed: str | None = None  # a weight update that failed: the rollouts after it are refused
        self.http = ThreadingHTTPServer((host, port), _handler(self))
        self.http.daemon_threads = True
        self.port = self.http.server_address[1]
        self.stopping = threading.Event()

    def serve(self) -> None:
        """Serve until `stop()` (Ctrl-C and SIGTERM call it); then release everything."""
        previous = {}
        if threading.current_thread() is threading.main_thread():  # elsewhere (tests) stop() is called directly
            previous = {sig: signal.signal(sig, lambda *_: self.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
        front = threading.Thread(target=self.http.serve_forever, name="vllm-serve-http", daemon=True)
        front.start()
        try:
            while not self.stopping.is_set():
                try:
                    job, future = self.jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                _run_job(job, future)
        finally:
            self.http.shutdown()
            self.http.server_close()
            front.join(5)
            self.group = self.store = None
            self.engine.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        self.stopping.set()

    def submit(self, job) -> Future:
        future: Future = Future()
        self.jobs.put((job, future))
        return future

    # -- the jobs (in the main thread) ----------------------------------------------------------------------
    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.failed is not None:
            raise MarlhfError(f"the last weight update failed ({self.failed}): restart vllm-serve")
        from marlhf.data.encoding import pad_sequences

        prompt_ids, prompt_mask = pad_sequences(body["prompts"], body["pad_token_id"], "left")
        generation = self.engine.generate(
            prompt_ids, prompt_mask.bool(), row_seeds=body["row_seeds"], max_new_tokens=body["max_new_tokens"],
            temperature=body["temperature"], top_k=body["top_k"], top_p=body["top_p"],
            eos_token_id=body["eos_token_id"], pad_token_id=body["pad_token_id"],
            return_logprobs=body["return_logprobs"])
        return {"response_ids": generation.response_ids.tolist(), "response_mask": generation.response_mask.tolist(),
                "logprobs": None if generation.logprobs is None else generation.logprobs.tolist()}

    def init_communicator(self, body: dict[str, Any], address: str) -> None:
        from marlhf.engines.vllm_server import SERVER_RANK, weight_group

        self.group = self.store = None  # a trainer that comes back replaces the old group
        self.failed = None
        self.group, self.store = weight_group(address, body.get("group_port", self.group_port), SERVER_RANK,
                                              body.get("backend", "gloo"), float(body.get("timeout", 600)),
                                              address=address)

    def update_weights(self, body: dict[str, Any]) -> None:
        from marlhf.engines.vllm_server import TRAINER_RANK, broadcast

        try:
            if self.group is None:
                raise MarlhfError("no weight group: the trainer calls /init_communicator first")
            device = "cuda" if torch.cuda.is_available() and type(self.group).__name__ == "ProcessGroupNCCL" else "cpu"
            weights = []
            for name, dtype, shape in body["params"]:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                broadcast(self.group, tensor, TRAINER_RANK)
                weights.append((name, tensor))
            self.engine.load_weights(weights)
        except Exception as error:
            self.failed = one_line(error)
            raise

    def weights_loaded(self) -> None:
        """Answered once the updates asked for before it are in vLLM (the jobs run in order); a failed one fails it."""
        if self.failed is not None:
            raise MarlhfError(f"a weight update failed ({self.failed}): restart vllm-serve")

    def close_communicator(self) -> None:
        self.group = self.store = None


def _run_job(job, future: Future) -> None:
    try:
        future.set_result(job())
    except Exception as error:  # the request's answer names it; the traceback goes to the server's console
        traceback.print_exc()
        future.set_exception(error)


def _handler(server: VLLMServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args) -> None:  # quiet: no line per request
            pass

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/health":
                self._answer(200, {"status": "ok", "group_port": server.group_port})
            else:
                self._answer(404, {"error": f"no such endpoint {self.path}"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            address = self.connection.getsockname()[0]  # where the trainer reached this server
            jobs = {"/generate": lambda: server.generate(body),
                    "/init_communicator": lambda: server.init_communicator(body, address),
                    "/update_weights": lambda: server.update_weights(body),
                    "/close_communicator": server.close_communicator,
                    "/weights_loaded": server.weights_loaded}
            job = jobs.get(self.path.rstrip("/"))
            if job is None:
                return self._answer(404, {"error": f"no such endpoint {self.path}"})
            future = server.submit(job)
            if self.path.rstrip("/") in ("/init_communicator", "/update_weights"):
                return self._answer(200, {"status": "queued"})  # the trainer's end of the collective comes next
            try:
                result = future.result()
                self._answer(200, result if isinstance(result, dict) else {"status": "ok"})
            except Exception as error:
                self._answer(400 if isinstance(error, ValueError) else 500, {"error": one_line(error)})

    return Handler
