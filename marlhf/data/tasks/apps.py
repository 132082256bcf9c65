"""`apps`: APPS Python programming problems, rewarded by running their unit tests (SFT takes the first
reference solution; RL and evaluation records carry the tests).

Raw schema (as stored on the Hugging Face Hub):
- ``codeparrot/apps`` (APPS): ``problem_id``, ``question``, ``solutions`` (JSON list of Python programs),
  ``input_output`` (JSON {``inputs``, ``outputs``, optional ``fn_name``}), ``difficulty``
  (introductory/interview/competition), ``url``, ``starter_code``. Splits ``train`` and ``test``; some rows
  have empty ``solutions`` or ``input_output``.
"""

from __future__ import annotations

import json
from typing import Any

from marlhf.data.tasks.base import SkipRow, Task, register_task, text_field
from marlhf.rewards.code import parse_tests

APPS_STAGE_FRACTIONS = {"sft": 0.2, "rl": 0.8}  # no "rm": APPS is rewarded by running unit tests


def apps_prompt(question: str, starter_code: str, call_based: bool) -> str:
    """The APPS paper's generation prompt: question, starter code, the I/O convention, then ``ANSWER:``."""
    lines = ["QUESTION:", question.strip()]
    if starter_code.strip():
        lines.append(starter_code.rstrip())
    lines.append("Use Call-Based format" if call_based else "Use Standard Input format")
    lines.append("ANSWER:\n")
    return "\n".join(lines)


def apps_to_record(row: dict[str, Any], stage: str) -> dict[str, Any]:
    """APPS problem -> record. SFT takes the first reference solution; RL/eval records carry the unit tests
    (``input_output`` as the dataset's JSON string), ``difficulty``, ``starter_code`` and ``problem_id``."""
    question = text_field(row.get("question"), "question")
    starter_code = row.get("starter_code") or ""
    input_output_text = row.get("input_output") or ""
    try:
        tests = json.loads(input_output_text) if input_output_text.strip() else {}
    except json.JSONDecodeError as error:
        raise SkipRow("input_output not valid JSON") from error
    prompt = apps_prompt(question, starter_code, call_based=bool(tests.get("fn_name")))
    if stage == "sft":
        solutions_text = row.get("solutions") or ""
        try:
            solutions = json.loads(solutions_text) if solutions_text.strip() else []
        except json.JSONDecodeError as error:
            raise SkipRow("solutions not valid JSON") from error
        solutions = [s for s in solutions if isinstance(s, str) and s.strip()]
        if not solutions:
            raise SkipRow("no solutions")
        return {"prompt": prompt, "response": solutions[0]}
    if not tests.get("inputs") or not tests.get("outputs"):
        raise SkipRow("no unit tests")
    try:
        parse_tests(tests)
    except ValueError as error:
        raise SkipRow(f"unit tests unusable ({error})") from None
    return {
        "prompt": prompt,
        "input_output": input_output_text,
        "difficulty": text_field(row.get("difficulty"), "difficulty"),
        "starter_code": starter_code,
        "problem_id": row.get("problem_id"),
    }


TASK = register_task(Task(
    name="apps",
    hub_id="codeparrot/apps",
    hub_kwargs={"revision": "refs/convert/parquet", "data_dir": "all"},
    train_split="train",
    eval_split="test",
    stage_fractions=APPS_STAGE_FRACTIONS,
    to_record=apps_to_record,
    description="APPS Python programming problems with unit tests",
    expected_rows={"train": 5000, "test": 5000},
))
