"""Records for SFT, reward modelling, RL and evaluation, from the paper's datasets or local files.

`load_records` is the entry point; `TASKS` is the dataset registry (marlhf.data.tasks: the paper's four, one file
each, and any registered since); `split_indices` is the seeded stage split; `STAGE_FIELDS` the fields each stage's
records carry.
"""

from marlhf.data.loading import load_records
from marlhf.data.records import STAGE_FIELDS
from marlhf.data.splits import split_indices
from marlhf.data.tasks import TASKS

__all__ = ["STAGE_FIELDS", "TASKS", "load_records", "split_indices"]
