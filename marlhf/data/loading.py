"""`load_records`: the one entry point from a dataset name to a list of stage records.

``datasets.load_dataset`` (in `load_hub_split`) is the only place that touches the network, after a lookup of the
dataset on the Hub bounded by MARLHF_HUB_TIMEOUT (`marlhf.hub.hub_lookup`).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from tqdm import tqdm

from marlhf.data.records import check_stage, check_stage_records, is_local_path, read_rows, subsample
from marlhf.data.splits import split_indices
from marlhf.data.tasks import TASKS_BY_HUB_ID, SkipRow, Task, check_record_options, get_task
from marlhf.errors import MarlhfError
from marlhf.hub import HUB_TIMEOUT_VARIABLE, hub_lookup, hub_timeout

logger = logging.getLogger(__name__)


def resolve_task(dataset: str, task: str | None) -> Task | None:
    """The task whose raw schema ``dataset`` is in: from ``task`` (a registered name or a dotted path, marlhf.data.
    tasks), or from a Hub id; None for a processed local file."""
    chosen = get_task(task) if task is not None else None
    if is_local_path(dataset):
        return chosen
    if dataset not in TASKS_BY_HUB_ID:
        raise ValueError(
            f"dataset must be a local .jsonl/.parquet path or one of {sorted(TASKS_BY_HUB_ID)}, got {dataset!r}"
        )
    hub_task = TASKS_BY_HUB_ID[dataset]
    if chosen is not None and chosen.name != hub_task.name:
        raise ValueError(f"task={task!r} does not match dataset {dataset!r} (task {hub_task.name!r})")
    return hub_task


def load_hub_split(task: Task, split: str) -> Any:
    """One split of a task's Hub dataset, as a ``datasets.Dataset`` (downloads on first use, then cached),
    with the row count the paper's data has: a partial Parquet export (a bot maintains it) or a wrong
    ``data_dir`` (APPS without ``all`` doubles its rows) stops here instead of training on other data.
    ``load_dataset`` has no total time limit, so the Hub is asked first (`offline_unless_the_hub_answers`); when it
    does not answer, the split comes from the local cache, or the error names the dataset, the Hub and its last
    answer."""
    import datasets

    unanswered = offline_unless_the_hub_answers(task)
    try:
        rows = datasets.load_dataset(task.hub_id, split=split, **task.hub_kwargs)
    except (ConnectionError, FileNotFoundError, ValueError) as error:
        if not datasets.config.HF_HUB_OFFLINE:
            raise
        try:
            rows = load_hub_cache_split(task, split, error)
        except ConnectionError as not_cached:
            if unanswered is None:
                raise
            from huggingface_hub import constants

            datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = False  # as it was: only a cache hit stays
            raise MarlhfError(
                f"{task.hub_id} ({_described(task)}) split {split!r} is not in the local Hugging Face cache, and the "
                f"Hub ({constants.ENDPOINT}) is unreachable: it {unanswered}; load it once where there is a network "
                f"with the same HF_HOME, pass a local .jsonl/.parquet file of its rows with --dataset_task "
                f"{task.name}, or raise {HUB_TIMEOUT_VARIABLE} (now {hub_timeout():g} s)") from not_cached
    expected = task.expected_rows.get(split)
    if expected is not None and len(rows) != expected:
        raise ValueError(f"{task.hub_id} ({_described(task)}) split {split!r} has {len(rows)} rows, the paper's data "
                         f"has {expected}: a partial or changed Parquet export, or another data_dir")
    return rows


def offline_unless_the_hub_answers(task: Task) -> str | None:
    """Online, the task's dataset looked up on the Hub within MARLHF_HUB_TIMEOUT seconds (`hub_lookup`, an id the
    Hub does not have being a MarlhfError): None when it answered or this process is offline already; else what the
    Hub did last, and this process now works offline (as HF_HUB_OFFLINE=1 would) so that ``load_dataset`` reads the
    local cache instead of waiting for the Hub once per request. Offline, both libraries' switches are set."""
    import datasets
    from huggingface_hub import constants

    if Path(task.hub_id).is_dir():  # a local copy of the repo, which load_dataset reads as it is
        return None
    if datasets.config.HF_HUB_OFFLINE or constants.HF_HUB_OFFLINE:  # set, or the model check found the Hub down
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True  # both libraries read the same cache
        return None
    unanswered = hub_lookup(task.hub_id, hub_timeout(), missing_is_error=True, repo_type="dataset",
                            revision=task.hub_kwargs.get("revision"))
    if unanswered is not None:
        logger.warning("the Hub (%s) %s: reading %s from the local cache, this process works offline "
                       "(HF_HUB_OFFLINE=1 does so from the start)", constants.ENDPOINT, unanswered, task.hub_id)
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True  # what datasets and huggingface_hub read
    return unanswered


