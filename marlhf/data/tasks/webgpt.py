"""`webgpt`: WebGPT long-form question answering comparisons; ties (equal scores) keep `answer_0` as the
preferred one, as the authors' code does (its `>=`), unless `webgpt_ties="skip"`.

Raw schema (as stored on the Hugging Face Hub):
- ``openai/webgpt_comparisons`` (WebGPT): ``question`` {``dataset``, ``id``, ``full_text``}, ``answer_0``,
  ``answer_1``, ``score_0``, ``score_1`` (preference strengths summing to 0), ``quotes_0``/``quotes_1``
  {``title``, ``extract``}, ``tokens_0``/``tokens_1``. Only a ``train`` split.
"""

from __future__ import annotations

import re
from typing import Any

from marlhf.data.tasks.base import (PREFERENCE_STAGE_FRACTIONS, SkipRow, Task, preference_to_stage, register_task,
                                    text_field)

WEBGPT_PROMPT = " Human: {question} Assistant:"  # the authors' (DeepSpeed-Chat's) template
# Answers cite their browsing quotes ("[1]", "(source)"); the authors train without the quotes and remove
# every bracketed or parenthesised span, with the space before it.
CITATIONS = (re.compile(r" [\(\[].*?[\)\]]"), re.compile(r"[\(\[].*?[\)\]]"))


WEBGPT_TIES = ("answer_0", "skip")


def webgpt_to_record(row: dict[str, Any], stage: str, webgpt_ties: str = "answer_0") -> dict[str, Any]:
    """WebGPT comparison -> record, as the authors' data code builds it; a tie keeps answer_0 as the preferred
    one (their ``>=``), or with ``webgpt_ties="skip"`` is skipped where the pair is used (SFT, reward
    modelling)."""
    question = row.get("question")
    if not isinstance(question, dict):
        raise SkipRow("missing question")
    prompt = WEBGPT_PROMPT.format(question=text_field(question.get("full_text"), "question.full_text"))

    def answer(preferred: bool) -> str:
        scores = [row.get("score_0"), row.get("score_1")]
        if any(not isinstance(s, (int, float)) for s in scores):
            raise SkipRow("missing score")
        if webgpt_ties == "skip" and scores[0] == scores[1]:
            raise SkipRow("tie (webgpt_ties='skip')")
        winner = 0 if scores[0] >= scores[1] else 1
        index = winner if preferred else 1 - winner
        text = text_field(row.get(f"answer_{index}"), f"answer_{index}")
        for citation in CITATIONS:
            text = citation.sub("", text)
        return " " + text_field(text, f"answer_{index} without its citations")

    return preference_to_stage(prompt, lambda: answer(True), lambda: answer(False), stage)


TASK = register_task(Task(
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
    record_options={"webgpt_ties": WEBGPT_TIES},
))
