"""`plot`, `judge` and `human-eval --summary` get broken JSONL files (empty, not UTF-8, not JSON, a line that is
not an object, fields missing or of the wrong type, BOM), paths that are missing or directories, and bad
numbers; each must end in one line naming the file or the option."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from tests.fuzz import SEED
from tests.fuzz.harness import Example, check, fuzz_settings


def jsonl(rows) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def broken_jsonl(good: bytes, field: str) -> st.SearchStrategy[bytes]:
    return st.sampled_from([b"", good + b"{oops\n", good + b"[1, 2]\n", good + b'"text"\n',
                            good + '{"x": "caf\xe9"}\n'.encode("latin-1"), good + jsonl([{"other": 1}]),
                            good + jsonl([{field: None}]), b"\xff\xfe" + good])


METRICS = jsonl([{"step": s, "objective/rm_score": 0.1 * s} for s in range(1, 4)])
RESPONSES = jsonl([{"prompt": f"p{i}", "response": f"r{i}"} for i in range(3)])
CHOICES = jsonl([{"index": i, "prompt": f"p{i}", "choice": "A"} for i in range(3)])


@st.composite
def tool_examples(draw, tool: str, reward_model: str) -> Example:
    broken = draw(st.sampled_from(["content", "missing", "directory", "number"]))
    if tool == "plot":
        example = Example(["plot", "run", "--out", "plots"], files={"run/metrics.jsonl": METRICS}, output=("plots",))
        target, good, field = "run/metrics.jsonl", METRICS, "objective/rm_score"
        numbers = (["--smooth", draw(st.sampled_from(["0", "-3", "x", "1.5"]))], "smooth")
    elif tool == "judge":
        example = Example(["judge", "--a", "a.jsonl", "--b", "b.jsonl", "--out", "out/j.jsonl", "--reward-model",
                           reward_model], files={"a.jsonl": RESPONSES, "b.jsonl": RESPONSES}, output=("out",))
        target, good, field = draw(st.sampled_from(["a.jsonl", "b.jsonl"])), RESPONSES, "prompt"
        numbers = ([draw(st.sampled_from(["--tie-margin", "--batch-size", "--seed"])),
                    draw(st.sampled_from(["nan", "-1", "x", "1e999"]))], None)
    else:
        example = Example(["human-eval", "--summary", "c.jsonl"], files={"c.jsonl": CHOICES}, output=())
        target, good, field = "c.jsonl", CHOICES, "choice"
        numbers = (["--summary", "c.jsonl", "c.jsonl", "c.jsonl"], "summary")
    if broken == "content":
        example.files[target] = draw(broken_jsonl(good, field))
        example.culprits.add(target.split("/")[-1])
    elif broken == "missing":
        del example.files[target]
        example.culprits.add(target.split("/")[0] if tool == "plot" else target)
    elif broken == "directory":
        del example.files[target]
        example.dirs.append(target)
        example.culprits.add(target.split("/")[-1])
    else:
        flags, name = numbers
        example.argv += flags
        # a value that argparse or the tool refuses; the rest (e.g. --seed -1) may be valid
        example.must_fail = name is not None or flags[1] in ("x", "nan", "1e999") and flags[0] != "--seed"
        example.culprits.add(name or flags[0].lstrip("-"))
    return example


FULL_EXAMPLES = {"plot": 15, "judge": 15, "human-eval": 10}


@pytest.mark.parametrize("tool", sorted(FULL_EXAMPLES))
def test_tools(tool, fuzz_models, fuzz_depth):
    @fuzz_settings(FULL_EXAMPLES[tool], fuzz_depth)
    @seed(SEED)
    @given(example=tool_examples(tool, str(fuzz_models["reward"])))
    def fuzz(example: Example) -> None:
        check(example, [fuzz_models["reward"]])

    fuzz()