def _described(task: Task) -> str:
    """The task's load_dataset arguments, "revision='refs/convert/parquet', data_dir='comparisons'"."""
    return ", ".join(f"{key}={value!r}" for key, value in task.hub_kwargs.items()) or "default revision"


def load_hub_cache_split(task: Task, split: str, error: Exception) -> Any:
    """Offline (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``), one split read from the data files an earlier
    online load left in the hub cache (``HF_HUB_CACHE``). ``datasets`` reloads a Hub id offline only from the
    Arrow cache (``HF_DATASETS_CACHE``) of an earlier load, looked up under a config id made of the
    ``load_dataset`` keyword arguments; with ``data_dir`` (TL;DR, WebGPT, APPS) that id differs from the one the
    online load wrote (it hashed the resolved data files too), so that cache is never found (datasets 5.2:
    ``packaged_modules/cache/cache.py``, ``_find_hash_in_cache``). ``error``: what ``load_dataset`` raised."""
    import datasets
    from huggingface_hub import snapshot_download

    kwargs = dict(task.hub_kwargs)
    revision = kwargs.pop("revision", None)
    try:
        folder = snapshot_download(task.hub_id, repo_type="dataset", revision=revision, local_files_only=True)
        return datasets.load_dataset(folder, split=split, **kwargs)
    except Exception as cache_error:  # noqa: BLE001 - any failure here means: not in the local cache
        raise ConnectionError(
            f"{task.hub_id} ({_described(task)}) split {split!r} is not in the local Hugging Face cache and offline "
            f"mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): load it once online with the same HF_HOME (or "
            f"HF_HUB_CACHE and HF_DATASETS_CACHE), or pass a local .jsonl/.parquet file of its rows with "
            f"--dataset_task {task.name}. datasets: {error}; hub cache: {cache_error}"
        ) from error


def convert_rows(task: Task, rows: Iterable[dict[str, Any]], stage: str) -> tuple[list[dict[str, Any]], Counter]:
    """Records of ``stage`` from raw rows of ``task``, and the count of skipped rows per reason.

    For ``eval`` a prompt already seen is skipped too (TL;DR has several comparisons per post), so each
    evaluation prompt is scored once (an APPS problem: once per ``problem_id``). ``rl`` keeps one prompt per
    comparison, as the released code does; an APPS prompt seen before with other unit tests is skipped, since
    the code reward finds a prompt's tests by its text.
    """
    records, skipped, seen_prompts, tests_of_prompt = [], Counter(), set(), {}
    for row in tqdm(rows, desc=f"{task.name} {stage} records", disable=None, leave=False):
        try:
            record = task.to_record(row, stage)
        except SkipRow as reason:
            skipped[str(reason)] += 1
            continue
        if stage == "eval":
            key = record.get("problem_id", record["prompt"])
            if key in seen_prompts:
                skipped["duplicate problem" if "problem_id" in record else "duplicate prompt"] += 1
                continue
            seen_prompts.add(key)
        if "input_output" in record and tests_of_prompt.setdefault(record["prompt"], record["input_output"]) != \
                record["input_output"]:
            skipped["prompt repeated with other unit tests"] += 1
            continue
        records.append(record)
    return records, skipped


def stage_rows(task: Task, stage: str, rows: Any, seed: int) -> Any:
    """The rows of one source split that belong to ``stage`` (``rows`` supports ``len`` and ``select`` or indexing).

    ``rows`` is the train split for sft/rm/rl and the evaluation split for eval; for a task without an
    evaluation split (WebGPT) it is the train split in both cases, cut into held-out and training parts first.
    """
    if stage != "eval" and stage not in task.stage_fractions:
        raise ValueError(f"stage {stage!r} is not defined for task {task.name!r}; stages: {sorted(task.stage_fractions)} and 'eval'")
    stage_index = list(task.stage_fractions).index(stage) if stage != "eval" else None
    if task.eval_split is None:
        train_part, heldout_part = split_indices(len(rows), (1 - task.heldout_fraction, task.heldout_fraction), seed)
        if stage == "eval":
            return select(rows, sorted(heldout_part))
        # The stages split the training part in its shuffled order (DeepSpeed-Chat's Subset of a Subset).
        part = split_indices(len(train_part), tuple(task.stage_fractions.values()), seed)[stage_index]
        return select(rows, sorted(train_part[i] for i in part))
    if stage == "eval":
        return rows
    return select(rows, sorted(split_indices(len(rows), tuple(task.stage_fractions.values()), seed)[stage_index]))


