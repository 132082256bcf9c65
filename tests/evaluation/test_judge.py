import re

import pytest

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
    judge = make_judge(judge_server, max_workers=1, timeout_s=0.3)
    assert judge.compare(["q"], ["GOOD one"], ["other"]) == ["first"]
    assert len(judge_server.requests) == 5
    assert judge_server.requests[0]["path"] == "/v1/chat/completions"


def test_gives_up_after_max_retries_and_does_not_retry_client_errors(judge_server):
    judge_server.failures = [500] * 3
    with pytest.raises(RuntimeError, match="failed 3 times"):
        make_judge(judge_server, max_workers=1, max_retries=2).compare(["q"], ["a"], ["b"])
    judge_server.requests.clear()
    judge_server.failures = [400]
    with pytest.raises(RuntimeError, match="HTTP 400"):
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
