import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from marlhf import cli
from marlhf.errors import MarlhfError
from marlhf.evaluation.judge import (ChatJudge, RewardModelJudge, judge_pairwise, load_pairs, parse_preference,
                                     write_jsonl)


PROMPTS = [f"question {i}" for i in range(12)]
GOOD = [f"GOOD answer {i}" for i in range(12)]
BAD = [f"poor answer {i}" for i in range(12)]


def make_judge(server, **kwargs):
    kwargs = {"backoff_s": 0.01, "timeout_s": 5.0, "max_workers": 2, **kwargs}
    return ChatJudge(server.url, "judge-model", **kwargs)


def test_order_is_randomised_and_undone(judge_server):
    judgments, summary = judge_pairwise(PROMPTS, GOOD, BAD, make_judge(judge_server), seed=3)
    assert [j["winner"] for j in judgments] == ["A"] * 12
    assert summary == {"wins": 12, "ties": 0, "losses": 0, "invalid": 0, "win_rate": 1.0}
    shown_first = [j["a_shown_first"] for j in judgments]
    assert 0 < sum(shown_first) < 12  # both orders occur
    # what the server saw agrees with the recorded order
    seen = {}
    for request in judge_server.requests:
        message = request["body"]["messages"][0]["content"]
        first = re.search(r"\[Response 1\]\n(.*?)\n", message).group(1)
        seen[int(first.split()[-1])] = first.startswith("GOOD")
    assert [seen[i] for i in range(12)] == shown_first
    assert judge_pairwise(PROMPTS, GOOD, BAD, RewardModelJudge(lambda p, r: [0.0] * len(r)), seed=3)[0][5][
        "a_shown_first"] == shown_first[5]  # the order depends on the seed only


def test_position_bias_cancels_out(judge_server):
    judge_server.fixed_answer = "1"  # always prefers whatever is shown first
    judgments, summary = judge_pairwise(PROMPTS, GOOD, BAD, make_judge(judge_server), seed=0)
    assert [j["winner"] == "A" for j in judgments] == [j["a_shown_first"] for j in judgments]
    assert summary["wins"] + summary["losses"] == 12 and 0 < summary["wins"] < 12


def test_retries_500_429_and_timeouts_then_succeeds(judge_server):
    judge_server.failures = [500, 429, "sleep", 503]
    judge = make_judge(judge_server, max_workers=1, attempt_timeout_s=0.3)
    assert judge.compare(["q"], ["GOOD one"], ["other"]) == ["first"]
    assert len(judge_server.requests) == 5
    assert judge_server.requests[0]["path"] == "/v1/chat/completions"


def test_gives_up_after_max_retries_and_does_not_retry_client_errors(judge_server):
    judge_server.failures = [500] * 3
    with pytest.raises(MarlhfError, match="answered HTTP 500 Internal Server Error after 3 tries"):
        make_judge(judge_server, max_workers=1, max_retries=2).compare(["q"], ["a"], ["b"])
    judge_server.requests.clear()
    judge_server.failures = [400]
    with pytest.raises(MarlhfError, match="HTTP 400"):
        make_judge(judge_server, max_workers=1).compare(["q"], ["a"], ["b"])
    assert len(judge_server.requests) == 1


def test_rerun_is_served_from_the_disk_cache(judge_server, tmp_path):
    first_run, _ = judge_pairwise(PROMPTS, GOOD, BAD, make_judge(judge_server, cache_dir=tmp_path / "cache"), seed=1)
    assert len(judge_server.requests) == 12
    judge_server.fixed_answer = "2"  # a server that now answers differently is never asked
    second_run, _ = judge_pairwise(PROMPTS, GOOD, BAD, make_judge(judge_server, cache_dir=tmp_path / "cache"), seed=1)
    assert len(judge_server.requests) == 12
    assert second_run == first_run
    judge_pairwise(PROMPTS[:1], ["new"], ["pair"], make_judge(judge_server, cache_dir=tmp_path / "cache"))
    assert len(judge_server.requests) == 13  # a different request is not a cache hit


