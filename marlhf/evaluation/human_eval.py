"""Human pairwise evaluation: a small local web page (stdlib http.server on 127.0.0.1).

Each page shows one prompt and two anonymised responses, A's on a side drawn by a seeded coin; the
annotator picks the left one, the right one, or a tie. Each choice is appended to a JSONL file as
soon as it is made (mapped back to "A" / "B" / "tie"), so closing the browser loses nothing and a
restart continues with the first prompt not yet annotated. `summarize_choices` gives the win rate of
A per annotator and, for two annotators, their agreement (raw and Cohen's kappa).
"""

from __future__ import annotations

import html
import json
import signal
import threading
import time
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from marlhf.data.records import read_jsonl
from marlhf.errors import MarlhfError
from marlhf.evaluation.judge import a_shown_first, summarize_winners

CHOICES = {"left", "right", "tie"}

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
.prompt,.response{white-space:pre-wrap;border:1px solid #ccc;border-radius:6px;padding:.8em;background:#fafafa}
.pair{display:flex;gap:1em}.pair>div{flex:1}button{font-size:1.05em;padding:.5em 1.2em;margin:.3em}
.progress{color:#666}"""


class HumanEvalSession:
    """The items to annotate and the choices file; thread-safe (the server handles requests in threads)."""

    def __init__(self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str],
                 out_path: str | Path, seed: int = 0, annotator: str = "") -> None:
        a_left = a_shown_first(prompts, responses_a, responses_b, seed)
        self.items = [{"prompt": p, "a": a, "b": b, "a_left": left}
                      for p, a, b, left in zip(prompts, responses_a, responses_b, a_left)]
        self.out_path = Path(out_path)
        self.annotator = annotator
        self._lock = threading.Lock()
        self._choices: dict[int, str] = {}
        if self.out_path.exists():
            for row in _read_jsonl(self.out_path):
                if row["index"] >= len(self.items) or row["prompt"] != self.items[row["index"]]["prompt"]:
                    raise ValueError(f"{self.out_path} holds choices for other prompts; pick another --out")
                self._choices[row["index"]] = row["choice"]

    def next_index(self) -> int | None:
        with self._lock:
            return next((i for i in range(len(self.items)) if i not in self._choices), None)

    def record(self, index: int, side: str) -> None:
        """Store the choice of `side` ("left" | "right" | "tie") for item `index` (a repeat is ignored)."""
        if side not in CHOICES:
            raise ValueError(f"side must be one of {sorted(CHOICES)}, got {side!r}")
        if not 0 <= index < len(self.items):
            raise ValueError(f"index must be in [0, {len(self.items)}), got {index}")
        item = self.items[index]
        choice = "tie" if side == "tie" else "A" if (side == "left") == item["a_left"] else "B"
        with self._lock:
            if index in self._choices:
                return
            self._choices[index] = choice
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.out_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"index": index, "prompt": item["prompt"], "choice": choice,
                                    "a_shown_left": item["a_left"], "annotator": self.annotator,
                                    "time": time.time()}, ensure_ascii=False) + "\n")

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return summarize_winners(list(self._choices.values()))

    def page(self) -> str:
        index = self.next_index()
        if index is None:
            s = self.summary()
            body = (f"<h1>All {len(self.items)} prompts annotated. Thank you.</h1>"
                    f"<p id='summary'>A wins {s['wins']}, ties {s['ties']}, B wins {s['losses']}; "
                    f"win rate of A: {s['win_rate']:.3f}</p>")
            return _document(body)
        item = self.items[index]
        left, right = (item["a"], item["b"]) if item["a_left"] else (item["b"], item["a"])
        body = (
            f"<p class='progress'>Prompt {index + 1} of {len(self.items)}</p>"
            f"<h2>Prompt</h2><div class='prompt' id='prompt'>{html.escape(item['prompt'])}</div>"
            "<div class='pair'>"
            f"<div><h2>Response 1</h2><div class='response' id='left'>{html.escape(left)}</div></div>"
            f"<div><h2>Response 2</h2><div class='response' id='right'>{html.escape(right)}</div></div></div>"
            f"<form method='post' action='/choose'><input type='hidden' name='index' value='{index}'>"
            "<button id='choose-left' name='side' value='left'>Response 1 is better</button>"
            "<button id='choose-tie' name='side' value='tie'>Tie</button>"
            "<button id='choose-right' name='side' value='right'>Response 2 is better</button></form>"
        )
        return _document(body)


