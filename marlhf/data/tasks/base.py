"""The dataset registry: a `Task` per dataset, by name and by Hub id, and the helpers the tasks share.

`register_task(Task(...))` in a task's own file adds it; `get_task` finds one by name or dotted path. Rows that
cannot make a record of the stage asked for raise `SkipRow`; the loader (marlhf.data.loading) skips them, counts
them per reason and logs the counts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

from marlhf.errors import did_you_mean
from marlhf.imports import import_object

__all__ = ["Task", "SkipRow", "TASKS", "TASKS_BY_HUB_ID", "register_task", "get_task", "check_record_options",
           "text_field", "preference_to_stage", "PREFERENCE_STAGE_FRACTIONS"]

PREFERENCE_STAGE_FRACTIONS = {"sft": 0.2, "rm": 0.4, "rl": 0.4}


class SkipRow(Exception):
    """A raw row that cannot make a record of the requested stage; the message is the counted reason."""


@dataclasses.dataclass(frozen=True)
class Task:
    """A dataset: where its raw rows live on the Hub, how its splits feed the stages, and how a raw row becomes a
    stage record (``to_record(row, stage, **record_options) -> record``, raising SkipRow for a row that cannot make
    one).

    ``hub_id`` is "" for a dataset read from local files only. ``hub_kwargs`` go to ``datasets.load_dataset``.
    TL;DR, WebGPT and APPS are stored on the Hub with loading scripts, which ``datasets`` >= 4 no longer runs, so
    they are read from the Hub's own Parquet export of the same data (``revision="refs/convert/parquet"``, one
    folder per config). ``eval_split=None`` means the dataset has no held-out split: ``heldout_fraction`` of its
    train split (seeded) becomes the evaluation set and the rest is divided among the stages. ``expected_rows``:
    the rows of each Hub split, checked. ``record_options``: the `load_records` options that ``to_record`` takes as
    keywords, each with its allowed values (WebGPT's ``webgpt_ties``).
    """

    name: str
    hub_id: str
    hub_kwargs: dict[str, str]
    train_split: str
    eval_split: str | None
    stage_fractions: dict[str, float]
    to_record: Callable[..., dict[str, Any]]
    heldout_fraction: float | None = None
    description: str = dataclasses.field(default="", compare=False)
    expected_rows: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    record_options: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, compare=False)

    def with_options(self, **options: Any) -> Task:
        """The task with the values of the `record_options` among `options` bound to its ``to_record``."""
        taken = {name: value for name, value in options.items() if name in self.record_options}
        return dataclasses.replace(self, to_record=functools.partial(self.to_record, **taken)) if taken else self


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


TASKS: dict[str, Task] = {}
TASKS_BY_HUB_ID: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add `task` to the registry under its name and its Hub id (an error if another task has either); returns
    it, so a task's file can say ``TASK = register_task(Task(...))``."""
    keys = ((TASKS, task.name), (TASKS_BY_HUB_ID, task.hub_id)) if task.hub_id else ((TASKS, task.name),)
    for table, key in keys:
        if key in table and table[key] != task:
            raise ValueError(f"a dataset task {key!r} is already registered")
    for table, key in keys:
        table[key] = task
    return task


def get_task(spec: str) -> Task:
    """The task registered as `spec`, or the Task at the dotted path `package.module:TASK` (importing the module
    registers what it registers)."""
    if spec in TASKS:
        return TASKS[spec]
    if ":" not in spec:
        raise ValueError(f"dataset_task must be one of {sorted(TASKS)} or a dotted path 'package.module:TASK', got "
                         f"{spec!r}{did_you_mean(spec, TASKS)}")
    task = import_object(spec, "dataset_task")
    if not isinstance(task, Task):
        raise ValueError(f"dataset_task {spec!r} is not a marlhf.data.tasks.Task")
    return task


def check_record_options(options: Mapping[str, Any]) -> None:
    """Each of `options` that a registered task takes (its `record_options`) has one of the allowed values."""
    for task in TASKS.values():
        for name, allowed in task.record_options.items():
            if name in options and options[name] not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {options[name]!r}")