def test_api_key_comes_from_the_named_environment_variable(judge_server, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    make_judge(judge_server, api_key_env="MY_JUDGE_KEY").compare(["q"], ["a"], ["b"])
    assert judge_server.requests[-1]["auth"] == "Bearer sk-test"
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(ValueError, match="MY_JUDGE_KEY"):
        make_judge(judge_server, api_key_env="MY_JUDGE_KEY")


def test_reward_model_judge_with_tie_margin():
    judge = RewardModelJudge(lambda prompts, responses: [len(r) for r in responses], tie_margin=1.0)
    judgments, summary = judge_pairwise(["p1", "p2", "p3"], ["long answer", "ab", "x"], ["short", "abc", "xyzw"], judge)
    assert [j["winner"] for j in judgments] == ["A", "tie", "B"]
    assert summary == {"wins": 1, "ties": 1, "losses": 1, "invalid": 0, "win_rate": 0.5}


@pytest.mark.parametrize("reply, expected", [("1", "first"), (" 2.", "second"), ("Tie", "tie"),
                                             ("Response 2 is better", "second"), ("neither", "invalid")])
def test_parse_preference(reply, expected):
    assert parse_preference(reply) == expected


def test_load_pairs_joins_on_prompt(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p1", "response": "a1"}, {"prompt": "p2", "response": "a2"}])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p2", "response": "b2"}, {"prompt": "p1", "response": "b1"}])
    assert load_pairs(tmp_path / "a.jsonl", tmp_path / "b.jsonl") == (["p1", "p2"], ["a1", "a2"], ["b1", "b2"])
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p1", "response": "c1"}])
    with pytest.raises(ValueError, match="same prompts"):
        load_pairs(tmp_path / "a.jsonl", tmp_path / "c.jsonl")


def test_template_needs_its_placeholders(judge_server):
    with pytest.raises(ValueError, match="second"):
        make_judge(judge_server, template="Compare {prompt}: {first}")


def test_unparseable_answers_are_counted_not_guessed(judge_server):
    judge_server.fixed_answer = "I cannot decide."
    judgments, summary = judge_pairwise(PROMPTS[:3], GOOD[:3], BAD[:3], make_judge(judge_server))
    assert [j["winner"] for j in judgments] == ["invalid"] * 3
    assert summary["invalid"] == 3 and summary["wins"] + summary["ties"] + summary["losses"] == 0
    assert summary["win_rate"] is None  # nothing was decided