def _document(body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>marlhf human evaluation</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")


def make_server(session: HumanEvalSession, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server for `session` (port 0: any free port; `server.server_address` says which).
    Call `serve_forever()` on it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if urllib.parse.urlsplit(self.path).path != "/":
                self.send_error(404)
                return
            payload = session.page().encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            if self.path != "/choose":
                self.send_error(404)
                return
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
            try:
                session.record(int(form["index"][0]), form["side"][0])
            except (KeyError, ValueError) as error:
                self.send_error(400, f"bad choice: {error}")
                return
            self.send_response(303)  # back to GET /: reloading the page never resubmits
            self.send_header("Location", "/")
            self.end_headers()

        def log_message(self, *args: Any) -> None:  # one line per click would drown the terminal
            pass

    try:
        return ThreadingHTTPServer((host, port), Handler)
    except OSError as error:  # address in use, not this machine's, no permission for a low port
        raise MarlhfError(f"cannot serve on {host}:{port}: {error.strerror or error}; choose another --port "
                          "(0: any free one) or --host") from error


def serve(session: HumanEvalSession, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted (Ctrl-C, or SIGTERM from `kill`), then print the summary."""
    server = make_server(session, host, port)
    # A shell starts background jobs with SIGINT ignored, and Python then keeps it ignored; the caller's
    # handlers come back afterwards.
    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        previous_handlers = {stop_signal: signal.signal(stop_signal, signal.default_int_handler)
                             for stop_signal in (signal.SIGINT, signal.SIGTERM)}
    print(f"human evaluation: open http://{host}:{server.server_address[1]}/ ; choices go to {session.out_path}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        for stop_signal, handler in previous_handlers.items():
            signal.signal(stop_signal, handler)
    print(json.dumps(session.summary()))


def _read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(path, fields=("index", "prompt", "choice"))


def cohen_kappa(labels_1: Sequence[str], labels_2: Sequence[str]) -> float:
    """Agreement beyond chance of two annotators' labels of the same items; NaN when chance
    agreement is 1 (both gave one and the same label to everything)."""
    if len(labels_1) != len(labels_2) or not labels_1:
        raise ValueError(f"labels_1 and labels_2 must be non-empty and of the same length, got {len(labels_1)} and {len(labels_2)}")
    n = len(labels_1)
    observed = sum(a == b for a, b in zip(labels_1, labels_2)) / n
    chance = sum((labels_1.count(c) / n) * (labels_2.count(c) / n) for c in set(labels_1) | set(labels_2))
    return float("nan") if chance == 1 else (observed - chance) / (1 - chance)


def summarize_choices(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Win rate of A in each choices file; with two files, agreement on the prompts both annotated."""
    if not 1 <= len(paths) <= 2:
        raise ValueError(f"--summary takes one or two choices files, got {len(paths)}")
    choices = [{row["prompt"]: row["choice"] for row in _read_jsonl(path)} for path in paths]
    for path, annotated in zip(paths, choices):
        if not annotated:
            raise ValueError(f"{path} holds no choices")
    result: dict[str, Any] = {"annotators": [{"file": str(p), "num_choices": len(c), **summarize_winners(list(c.values()))}
                                             for p, c in zip(paths, choices)]}
    if len(paths) == 2:
        common = [p for p in choices[0] if p in choices[1]]
        if not common:
            raise ValueError(f"{paths[0]} and {paths[1]} share no annotated prompt")
        first, second = [choices[0][p] for p in common], [choices[1][p] for p in common]
        result["agreement"] = {"num_common": len(common),
                               "raw": sum(a == b for a, b in zip(first, second)) / len(common),
                               "cohen_kappa": cohen_kappa(first, second)}
    return result
