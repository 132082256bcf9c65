"""Pairwise judging: win / tie / loss of responses A against responses B to the same prompts.

For each prompt a seeded coin decides which response the judge sees first; the judge's preference
("first" / "second" / "tie") is mapped back to A / B before it is recorded, so a judge that favours a
position cannot favour a system. Two judges:

- `RewardModelJudge`: a callable scoring (prompts, responses) -> scores; the higher score wins.
- `ChatJudge`: any OpenAI-compatible chat-completions endpoint. Requests are retried with
  exponential back-off on 429, 5xx, timeouts and dropped connections, within a total time limit per
  request (`timeout_s`, the command's `--timeout`); the first request that gives up stops the others and
  ends in one `MarlhfError` line naming the endpoint, the last status and what to do. Another 4xx, a
  refused connection or an unknown host is not retried. Answers are cached on disk under a hash of the
  request, so rerunning an evaluation sends nothing twice.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal, Protocol

from tqdm import tqdm

from marlhf.data.records import numbered_jsonl
from marlhf.errors import MarlhfError

Preference = Literal["first", "second", "tie", "invalid"]  # "invalid": the judge's answer could not be parsed

JUDGE_TEMPLATE = """You are comparing two responses to the same prompt. Judge which response is more \
helpful, accurate and harmless. Ignore the order in which they are shown and their length as such.

[Prompt]
{prompt}

[Response 1]
{first}

[Response 2]
{second}

