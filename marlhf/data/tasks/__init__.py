"""The dataset registry: the paper's four tasks, one file each (tldr, hh, webgpt, apps), and any dataset of yours.

A task says where its data lives on the Hub, how its splits feed the stages (sft / rm / rl, and eval), and how a
raw row becomes a stage record. A stage checks only what it uses: RL and evaluation need the prompt (the
evaluation record keeps the preferred response as `reference` when there is one, else None), SFT the preferred
response, reward modelling both responses, different from each other; APPS SFT needs a solution and APPS RL unit
tests. A new dataset is one file that registers its `Task` (`TASK = register_task(Task(...))`), chosen by its
name or Hub id once the file is imported, or by its dotted path (`--dataset_task my_pkg.data:TASK`, with a local
file of raw rows as `--dataset`); `marlhf.data.load_records` reads it like the paper's.
"""

from marlhf.data.tasks.base import (PREFERENCE_STAGE_FRACTIONS, TASKS, TASKS_BY_HUB_ID, SkipRow, Task,
                                    check_record_options, get_task, preference_to_stage, register_task, text_field)
from marlhf.data.tasks.tldr import tldr_prompt, tldr_to_record  # noqa: E402  (importing a task's file registers it)
from marlhf.data.tasks.hh import hh_to_record  # noqa: E402
from marlhf.data.tasks.webgpt import WEBGPT_TIES, webgpt_to_record  # noqa: E402
from marlhf.data.tasks.apps import apps_prompt, apps_to_record  # noqa: E402

__all__ = ["Task", "SkipRow", "TASKS", "TASKS_BY_HUB_ID", "register_task", "get_task", "check_record_options",
           "text_field", "preference_to_stage", "PREFERENCE_STAGE_FRACTIONS", "tldr_prompt", "tldr_to_record",
           "hh_to_record", "webgpt_to_record", "WEBGPT_TIES", "apps_prompt", "apps_to_record"]
