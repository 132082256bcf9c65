"""The paper's four tasks: where their data lives on the Hub, and how a raw row becomes a stage record.

Raw schemas (as stored on the Hugging Face Hub):

- ``openai/summarize_from_feedback``, config ``comparisons`` (TL;DR): ``info`` {``id``, ``post``, ``title``,
  ``subreddit``, ``site``, ``article``}, ``summaries`` (two {``text``, ``policy``, ``note``}), ``choice``
  (index of the preferred summary), ``worker``, ``batch``, ``split``, ``extra`` {``confidence``}.
  Splits ``train`` and ``validation``; validation also holds CNN/DM news rows whose ``info.post`` is null.
- ``Dahoas/full-hh-rlhf`` (HH-RLHF): ``prompt`` (``"\\n\\nHuman: ... \\n\\nAssistant:"``), ``response``,
  ``chosen``, ``rejected``. Splits ``train`` and ``test``.
- ``openai/webgpt_comparisons`` (WebGPT): ``question`` {``dataset``, ``id``, ``full_text``}, ``answer_0``,
  ``answer_1``, ``score_0``, ``score_1`` (preference strengths summing to 0), ``quotes_0``/``quotes_1``
  {``title``, ``extract``}, ``tokens_0``/``tokens_1``. Only a ``train`` split.
- ``codeparrot/apps`` (APPS): ``problem_id``, ``question``, ``solutions`` (JSON list of Python programs),
  ``input_output`` (JSON {``inputs``, ``outputs``, optional ``fn_name``}), ``difficulty``
  (introductory/interview/competition), ``url``, ``starter_code``. Splits ``train`` and ``test``; some rows
  have empty ``solutions`` or ``input_output``.

Rows that cannot make a record of the stage asked for raise `SkipRow`; the loader skips them, counts them
per reason and logs the counts. A stage checks only what it uses: RL and evaluation need the prompt (the
evaluation record keeps the preferred response as `reference` when there is one, else None), SFT the
preferred response, reward modelling both responses, different from each other; APPS SFT needs a solution
and APPS RL unit tests. WebGPT ties (equal scores) keep `answer_0` as the preferred one, as the authors'
code does (its `>=`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from marlhf.rewards.code import parse_tests

PREFERENCE_STAGE_FRACTIONS = {"sft": 0.2, "rm": 0.4, "rl": 0.4}
APPS_STAGE_FRACTIONS = {"sft": 0.2, "rl": 0.8}  # no "rm": APPS is rewarded by running unit tests


class SkipRow(Exception):
    """A raw row that cannot make a record of the requested stage; the message is the counted reason."""


@dataclass(frozen=True)
class Task:
    """One of the paper's datasets.

    ``hub_kwargs`` go to ``datasets.load_dataset``. TL;DR, WebGPT and APPS are stored on the Hub with
    loading scripts, which ``datasets`` >= 4 no longer runs, so they are read from the Hub's own Parquet
    export of the same data (``revision="refs/convert/parquet"``, one folder per config).
    ``eval_split=None`` means the dataset has no held-out split: ``heldout_fraction`` of its train split
    (seeded) becomes the evaluation set and the rest is divided among the stages.
    """

    name: str
    hub_id: str
    hub_kwargs: dict[str, str]
    train_split: str
    eval_split: str | None
    stage_fractions: dict[str, float]
    to_record: Callable[[dict[str, Any], str], dict[str, Any]]
    heldout_fraction: float | None = None
    description: str = field(default="", compare=False)
    expected_rows: dict[str, int] = field(default_factory=dict, compare=False)  # rows per Hub split, checked


def text_field(value: Any, name: str) -> str:
    """``value`` if it is a non-empty string, else SkipRow naming the field."""
    if value is None:
        raise SkipRow(f"missing {name}")
    if not isinstance(value, str):
        raise SkipRow(f"{name} is not a string")
    if not value.strip():
        raise SkipRow(f"empty {name}")
    return value


def preference_to_stage(prompt: str, chosen: Callable[[], str], rejected: Callable[[], str],
                        stage: str) -> dict[str, Any]:
    """The stage record of one preference pair. `chosen()` and `rejected()` give the responses, raising SkipRow
    when the row's one is unusable; only the stages that use a response call for it."""
    if stage == "rl":
        return {"prompt": prompt}
    if stage == "eval":
        try:
            return {"prompt": prompt, "reference": chosen()}
        except SkipRow:
            return {"prompt": prompt, "reference": None}
    if stage == "sft":
        return {"prompt": prompt, "response": chosen()}
    chosen, rejected = chosen(), rejected()
    if chosen.strip() == rejected.strip():
        raise SkipRow("chosen and rejected identical")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def tldr_prompt(info: dict[str, Any]) -> str:
    """The authors' TL;DR prompt: ``POST`` (Reddit rows) or ``ARTICLE`` (the CNN/DM rows of the validation
    split), a ``Subreddit: r/...`` line when there is a subreddit, the text, then ``TL;DR: ``; texts verbatim."""
    for kind, name in (("POST", "post"), ("ARTICLE", "article")):
        text = info.get(name)
        if text is not None:
            text = text_field(text, f"info.{name}")
            subreddit = info.get("subreddit")
            heading = f"Subreddit: r/{subreddit}\n" if isinstance(subreddit, str) else ""
            return f"{kind}\n{heading}{text}\nTL;DR: "
    raise SkipRow("info has neither post nor article")