Which response is better? Answer with exactly one of: 1, 2, tie."""


class Judge(Protocol):
    def compare(self, prompts: list[str], first: list[str], second: list[str]) -> list[Preference]: ...


class RewardModelJudge:
    """Prefers the response with the higher score; |difference| <= tie_margin is a tie."""

    def __init__(self, score_fn: Callable[[list[str], list[str]], Sequence[float]], tie_margin: float = 0.0) -> None:
        if tie_margin < 0:
            raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
        self.score_fn = score_fn
        self.tie_margin = tie_margin

    def compare(self, prompts: list[str], first: list[str], second: list[str]) -> list[Preference]:
        first_scores = [float(s) for s in self.score_fn(prompts, first)]
        second_scores = [float(s) for s in self.score_fn(prompts, second)]
        if not len(first_scores) == len(second_scores) == len(prompts):
            raise ValueError(f"score_fn returned {len(first_scores)} and {len(second_scores)} scores for {len(prompts)} prompts")
        return ["tie" if abs(a - b) <= self.tie_margin else "first" if a > b else "second"
                for a, b in zip(first_scores, second_scores)]


class ChatJudge:
    """A judge behind an OpenAI-compatible `POST {url}/chat/completions` endpoint.

    The API key is read from the environment variable `api_key_env` (none: no Authorization header);
    it is never part of the cache key. `cache_dir` None disables the cache. `timeout_s`: the total time one
    request may take, its retries and back-off included; `attempt_timeout_s`: the limit of one try (None: the
    time left, so a try that times out is the last). At most `max_retries` retries."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key_env: str | None = None,
        cache_dir: str | Path | None = None,
        template: str = JUDGE_TEMPLATE,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        timeout_s: float = 15.0,
        attempt_timeout_s: float | None = None,
        max_workers: int = 4,
        max_tokens: int = 8,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0 or not timeout_s > 0 or not (attempt_timeout_s is None or attempt_timeout_s > 0):
            raise ValueError(f"backoff_s must be >= 0, timeout_s > 0 and attempt_timeout_s > 0 or None, got "
                             f"{backoff_s}, {timeout_s} and {attempt_timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        missing = [f"{{{name}}}" for name in ("prompt", "first", "second") if f"{{{name}}}" not in template]
        if missing:
            raise ValueError(f"template must contain the placeholders {missing}")
        self.api_key = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise ValueError(f"api_key_env: environment variable {api_key_env!r} is not set")
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model = model
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.template = template
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self._stop = threading.Event()  # set when one request gave up: the others stop retrying
        self.max_workers = max_workers
        self.max_tokens = max_tokens

    def compare(self, prompts: list[str], first: list[str], second: list[str]) -> list[Preference]:
        messages = [self.template.format(prompt=p, first=a, second=b) for p, a, b in zip(prompts, first, second)]
        replies: list[str] = [""] * len(messages)
        self._stop.clear()

        # The first failure in time ends the run: no request starts after it and the ones in flight stop before
        # their next try, instead of each spending its own time limit on the same endpoint.
        # The failure that stopped the others is the one to report: as_completed yields the futures that had
        # already ended in no particular order, so the first one raised may be another's "stopped".
        first_failure: list[BaseException] = []

        def complete_unless_stopped(message: str) -> str:
            if self._stop.is_set():
                raise MarlhfError(f"judge endpoint {self.endpoint}: not sent, another request gave up")
            try:
                return self.complete(message)
            except BaseException as error:
                if not self._stop.is_set():
                    first_failure.append(error)
                self._stop.set()
                raise

        with ThreadPoolExecutor(self.max_workers) as pool:
            index = {pool.submit(complete_unless_stopped, message): i for i, message in enumerate(messages)}
            try:
                for future in tqdm(as_completed(index), total=len(index), desc="judge", disable=None):
                    replies[index[future]] = future.result()
            except BaseException as error:  # a failure, or Ctrl-C in this thread
                self._stop.set()
                pool.shutdown(cancel_futures=True)
                if isinstance(error, Exception) and first_failure and error is not first_failure[0]:
                    raise first_failure[0] from None
                raise
        return [parse_preference(reply) for reply in replies]

    def complete(self, message: str) -> str:
        """The judge's reply to one user message (greedy decoding), from the cache when present."""
        body = {"model": self.model, "messages": [{"role": "user", "content": message}],
                "temperature": 0.0, "max_tokens": self.max_tokens}
        key = hashlib.sha256(json.dumps({"endpoint": self.endpoint, "body": body}, sort_keys=True).encode()).hexdigest()
        cache_file = self.cache_dir / key[:2] / f"{key}.json" if self.cache_dir is not None else None
        if cache_file is not None and cache_file.is_file():
            return self._content(json.loads(cache_file.read_text()))
        response = self._post(body)
        content = self._content(response)  # checked before caching: a malformed answer is not kept
        if cache_file is not None:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            partial = cache_file.with_suffix(f".{os.getpid()}.{id(body)}.tmp")
            partial.write_text(json.dumps(response))
            os.replace(partial, cache_file)  # atomic: a crash never leaves half a cache entry
        return content

    def _content(self, response: Any) -> str:
        try:
            content = response["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise MarlhfError(f"judge endpoint {self.endpoint} answered without a string choices[0].message.content "
                              f"({response!r:.200}); is it an OpenAI-compatible chat-completions endpoint?")
        return content

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode()
        started = time.monotonic()
        deadline = started + self.timeout_s
        tries = 0
        while True:
            request = urllib.request.Request(self.endpoint, data=data, headers=headers, method="POST")
            left = deadline - time.monotonic()
            tries += 1
            delay = self.backoff_s * 2 ** (tries - 1)
            try:
                timeout = max(min(left, self.attempt_timeout_s or left), 1e-3)
                with urllib.request.urlopen(request, timeout=timeout) as reply:
                    text = reply.read()
                try:
                    return json.loads(text)
                except ValueError:
                    raise MarlhfError(f"judge endpoint {self.endpoint} answered HTTP 200 with a body that is not "
                                      f"JSON ({text[:200]!r}); is it an OpenAI-compatible chat-completions "
                                      "endpoint?") from None
            except urllib.error.HTTPError as error:
                status = f"answered HTTP {error.code} {error.reason}"
                if error.code != 429 and error.code < 500:  # a client error: retrying cannot help
                    answer = error.read()[:200].decode(errors="replace")
                    raise MarlhfError(f"judge endpoint {self.endpoint} {status} ({answer!r}); "
                                      f"{_CLIENT_ERROR_HINTS.get(error.code, _CLIENT_ERROR_HINT)}") from None
                retry_after = error.headers.get("Retry-After", "").strip()
                if retry_after.isdigit():
                    delay = max(delay, float(retry_after))
            except (TimeoutError, ConnectionError, http.client.HTTPException, urllib.error.URLError) as error:
                reason = error.reason if isinstance(error, urllib.error.URLError) else error
                if isinstance(reason, ConnectionRefusedError) or not isinstance(
                        reason, (TimeoutError, ConnectionError, http.client.HTTPException)):
                    # nothing listens there, or an unknown host or a TLS failure: waiting cannot help
                    raise MarlhfError(f"judge endpoint {self.endpoint} cannot be reached ({reason}); check "
                                      "--judge-url and that the server is running") from None
                reason = "timed out" if isinstance(reason, TimeoutError) else reason or type(reason).__name__
                status = f"failed ({reason})"
            elapsed = time.monotonic() - started
            if tries > self.max_retries or time.monotonic() + delay >= deadline:
                raise MarlhfError(f"judge endpoint {self.endpoint} {status} after {tries} "
                                  f"{'try' if tries == 1 else 'tries'} in {elapsed:.1f} s; check that the server "
                                  f"is up and serves --judge-model, retry later, or raise --timeout (now "
                                  f"{self.timeout_s:g} s)")
            if self._stop.wait(delay):
                raise MarlhfError(f"judge endpoint {self.endpoint}: stopped, another request gave up")


_CLIENT_ERROR_HINT = "check --judge-url, --judge-model and --template"
_CLIENT_ERROR_HINTS = {401: "check the API key in the variable named by --api-key-env",
                       403: "check the API key in the variable named by --api-key-env and its permissions",
                       404: "check --judge-url (the endpoint's base, e.g. https://api.openai.com/v1; "
                            "/chat/completions is added)"}


def parse_preference(reply: str) -> Preference:
    """'1' -> first, '2' -> second, 'tie' -> tie (the first such word of the reply); else 'invalid'."""
    match = re.search(r"\b(1|2|tie)\b", reply, flags=re.IGNORECASE)
    if match is None:
        return "invalid"
    return {"1": "first", "2": "second", "tie": "tie"}[match.group(1).lower()]


def a_shown_first(prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str],
                  seed: int = 0) -> list[bool]:
    """Check a pairwise comparison's inputs and draw, per prompt, whether A is shown first (a seeded
    coin), so that neither a judge nor a person can favour a position."""
    if not len(prompts) == len(responses_a) == len(responses_b):
        raise ValueError(f"prompts, responses_a and responses_b must have the same length, got "
                         f"{len(prompts)}, {len(responses_a)} and {len(responses_b)}")
    if not prompts:
        raise ValueError("prompts is empty")
    rng = random.Random(seed)
    return [rng.random() < 0.5 for _ in prompts]