def select(rows: Any, indices: list[int]) -> Any:
    return rows.select(indices) if hasattr(rows, "select") else [rows[i] for i in indices]


def load_records(
    dataset: str,
    stage: str,
    *,
    task: str | None = None,
    seed: int = 1234,
    max_samples: int | None = None,
    webgpt_ties: str = "answer_0",
) -> list[dict[str, Any]]:
    """Records of ``stage`` ("sft", "rm", "rl" or "eval") from ``dataset``.

    ``dataset`` is one of:

    - a Hub id of the paper (``openai/summarize_from_feedback``, ``Dahoas/full-hh-rlhf``,
      ``openai/webgpt_comparisons``, ``codeparrot/apps``): sft/rm/rl take their disjoint share of the train
      split (20/40/40; APPS 20/80; seeded by ``seed``, see `marlhf.data.splits`), eval takes the held-out
      split (WebGPT: a seeded 5% of its only split, the other 95% being divided among the stages);
    - a local ``.jsonl``/``.parquet`` file with ``task=None``: rows already in the stage's schema (see
      `marlhf.data.records`), taken as they are; a missing or empty field raises ValueError;
    - a local file with ``task`` a registered task ("tldr", "hh", "webgpt", "apps", or yours) or the dotted path
      of one (marlhf.data.tasks): rows in that task's raw Hub schema, standing in for the Hub split the stage reads
      (the train split for sft/rm/rl, the evaluation split for eval — for WebGPT the train split in both cases)
      and processed exactly like it.

    Raw rows that cannot make a record are skipped and counted per reason in a logged warning.
    ``max_samples`` keeps a random subset drawn with ``seed`` (e.g. the paper's 2,000 evaluation prompts).
    ``webgpt_ties``: WebGPT comparisons scored as a tie keep ``answer_0`` as preferred ("answer_0", the
    authors' ``>=``) or are skipped by the stages that use the pair ("skip": SFT and reward modelling).
    """
    check_stage(stage)
    record_options = {"webgpt_ties": webgpt_ties}  # each goes to the tasks that declare it (Task.record_options)
    check_record_options(record_options)
    resolved = resolve_task(dataset, task)
    if resolved is None:
        records = read_rows(dataset)
        if not records:
            raise ValueError(f"dataset file {dataset!r} holds no records (it is empty or blank)")
        check_stage_records(records, stage, source=dataset)
        check_preference_pairs(records, stage, source=dataset)
        return subsample(records, max_samples, seed)
    resolved = resolved.with_options(**record_options)
    if is_local_path(dataset):
        source, rows = dataset, read_rows(dataset)
    else:
        split = resolved.train_split if stage != "eval" or resolved.eval_split is None else resolved.eval_split
        source, rows = f"{dataset}[{split}]", load_hub_split(resolved, split)
    num_rows = len(rows)
    records, skipped = convert_rows(resolved, stage_rows(resolved, stage, rows, seed), stage)
    if skipped:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in skipped.most_common())
        logger.warning("%s (%s, stage %s): skipped %d rows (%s)", source, resolved.name, stage, sum(skipped.values()), reasons)
    if not records:
        raise ValueError(f"{source}: no usable {stage!r} records among its {num_rows} rows (skipped: {dict(skipped)})")
    check_preference_pairs(records, stage, source=source)
    return subsample(records, max_samples, seed)


def check_preference_pairs(records: list[dict[str, Any]], stage: str, source: str) -> None:
    """A preference pair whose chosen and rejected responses are the same carries no preference (its Bradley-Terry
    and DPO losses are log 2 whatever the model, with no gradient): all of them is a ValueError, some a warning
    with their count. Other stages pass."""
    if stage != "rm":
        return
    same = [index for index, record in enumerate(records) if record["chosen"] == record["rejected"]]
    if len(same) == len(records):
        raise ValueError(f"{source}: in every one of its {len(records)} preference pairs chosen equals rejected; a pair "
                         "needs two different responses")
    if same:
        logger.warning("%s: %d of %d preference pairs (the first: record %d) have chosen equal to rejected; they "
                       "carry no preference and only dilute the batch", source, len(same), len(records), same[0])