def tldr_to_record(row: dict[str, Any], stage: str) -> dict[str, Any]:
    """TL;DR comparison -> record, as the authors' data code builds it (tldr_prompt; summaries verbatim)."""
    info = row.get("info")
    if not isinstance(info, dict):
        raise SkipRow("missing info")
    prompt = tldr_prompt(info)

    def summary(preferred: bool) -> str:
        summaries = row.get("summaries")
        if not isinstance(summaries, list) or len(summaries) != 2:
            raise SkipRow("summaries is not a list of two")
        choice = row.get("choice")
        if choice not in (0, 1):
            raise SkipRow("choice not 0 or 1")
        return text_field((summaries[choice if preferred else 1 - choice] or {}).get("text"), "summaries.text")

    return preference_to_stage(prompt, lambda: summary(True), lambda: summary(False), stage)


def hh_to_record(row: dict[str, Any], stage: str) -> dict[str, Any]:
    """HH-RLHF row -> record; the prompt is the dialogue up to the final ``"Assistant:"``, kept verbatim."""
    prompt = text_field(row.get("prompt"), "prompt")
    return preference_to_stage(prompt, lambda: text_field(row.get("chosen"), "chosen"),
                               lambda: text_field(row.get("rejected"), "rejected"), stage)


WEBGPT_PROMPT = " Human: {question} Assistant:"  # the authors' (DeepSpeed-Chat's) template
# Answers cite their browsing quotes ("[1]", "(source)"); the authors train without the quotes and remove
# every bracketed or parenthesised span, with the space before it.
CITATIONS = (re.compile(r" [\(\[].*?[\)\]]"), re.compile(r"[\(\[].*?[\)\]]"))


WEBGPT_TIES = ("answer_0", "skip")


def webgpt_to_record(row: dict[str, Any], stage: str, ties: str = "answer_0") -> dict[str, Any]:
    """WebGPT comparison -> record, as the authors' data code builds it; a tie keeps answer_0 as the preferred
    one (their ``>=``), or with ``ties="skip"`` is skipped where the pair is used (SFT, reward modelling)."""
    question = row.get("question")
    if not isinstance(question, dict):
        raise SkipRow("missing question")
    prompt = WEBGPT_PROMPT.format(question=text_field(question.get("full_text"), "question.full_text"))

    def answer(preferred: bool) -> str:
        scores = [row.get("score_0"), row.get("score_1")]
        if any(not isinstance(s, (int, float)) for s in scores):
            raise SkipRow("missing score")
        if ties == "skip" and scores[0] == scores[1]:
            raise SkipRow("tie (webgpt_ties='skip')")
        winner = 0 if scores[0] >= scores[1] else 1
        index = winner if preferred else 1 - winner
        text = text_field(row.get(f"answer_{index}"), f"answer_{index}")
        for citation in CITATIONS:
            text = citation.sub("", text)
        return " " + text_field(text, f"answer_{index} without its citations")

    return preference_to_stage(prompt, lambda: answer(True), lambda: answer(False), stage)


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


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="tldr",
            hub_id="openai/summarize_from_feedback",
            hub_kwargs={"revision": "refs/convert/parquet", "data_dir": "comparisons"},
            train_split="train",
            eval_split="validation",
            stage_fractions=PREFERENCE_STAGE_FRACTIONS,
            to_record=tldr_to_record,
            description="Reddit TL;DR summarisation comparisons",
            expected_rows={"train": 92858, "validation": 86086},
        ),
        Task(
            name="hh",
            hub_id="Dahoas/full-hh-rlhf",
            hub_kwargs={},
            train_split="train",
            eval_split="test",
            stage_fractions=PREFERENCE_STAGE_FRACTIONS,
            to_record=hh_to_record,
            description="Anthropic HH-RLHF dialogues",
            expected_rows={"train": 112052, "test": 12451},
        ),
        Task(
            name="webgpt",
            hub_id="openai/webgpt_comparisons",
            hub_kwargs={"revision": "refs/convert/parquet", "data_dir": "default"},
            train_split="train",
            eval_split=None,
            heldout_fraction=0.05,
            stage_fractions=PREFERENCE_STAGE_FRACTIONS,
            to_record=webgpt_to_record,
            description="WebGPT long-form question answering comparisons",
            expected_rows={"train": 19578},
        ),
        Task(
            name="apps",
            hub_id="codeparrot/apps",
            hub_kwargs={"revision": "refs/convert/parquet", "data_dir": "all"},
            train_split="train",
            eval_split="test",
            stage_fractions=APPS_STAGE_FRACTIONS,
            to_record=apps_to_record,
            description="APPS Python programming problems with unit tests",
            expected_rows={"train": 5000, "test": 5000},
        ),
    )
}
TASKS_BY_HUB_ID = {task.hub_id: task for task in TASKS.values()}