class StuckHandler(BaseHTTPRequestHandler):
    """Reads the request, then hangs until the test ends ("hang"), closes the connection unanswered ("drop") or
    answers 200 with JSON that is not a chat completion ("junk")."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.requests.append(self.path)
        if self.server.behaviour == "hang":
            self.server.release.wait(60)
        elif self.server.behaviour == "junk":
            self.send_response(200)
            self.send_header("Content-Length", "17")
            self.end_headers()
            self.wfile.write(b'{"error": "busy"}')
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def stuck_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StuckHandler)
    server.daemon_threads = True
    server.requests, server.lock, server.release, server.behaviour = [], threading.Lock(), threading.Event(), "hang"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def judge_command(tmp_path, capsys, url, *options):
    """`marlhf judge` on 40 prompts against `url`: (exit code, its stderr, seconds it took)."""
    prompts = [f"question {i}" for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": p, "response": "GOOD"} for p in prompts])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": p, "response": "poor"} for p in prompts])
    started = time.monotonic()
    code = cli.main(["judge", "--a", str(tmp_path / "a.jsonl"), "--b", str(tmp_path / "b.jsonl"), "--out",
                     str(tmp_path / "j.jsonl"), "--judge-url", url, "--cache-dir", str(tmp_path / "cache"), *options])
    return code, capsys.readouterr().err, time.monotonic() - started


def test_an_endpoint_answering_500_ends_in_one_line_within_the_timeout(tmp_path, capsys, judge_server):
    judge_server.failures = [500] * 1000
    code, err, seconds = judge_command(tmp_path, capsys, judge_server.url, "--timeout", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.match(rf"marlhf: error: judge endpoint {judge_server.url}/chat/completions answered HTTP 500 Internal "
                    r"Server Error after \d+ tries in \d+\.\d s; .*raise --timeout \(now 2 s\)", err), err
    assert seconds < 10  # behaviour, not a benchmark: 2 s of retries, not the default's 5 retries per prompt
    assert not (tmp_path / "j.jsonl").exists()


def test_a_client_error_is_not_retried(tmp_path, capsys, judge_server):
    judge_server.failures = [401] * 1000
    code, err, _ = judge_command(tmp_path, capsys, judge_server.url, "--max-workers", "1")
    assert code == 2 and "answered HTTP 401 Unauthorized" in err and "--api-key-env" in err, err
    assert len(judge_server.requests) == 1  # neither retried nor followed by the 39 queued requests


def test_a_hanging_endpoint_gives_up_at_the_timeout_and_stops_the_queued_requests(tmp_path, capsys, stuck_server):
    code, err, seconds = judge_command(tmp_path, capsys, stuck_server.url, "--timeout", "2", "--max-workers", "4")
    assert code == 2 and "failed (timed out) after 1 try in 2." in err, err
    assert len(stuck_server.requests) <= 4 and seconds < 10  # one round of 4 workers, not 10 rounds of 2 s


def test_a_dropped_connection_is_retried_and_a_closed_port_is_not(tmp_path, capsys, stuck_server):
    stuck_server.behaviour = "drop"
    code, err, _ = judge_command(tmp_path, capsys, stuck_server.url, "--timeout", "2", "--max-workers", "1")
    assert code == 2 and "failed (Remote end closed connection without response) after 2 tries" in err, err
    assert len(stuck_server.requests) == 2  # tried at 0 s and 1 s; the next back-off (2 s) passes the limit
    stuck_server.server_close()  # nothing listens on the port any more
    code, err, _ = judge_command(tmp_path, capsys, stuck_server.url, "--timeout", "2")
    assert code == 2 and "cannot be reached" in err and "Connection refused" in err, err


def test_an_answer_without_choices_is_one_line_and_not_cached(tmp_path, capsys, stuck_server):
    stuck_server.behaviour = "junk"
    code, err, _ = judge_command(tmp_path, capsys, stuck_server.url, "--max-workers", "1")
    assert code == 2 and "answered without a string choices[0].message.content ({'error': 'busy'})" in err, err
    assert not list((tmp_path / "cache").rglob("*.json"))  # a rerun asks again


def test_the_failure_that_stopped_the_others_is_the_one_reported(monkeypatch):
    """Futures that ended before as_completed looks are yielded in no particular order (under load, the stopped
    ones first): the error is still the request that gave up, not another's 'stopped'."""
    import concurrent.futures

    from marlhf.errors import MarlhfError
    from marlhf.evaluation import judge as judge_module

    judge = judge_module.ChatJudge("http://127.0.0.1:9/v1", "m", max_workers=3)

    def complete(message):
        if message.endswith("#0"):
            time.sleep(0.2)  # the others are waiting to retry
            raise MarlhfError("the request that gave up")
        judge._stop.wait(10)
        raise MarlhfError("stopped, another request gave up")

    def last_first(futures):
        concurrent.futures.wait(futures)
        return sorted(futures, key=futures.get, reverse=True)

    monkeypatch.setattr(judge, "complete", complete)
    monkeypatch.setattr(judge_module, "as_completed", last_first)
    judge.template = "{prompt}{first}{second}"
    with pytest.raises(MarlhfError, match="^the request that gave up$"):
        judge.compare(["p"] * 3, ["a"] * 3, [f"#{i}" for i in range(3)])
