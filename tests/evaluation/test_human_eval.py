"""The human-evaluation page, driven in headless Chromium through chromedriver's W3C WebDriver HTTP
API (plain urllib: no client library needed)."""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from marlhf.evaluation.human_eval import HumanEvalSession, cohen_kappa, make_server, serve, summarize_choices

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ELEMENT_KEY = "element-6066-11e4-a52e-4f735466cecf"

needs_chromium = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="headless browser test needs /usr/bin/chromium and chromedriver: apt-get install -y chromium chromium-driver")


class WebDriver:
    """Just enough of the W3C WebDriver protocol: open a URL, find and click elements, read text."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        options = {"binary": CHROMIUM, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                                  "--disable-dev-shm-usage", "--no-first-run"]}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})["sessionId"]

    def _call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return json.loads(reply.read())["value"]
        except urllib.error.HTTPError as error:
            raise AssertionError(f"webdriver {method} {path}: {error.read()[:500]!r}") from error

    def get(self, url):
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def find(self, css):
        return self._call("POST", f"/session/{self.session}/element", {"using": "css selector", "value": css})[ELEMENT_KEY]

    def text(self, css):
        return self._call("GET", f"/session/{self.session}/element/{self.find(css)}/text")

    def click(self, css):
        self._call("POST", f"/session/{self.session}/element/{self.find(css)}/click", {})

    def source(self):
        return self._call("GET", f"/session/{self.session}/source")

    def wait_for(self, text, timeout_s=10.0):
        """Wait until the page source contains `text` (a click may return before the next page loads)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.source():
            if time.monotonic() > deadline:
                raise AssertionError(f"page never showed {text!r}")
            time.sleep(0.05)

    def quit(self):
        self._call("DELETE", f"/session/{self.session}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    port = free_port()
    driver_process = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as reply:
                    if json.loads(reply.read())["value"]["ready"]:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromedriver did not start within 30 s")
            time.sleep(0.1)
        driver = WebDriver(port)
        yield driver
        driver.quit()
    finally:
        driver_process.terminate()
        driver_process.wait(timeout=10)


@pytest.fixture
def served(tmp_path):
    servers = []

    def start(session):
        server = make_server(session)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


PROMPTS = [f"Prompt number {i} <b>not bold</b>" for i in range(6)]
ALPHA = [f"alpha response {i}" for i in range(6)]
BETA = [f"beta response {i}" for i in range(6)]


@needs_chromium
def test_annotating_in_the_browser_records_choices_and_win_rate(browser, served, tmp_path):
    out = tmp_path / "choices.jsonl"
    session = HumanEvalSession(PROMPTS, ALPHA, BETA, out, seed=7, annotator="ann1")
    url = served(session)
    browser.get(url)
    alpha_sides = []
    for index in range(6):
        browser.wait_for(f"Prompt {index + 1} of 6")
        assert browser.text("#prompt") == PROMPTS[index]  # escaped, shown as text
        left, right = browser.text("#left"), browser.text("#right")
        assert {left, right} == {ALPHA[index], BETA[index]}
        alpha_sides.append("left" if left == ALPHA[index] else "right")
        if index == 5:
            browser.click("#choose-tie")
        elif index == 4:  # B wins once
            browser.click("#choose-" + ("right" if alpha_sides[-1] == "left" else "left"))
        else:
            browser.click("#choose-" + alpha_sides[-1])
    assert set(alpha_sides) == {"left", "right"}  # A's side is randomised
    browser.wait_for("All 6 prompts annotated")
    assert "win rate of A: 0.750" in browser.text("#summary")  # (4 + 0.5) / 6
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["choice"] for r in rows] == ["A", "A", "A", "A", "B", "tie"]
    assert [r["a_shown_left"] for r in rows] == [side == "left" for side in alpha_sides]
    assert {r["annotator"] for r in rows} == {"ann1"}
    assert "alpha" not in browser.source().split("<form")[-1]  # the form reveals no mapping

    # a restart on the same file continues where the annotator stopped: here, nothing is left
    assert HumanEvalSession(PROMPTS, ALPHA, BETA, out, seed=7).next_index() is None


@needs_chromium
def test_resume_after_a_partial_session(browser, served, tmp_path):
    out = tmp_path / "choices.jsonl"
    session = HumanEvalSession(PROMPTS[:3], ALPHA[:3], BETA[:3], out, seed=1)
    session.record(0, "tie")
    url = served(HumanEvalSession(PROMPTS[:3], ALPHA[:3], BETA[:3], out, seed=1))
    browser.get(url)
    assert browser.text("#prompt") == PROMPTS[1]
    assert "Prompt 2 of 3" in browser.source()


