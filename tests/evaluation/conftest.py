"""Shared helpers of the evaluation tests: a fake OpenAI-compatible judge server, fake training runs."""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from marlhf.logging_utils import MetricsLogger


class FakeJudgeHandler(BaseHTTPRequestHandler):
    """OpenAI-style chat endpoint. The judge prefers the response containing GOOD (or always
    answers `server.fixed_answer`); `server.failures` lists statuses / "sleep" to serve first."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            failure = server.failures.pop(0) if server.failures else None
        if failure == "sleep":
            time.sleep(0.6)  # longer than the client's timeout
        elif failure is not None:
            self.send_response(failure)
            if failure == 429:
                self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(b'{"error": "try again"}')
            return
        message = body["messages"][0]["content"]
        first = re.search(r"\[Response 1\]\n(.*?)\n\n\[Response 2\]", message, re.S).group(1)
        answer = server.fixed_answer or ("1" if "GOOD" in first else "2")
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudgeHandler)
    server.requests, server.failures, server.fixed_answer, server.lock = [], [], None, threading.Lock()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield server
    server.shutdown()
    server.server_close()


def write_run(path, seed, num_steps=30, with_value=True, reward_offset=0.0):
    rng = np.random.default_rng(seed)
    with MetricsLogger(path) as logger:
        for step in range(1, num_steps + 1):
            metrics = {
                "objective/rm_score": reward_offset + np.log(step) + rng.normal(0, 0.2),
                "objective/kl": 0.05 * step + rng.normal(0, 0.05),
                "val/advantage_l2": 2.0 / np.sqrt(step) + rng.normal(0, 0.05),
                "macro/mean_segment_length": 5.0 + rng.normal(0, 0.3),
                "objective/repetition": min(1.0, 0.01 * step),
            }
            if with_value:
                metrics["val/return_l2"] = 1.0 + 0.02 * step
            logger.log(metrics, step)
