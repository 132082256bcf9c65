"""`tldr`: Reddit TL;DR summarisation comparisons (the paper's summarisation task).

Raw schema (as stored on the Hugging Face Hub):
- ``openai/summarize_from_feedback``, config ``comparisons`` (TL;DR): ``info`` {``id``, ``post``, ``title``,
  ``subreddit``, ``site``, ``article``}, ``summaries`` (two {``text``, ``policy``, ``note``}), ``choice``
  (index of the preferred summary), ``worker``, ``batch``, ``split``, ``extra`` {``confidence``}.
  Splits ``train`` and ``validation``; validation also holds CNN/DM news rows whose ``info.post`` is null.
"""

from __future__ import annotations

from typing import Any

from marlhf.data.tasks.base import (PREFERENCE_STAGE_FRACTIONS, SkipRow, Task, preference_to_stage, register_task,
                                    text_field)


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


TASK = register_task(Task(
    name="tldr",
    hub_id="openai/summarize_from_feedback",
    hub_kwargs={"revision": "refs/convert/parquet", "data_dir": "comparisons"},
    train_split="train",
    eval_split="validation",
    stage_fractions=PREFERENCE_STAGE_FRACTIONS,
    to_record=tldr_to_record,
    description="Reddit TL;DR summarisation comparisons",
    expected_rows={"train": 92858, "validation": 86086},
))