def test_record_maps_sides_back_and_ignores_repeats(tmp_path):
    session = HumanEvalSession(["p0", "p1"], ["a0", "a1"], ["b0", "b1"], tmp_path / "c.jsonl", seed=0)
    for index, item in enumerate(session.items):
        session.record(index, "left" if item["a_left"] else "right")
    session.record(0, "tie")  # a stale form submitted twice
    assert [json.loads(line)["choice"] for line in (tmp_path / "c.jsonl").read_text().splitlines()] == ["A", "A"]
    with pytest.raises(ValueError, match="side"):
        session.record(1, "up")
    with pytest.raises(ValueError, match="other prompts"):
        HumanEvalSession(["other"], ["x"], ["y"], tmp_path / "c.jsonl")


def test_bad_post_is_rejected(served, tmp_path):
    url = served(HumanEvalSession(["p"], ["a"], ["b"], tmp_path / "c.jsonl"))
    request = urllib.request.Request(url + "choose", data=b"index=0&side=sideways", method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=5)
    assert error.value.code == 400
    assert not (tmp_path / "c.jsonl").exists()


def kappa_reference(x, y):
    labels = sorted(set(x) | set(y))
    n = len(x)
    table = [[sum(1 for a, b in zip(x, y) if a == r and b == c) for c in labels] for r in labels]
    observed = sum(table[i][i] for i in range(len(labels))) / n
    expected = sum(sum(table[i]) * sum(row[i] for row in table) for i in range(len(labels))) / n**2
    return (observed - expected) / (1 - expected)


def test_agreement_of_two_annotators(tmp_path):
    first = ["A", "A", "B", "tie", "A", "B", "A", "B"]
    second = ["A", "B", "B", "tie", "A", "A", "A", "B"]
    for name, labels in (("one", first), ("two", second)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i, choice in enumerate(labels):
                f.write(json.dumps({"index": i, "prompt": f"p{i}", "choice": choice}) + "\n")
    summary = summarize_choices([tmp_path / "one.jsonl", tmp_path / "two.jsonl"])
    assert summary["annotators"][0]["win_rate"] == pytest.approx((4 + 0.5) / 8)
    assert summary["agreement"]["num_common"] == 8
    assert summary["agreement"]["raw"] == pytest.approx(6 / 8)
    assert summary["agreement"]["cohen_kappa"] == pytest.approx(kappa_reference(first, second))
    assert math.isnan(cohen_kappa(["A", "A"], ["A", "A"]))
    assert cohen_kappa(["A", "B"], ["A", "B"]) == pytest.approx(1.0)


def test_serve_stops_on_sigterm_and_gives_the_callers_handlers_back(tmp_path, capsys):
    session = HumanEvalSession(["p"], ["a"], ["b"], tmp_path / "choices.jsonl")
    caller_handler = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, caller_handler)
    interrupt_handler = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs as a shell's background job
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        serve(session, port=0)
        assert signal.getsignal(signal.SIGTERM) is caller_handler
        assert signal.getsignal(signal.SIGINT) is interrupt_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ties"] == 0


@pytest.mark.parametrize("options, expected", [
    (["--port", "99999"], r"human-eval: argument --port: a port is a whole number from 0 to 65535, got '99999'"),
    (["--port", "-1"], r"human-eval: argument --port: a port is a whole number from 0 to 65535, got '-1'"),
    (["--port", "0", "--host", "192.0.2.1"], r"cannot serve on 192\.0\.2\.1:0: .*; choose another --port"),
    ([], r"cannot serve on 127\.0\.0\.1:\d+: Address already in use; choose another --port \(0: any free one\)"),
])
def test_a_port_or_host_that_cannot_be_served_is_one_line(tmp_path, capsys, options, expected):
    from marlhf.cli import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    with socket.socket() as taken:  # a port in use (the last case serves on it)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = ["--port", str(taken.getsockname()[1])] if not options else []
        try:
            code = main(["human-eval", "--a", str(pairs), "--b", str(pairs), "--out", str(tmp_path / "c.jsonl"),
                         *options, *port])
        except SystemExit as usage_error:  # argparse's, for an option's value
            code = usage_error.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert (code, len(lines)) == (2, 1)
    assert re.match(rf"marlhf: error: {expected}", lines[0]), lines[0]


def test_human_eval_without_its_files_is_one_line(capsys):
    from marlhf.cli import main

    assert main(["human-eval"]) == 2
    assert capsys.readouterr().err.startswith("marlhf: error: human-eval: --a, --b and --out are required")