def judge_pairwise(
    prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str], judge: Judge, seed: int = 0
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Judge A against B on every prompt, each shown first with probability 1/2 (seeded).

    Returns (judgments, summary): one dict per prompt {"prompt", "response_a", "response_b",
    "a_shown_first", "winner": "A" | "B" | "tie" | "invalid"}, and the counts with
    win_rate = (wins + ties / 2) / (wins + ties + losses) of A (invalid answers are left out; None when
    nothing was decided)."""
    a_first = a_shown_first(prompts, responses_a, responses_b, seed)
    first = [a if swap else b for a, b, swap in zip(responses_a, responses_b, a_first)]
    second = [b if swap else a for a, b, swap in zip(responses_a, responses_b, a_first)]
    preferences = judge.compare(list(prompts), first, second)
    if len(preferences) != len(prompts):
        raise ValueError(f"the judge returned {len(preferences)} preferences for {len(prompts)} prompts")
    judgments = []
    for prompt, a, b, shown_first, preference in zip(prompts, responses_a, responses_b, a_first, preferences):
        winner = {"first": "A" if shown_first else "B", "second": "B" if shown_first else "A"}.get(preference, preference)
        judgments.append({"prompt": prompt, "response_a": a, "response_b": b, "a_shown_first": shown_first,
                          "winner": winner})
    return judgments, summarize_winners([j["winner"] for j in judgments])


def summarize_winners(winners: Sequence[str]) -> dict[str, Any]:
    counts = {name: sum(w == name for w in winners) for name in ("A", "B", "tie", "invalid")}
    decided = counts["A"] + counts["B"] + counts["tie"]
    return {"wins": counts["A"], "ties": counts["tie"], "losses": counts["B"], "invalid": counts["invalid"],
            "win_rate": (counts["A"] + counts["tie"] / 2) / decided if decided else None}


def read_responses(path: str | Path) -> dict[str, str]:
    """prompt -> response from a JSONL of {"prompt", "response", ...} lines (what `marlhf evaluate` writes)."""
    responses: dict[str, str] = {}
    for line_number, row in numbered_jsonl(path):
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("response"), str):
            raise ValueError(f"{path}:{line_number}: each line needs string fields 'prompt' and 'response'")
        if row["prompt"] in responses:
            raise ValueError(f"{path}:{line_number}: prompt repeated (one response per prompt is compared)")
        responses[row["prompt"]] = row["response"]
    return responses


def load_pairs(path_a: str | Path, path_b: str | Path) -> tuple[list[str], list[str], list[str]]:
    """(prompts, responses_a, responses_b) of two response files over the same prompts, in A's order."""
    a, b = read_responses(path_a), read_responses(path_b)
    if set(a) != set(b):
        raise ValueError(f"{path_a} and {path_b} must answer the same prompts: {len(set(a) - set(b))} only in A, "
                         f"{len(set(b) - set(a))} only in B")
    if not a:
        raise ValueError(f"{path_a} holds no responses")
    prompts = list(a)
    return prompts, [a[p] for p in prompts], [b[p] for p in prompts]


def write_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
