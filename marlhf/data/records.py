"""Record schemas of the training stages and reading of local record files.

A record is a plain dict. Each stage needs these string fields (extra fields, such as the unit
tests of an APPS problem, ride along unchanged):

- ``"sft"``: ``prompt``, ``response``
- ``"rm"``: ``prompt``, ``chosen``, ``rejected``
- ``"rl"`` and ``"eval"``: ``prompt``
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "response"),
    "rm": ("prompt", "chosen", "rejected"),
    "rl": ("prompt",),
    "eval": ("prompt",),
}
LOCAL_SUFFIXES = (".jsonl", ".parquet")


def check_stage(stage: str) -> None:
    if stage not in STAGE_FIELDS:
        raise ValueError(f"stage must be one of {sorted(STAGE_FIELDS)}, got {stage!r}")


def is_local_path(dataset: str) -> bool:
    return Path(dataset).suffix in LOCAL_SUFFIXES


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl`` (one JSON object per line) or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet  # a dependency of `datasets`

        return pyarrow.parquet.read_table(path).to_pylist()
    raise ValueError(f"dataset file must end in one of {LOCAL_SUFFIXES}, got {str(path)!r}")


def read_jsonl(path: str | Path, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped, a UTF-8 byte-order mark allowed), each
    with `fields`; a line that is not one is a ValueError naming the file and line."""
    rows = []
    for line_number, row in numbered_jsonl(path):
        missing = [name for name in fields if name not in row]
        if missing:
            raise ValueError(f"{path}:{line_number}: each line needs the fields {list(fields)}, this one lacks "
                             f"{missing}")
        rows.append(row)
    return rows


def numbered_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for each non-blank line of a JSONL file (a UTF-8 byte-order mark allowed); a line
    that is not valid UTF-8, not JSON or not an object is a ValueError naming the file and line."""
    with Path(path).open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid UTF-8 ({error})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from error
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_number}: each line must be a JSON object")
            yield line_number, row


def check_stage_records(records: list[dict[str, Any]], stage: str, source: str) -> None:
    """Raise a ValueError naming the first record whose stage fields are missing, not strings, or empty."""
    for index, record in enumerate(records):
        for field in STAGE_FIELDS[stage]:
            value = record.get(field)
            if not isinstance(value, str) or not value.strip():
                problem = "missing" if field not in record else f"not a non-empty string ({value!r:.40})"
                raise ValueError(
                    f"{source}: record {index} has field {field!r} {problem}; "
                    f"stage {stage!r} records need non-empty string fields {list(STAGE_FIELDS[stage])}"
                )


def prompt_records(prompts: list[str] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompts given as strings become {"prompt": ...} records; records stay as they are."""
    return [{"prompt": p} if isinstance(p, str) else p for p in prompts]


def require_fields(records: list[dict[str, Any]], fields: tuple[str, ...], stage: str) -> None:
    """Records handed to a trainer: at least one, each with string `fields` (which may be empty, unlike a
    dataset's rows: an empty response is a valid SFT target)."""
    if not records:
        raise ValueError(f"no {stage} records")
    for index, record in enumerate(records):
        missing = [name for name in fields if not isinstance(record.get(name), str)]
        if missing:
            raise ValueError(f"{stage} record {index} lacks string field(s) {missing}; "
                             f"{stage} records need {list(fields)}")


def subsample(records: list[dict[str, Any]], max_samples: int | None, seed: int) -> list[dict[str, Any]]:
    """A seeded random subset of ``max_samples`` records, kept in their original order."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be a positive integer or None, got {max_samples}")
    if max_samples is None or max_samples >= len(records):
        return records
    kept = sorted(random.Random(seed).sample(range(len(records)), max_samples))
    return [records[i] for i in kept]
