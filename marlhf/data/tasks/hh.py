"""`hh`: Anthropic HH-RLHF dialogues (the paper's dialogue task).

Raw schema (as stored on the Hugging Face Hub):
- ``Dahoas/full-hh-rlhf`` (HH-RLHF): ``prompt`` (``"\\n\\nHuman: ... \\n\\nAssistant:"``), ``response``,
  ``chosen``, ``rejected``. Splits ``train`` and ``test``.
"""

from __future__ import annotations

from typing import Any

from marlhf.data.tasks.base import PREFERENCE_STAGE_FRACTIONS, Task, preference_to_stage, register_task, text_field


def hh_to_record(row: dict[str, Any], stage: str) -> dict[str, Any]:
    """HH-RLHF row -> record; the prompt is the dialogue up to the final ``"Assistant:"``, kept verbatim."""
    prompt = text_field(row.get("prompt"), "prompt")
    return preference_to_stage(prompt, lambda: text_field(row.get("chosen"), "chosen"),
                               lambda: text_field(row.get("rejected"), "rejected"), stage)


TASK = register_task(Task(
    name="hh",
    hub_id="Dahoas/full-hh-rlhf",
    hub_kwargs={},
    train_split="train",
    eval_split="test",
    stage_fractions=PREFERENCE_STAGE_FRACTIONS,
    to_record=hh_to_record,
    description="Anthropic HH-RLHF dialogues",
    expected_rows={"train": 112052, "test": 12451},
))
