"""`load_records` on local files (processed and raw Hub schemas) and on Hub ids with `load_dataset` faked."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from marlhf.data import TASKS, load_records
from marlhf.data.loading import convert_rows
from marlhf.data.records import read_rows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RAW = {"tldr": "tldr_comparisons.jsonl", "hh": "hh_rlhf.jsonl", "webgpt": "webgpt_comparisons.jsonl", "apps": "apps.jsonl"}


def raw_path(task: str) -> str:
    return str(FIXTURES / RAW[task])


# --- processed-schema files -----------------------------------------------------------------------------

def test_processed_files_are_taken_as_they_are():
    assert load_records(str(FIXTURES / "processed_sft.jsonl"), "sft")[1] == {"prompt": "Q: capital of France?\nA:", "response": " Paris"}
    assert len(load_records(str(FIXTURES / "processed_rm.jsonl"), "rm")) == 2
    rl = load_records(str(FIXTURES / "processed_rl.jsonl"), "rl")
    assert rl[1] == {"prompt": "Q: capital of Italy?\nA:", "difficulty": "introductory"}  # extra fields ride along
    assert load_records(str(FIXTURES / "processed_rm.jsonl"), "eval")[0]["prompt"] == "Q: 2+2?\nA:"


def test_processed_parquet_file(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = read_rows(FIXTURES / "processed_rm.jsonl")
    path = tmp_path / "rm.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    assert load_records(str(path), "rm") == rows


@pytest.mark.parametrize(
    ("stage", "message"),
    [("sft", "record 1 has field 'response' not a non-empty string"), ("rm", "record 0 has field 'chosen' missing")],
)
def test_malformed_processed_rows_raise_naming_record_and_field(stage, message):
    with pytest.raises(ValueError, match=message):
        load_records(str(FIXTURES / "processed_malformed.jsonl"), stage)


def test_bad_arguments_raise(tmp_path):
    sft = str(FIXTURES / "processed_sft.jsonl")
    with pytest.raises(ValueError, match="stage must be one of"):
        load_records(sft, "ppo")
    with pytest.raises(ValueError, match="dataset must be a local"):
        load_records("someone/other_dataset", "sft")
    with pytest.raises(ValueError, match="does not exist"):
        load_records(str(tmp_path / "missing.jsonl"), "sft")
    with pytest.raises(ValueError, match="task must be one of"):
        load_records(sft, "sft", task="summarize")
    with pytest.raises(ValueError, match="does not match"):
        load_records("Dahoas/full-hh-rlhf", "sft", task="tldr")
    with pytest.raises(ValueError, match="max_samples"):
        load_records(sft, "sft", max_samples=0)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"prompt": "a", "response": "b"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: each line must be a JSON object"):
        load_records(str(bad_line), "sft")


def test_max_samples_is_a_seeded_subset_in_file_order():
    path = raw_path("hh")
    all_prompts = [r["prompt"] for r in load_records(path, "eval", task="hh")]
    picked = load_records(path, "eval", task="hh", max_samples=4)
    assert picked == load_records(path, "eval", task="hh", max_samples=4)
    assert len(picked) == 4
    positions = [all_prompts.index(r["prompt"]) for r in picked]
    assert positions == sorted(positions)
    assert load_records(path, "eval", task="hh", max_samples=4, seed=7) != picked


# --- raw Hub schemas: conversion, prompt templates, counted skips -----------------------------------------

def test_tldr_record_uses_the_paper_prompt_and_the_chosen_summary():
    row = read_rows(raw_path("tldr"))[1]  # choice 1
    record = TASKS["tldr"].to_record(row, "rm")
    assert record["prompt"] == (
        "POST\nSubreddit: r/AskReddit\nWhat is a small habit that noticeably improved your mornings? "
        "I keep hitting snooze and feel rushed every day.\nTL;DR: "
    )
    assert record["chosen"] == row["summaries"][1]["text"]  # verbatim, as the authors' data code
    assert record["rejected"] == row["summaries"][0]["text"]
    assert TASKS["tldr"].to_record(row, "sft") == {"prompt": record["prompt"], "response": record["chosen"]}
    assert TASKS["tldr"].to_record(row, "eval") == {"prompt": record["prompt"], "reference": record["chosen"]}


def test_webgpt_record_picks_the_higher_score_and_drops_citation_markers():
    rows = read_rows(raw_path("webgpt"))
    record = TASKS["webgpt"].to_record(rows[0], "rm")  # score_0 = -1.0, so answer_1 wins
    assert record["prompt"] == " Human: Why do cats purr? Assistant:"  # the authors' template
    assert record["chosen"] == " Cats purr by rapidly twitching the muscles of the larynx. They purr when content but also when stressed."
    assert record["rejected"] == " I am not sure."
    assert "[" not in TASKS["webgpt"].to_record(rows[7], "sft")["response"]  # "[1-3]"


def test_tldr_and_webgpt_follow_the_authors_templates():
    """CNN/DM rows (article, no post) are kept as ARTICLE prompts, rows without a subreddit lose only that
    line, and WebGPT answers lose every bracketed or parenthesised span, as the authors' data code does."""
    article = {"info": {"post": None, "article": "A long news story.", "subreddit": None},
               "summaries": [{"text": " one"}, {"text": " two"}], "choice": 0}
    assert TASKS["tldr"].to_record(article, "rl")["prompt"] == "ARTICLE\nA long news story.\nTL;DR: "
    no_subreddit = {**article, "info": {"post": "My post.", "subreddit": None}}
    assert TASKS["tldr"].to_record(no_subreddit, "sft") == {"prompt": "POST\nMy post.\nTL;DR: ", "response": " one"}
    webgpt = {"question": {"full_text": "Why?"}, "score_0": 0.0, "score_1": 0.0,
              "answer_0": "Because [1] of (see below) the [2, 3] sun.", "answer_1": "No."}
    record = TASKS["webgpt"].to_record(webgpt, "rm")
    assert record == {"prompt": " Human: Why? Assistant:", "chosen": " Because of the sun.", "rejected": " No."}


def test_apps_records_carry_tests_for_rl_and_a_solution_for_sft():
    row = read_rows(raw_path("apps"))[3]  # call-based, with starter code
    rl = TASKS["apps"].to_record(row, "rl")
    assert rl["prompt"] == (
        "QUESTION:\nWrite a function is_even(n) that returns True when n is even.\ndef is_even(n):\n"
        "Use Call-Based format\nANSWER:\n"
    )
    assert json.loads(rl["input_output"])["fn_name"] == "is_even"
    assert (rl["difficulty"], rl["starter_code"], rl["problem_id"]) == ("introductory", row["starter_code"], 3)
    assert TASKS["apps"].to_record(row, "sft")["response"] == json.loads(row["solutions"])[0]
    assert "Use Standard Input format" in TASKS["apps"].to_record(read_rows(raw_path("apps"))[0], "rl")["prompt"]


@pytest.mark.parametrize(
    ("task", "stage", "expected_skips"),
    [
        ("tldr", "rm", {"empty summaries.text": 1}),  # the CNN/DM row is kept, as an ARTICLE prompt
        ("tldr", "rl", {}),  # RL needs only the prompt
        ("tldr", "sft", {}),  # the empty summary is the rejected one
        ("tldr", "eval", {"duplicate prompt": 1}),
        ("hh", "sft", {"empty chosen": 1}),  # SFT needs only the chosen response
        ("hh", "rm", {"empty chosen": 1, "missing rejected": 1, "chosen and rejected identical": 1}),
        ("hh", "rl", {}),
        ("webgpt", "rm", {"empty question.full_text": 1}),  # the tie is kept, answer_0 preferred (the authors')
        ("apps", "sft", {"no solutions": 1, "empty question": 1}),
        ("apps", "rl", {"no unit tests": 1, "empty question": 1}),
    ],
)
def test_malformed_raw_rows_are_skipped_and_counted(task, stage, expected_skips):
    rows = read_rows(raw_path(task))
    records, skipped = convert_rows(TASKS[task], rows, stage)
    assert skipped == Counter(expected_skips)
    assert len(records) == len(rows) - sum(expected_skips.values())


def test_skips_are_logged_with_counts(caplog):
    with caplog.at_level(logging.WARNING, logger="marlhf.data.loading"):
        load_records(raw_path("webgpt"), "eval", task="webgpt")
        load_records(raw_path("hh"), "rm", task="hh")
    assert "(hh, stage rm): skipped 1 rows (missing rejected: 1)" in caplog.text  # the rm part of the file


@pytest.mark.parametrize("task", ["tldr", "hh", "webgpt", "apps"])
def test_local_raw_file_stages_are_disjoint_and_well_formed(task):
    stages = [s for s in ("sft", "rm", "rl") if s in TASKS[task].stage_fractions]
    prompts = {}
    for stage in stages + ["eval"]:
        records = load_records(raw_path(task), stage, task=task)
        fields = {"sft": ("prompt", "response"), "rm": ("prompt", "chosen", "rejected")}.get(stage, ("prompt",))
        assert records and all(isinstance(r[f], str) and r[f].strip() for r in records for f in fields)
        prompts[stage] = {r["prompt"] for r in records}
    for a in stages:
        for b in stages:
            if a < b:
                assert not prompts[a] & prompts[b], (a, b)
    if task == "webgpt":
        assert not prompts["eval"] & (prompts["sft"] | prompts["rm"] | prompts["rl"])


def test_apps_has_no_reward_model_stage():
    with pytest.raises(ValueError, match="stage 'rm' is not defined for task 'apps'"):
        load_records(raw_path("apps"), "rm", task="apps")


def test_a_file_without_usable_rows_raises(tmp_path):
    path = tmp_path / "ties.jsonl"
    tie = read_rows(raw_path("webgpt"))[-2]
    assert tie["score_0"] == tie["score_1"]
    path.write_text(json.dumps(tie) + "\n")
    with pytest.raises(ValueError, match="no usable 'eval' records"):
        load_records(str(path), "eval", task="webgpt")


def test_preference_pairs_without_a_preference_are_refused_or_counted(tmp_path, caplog):
    """chosen == rejected gives log 2 and no gradient in the reward and DPO losses: all such pairs is an error,
    some a warning with their count (a file of them trained silently at loss 0.6931 before)."""
    pairs = [{"prompt": f"q{i}", "chosen": " a", "rejected": " a" if i < 3 else " b"} for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs[:3]))
    with pytest.raises(ValueError, match=r"pairs\.jsonl: in every one of its 3 preference pairs chosen equals rejected"):
        load_records(str(path), "rm")
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    with caplog.at_level(logging.WARNING, logger="marlhf.data.loading"):
        assert load_records(str(path), "rm") == pairs  # kept as they are
    assert "3 of 8 preference pairs (the first: record 0) have chosen equal to rejected" in caplog.text
    assert load_records(str(path), "rl") == pairs  # other stages: no check


# --- Hub ids: `datasets.load_dataset` replaced by the fixture, so no test touches the network ----------

@pytest.mark.parametrize(
    ("task", "stage", "split"),
    [("tldr", "rm", "train"), ("tldr", "eval", "validation"), ("hh", "sft", "train"), ("hh", "eval", "test"),
     ("webgpt", "rl", "train"), ("webgpt", "eval", "train"), ("apps", "rl", "train"), ("apps", "eval", "test")],
)
def test_hub_id_reads_the_right_split_and_matches_the_local_raw_file(monkeypatch, task, stage, split):
    import datasets
    import huggingface_hub.constants

    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)  # offline: the Hub is not looked up first
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list(read_rows(raw_path(task)))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub_id = TASKS[task].hub_id
    import dataclasses

    from marlhf.data import tasks as task_table

    fixture_sized = dataclasses.replace(TASKS[task], expected_rows={split: len(read_rows(raw_path(task)))})
    monkeypatch.setitem(task_table.TASKS_BY_HUB_ID, hub_id, fixture_sized)  # the fixture is not the full split
    records = load_records(hub_id, stage)
    assert calls == [(hub_id, {"split": split, **TASKS[task].hub_kwargs})]
    assert records == load_records(raw_path(task), stage, task=task)


def test_stages_check_only_what_they_use_and_webgpt_ties_prefer_answer_0():
    from marlhf.data.tasks import SkipRow, hh_to_record, webgpt_to_record

    row = {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " same", "rejected": " same"}
    assert hh_to_record(row, "rl") == {"prompt": row["prompt"]}
    assert hh_to_record(row, "sft")["response"] == " same"
    assert hh_to_record({**row, "chosen": ""}, "eval") == {"prompt": row["prompt"], "reference": None}
    with pytest.raises(SkipRow, match="identical"):
        hh_to_record(row, "rm")
    tie = {"question": {"full_text": "Why?"}, "answer_0": "Because [1].", "answer_1": "No.", "score_0": 0.0,
           "score_1": 0.0}
    assert webgpt_to_record(tie, "rm") == {"prompt": " Human: Why? Assistant:", "chosen": " Because.",
                                           "rejected": " No."}
    assert webgpt_to_record({**tie, "score_1": 1.0}, "rm")["chosen"] == " No."


def test_hub_exports_are_checked_by_their_row_counts(tmp_path):
    """The Hub's Parquet export layout ({data_dir}/{split}/0000.parquet), loaded through the real
    datasets.load_dataset path: the right count passes, another is an error naming dataset, revision and counts."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq

    from marlhf.data.loading import load_hub_split

    rows = read_rows(raw_path("tldr"))
    (tmp_path / "comparisons" / "train").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "comparisons" / "train" / "0000.parquet")
    task = dataclasses.replace(TASKS["tldr"], hub_id=str(tmp_path), expected_rows={"train": len(rows)})
    assert len(load_hub_split(task, "train")) == len(rows)
    partial = dataclasses.replace(task, expected_rows={"train": 92858})
    with pytest.raises(ValueError, match=rf"revision='refs/convert/parquet'.*has {len(rows)} rows.*has 92858"):
        load_hub_split(partial, "train")


def test_apps_rows_the_code_reward_cannot_run_are_skipped_at_load():
    """Mismatched tests, call-based tests without argument lists, and a prompt repeated with other tests are
    skipped and counted at load, never a crash mid-run; evaluation keeps one record per problem_id."""
    from marlhf.data.loading import convert_rows

    def row(problem_id, question, inputs, outputs, fn_name=None):
        tests = {"inputs": inputs, "outputs": outputs, **({"fn_name": fn_name} if fn_name else {})}
        return {"problem_id": problem_id, "question": question, "starter_code": "", "difficulty": "interview",
                "input_output": json.dumps(tests), "solutions": json.dumps(["print(1)"])}

    rows = [row(1, "Add.", ["1 2\n"], ["3\n"]), row(2, "Mismatch.", ["1\n", "2\n"], ["1\n"]),
            row(3, "Call.", ["5"], [True], fn_name="f"), row(4, "Add.", ["2 2\n"], ["4\n"]),
            row(1, "Add.", ["1 2\n"], ["3\n"])]
    records, skipped = convert_rows(TASKS["apps"], rows, "rl")
    assert [r["problem_id"] for r in records] == [1, 1]
    assert skipped == {"unit tests unusable (input_output needs as many outputs as inputs and at least one test, "
                       "got 2 and 1)": 1,
                       "unit tests unusable (input_output['inputs'] must be lists of arguments when fn_name is "
                       "given)": 1,
                       "prompt repeated with other unit tests": 1}
    records, skipped = convert_rows(TASKS["apps"], rows, "eval")
    assert [r["problem_id"] for r in records] == [1] and skipped["duplicate problem"] == 1


def test_webgpt_ties_policy_is_an_option(tmp_path):
    """Default: a tie keeps answer_0 preferred (the authors'); "skip": SFT and reward modelling drop ties,
    RL and evaluation keep their prompts."""
    rows = [{"question": {"full_text": f"Question {i}?"}, "answer_0": f"Yes {i}.", "answer_1": f"No {i}.",
             "score_0": 0.0 if i % 2 else 1.0, "score_1": 0.0 if i % 2 else -1.0} for i in range(60)]
    path = tmp_path / "webgpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for stage in ("sft", "rm", "rl", "eval"):
        kept = load_records(str(path), stage, task="webgpt")
        skipping = load_records(str(path), stage, task="webgpt", webgpt_ties="skip")
        if stage in ("sft", "rm"):
            assert 0 < len(skipping) < len(kept), stage
            assert all(int(r["prompt"].split()[2].rstrip("?")) % 2 == 0 for r in skipping)  # no tie left
        else:  # the same prompts (a tie's evaluation reference is then None: no answer is preferred)
            assert [r["prompt"] for r in skipping] == [r["prompt"] for r in kept], stage
    with pytest.raises(ValueError, match="webgpt_ties"):
        load_records(str(path), "rm", task="webgpt", webgpt_ties="chosen")


# --- Hub ids offline: served from the caches an earlier online load leaves, no network -------------------

@pytest.fixture
def offline_caches(tmp_path, monkeypatch):
    """Empty hub and datasets caches under a temporary HF_HOME, both libraries offline, the Hub unroutable.
    The libraries read these settings at import, so their module constants are patched (the CLI test in
    tests/test_cli.py sets the environment of a fresh process instead)."""
    import datasets
    import huggingface_hub.constants

    from tests.hub_cache import UNREACHABLE_HUB

    hub, datasets_cache = tmp_path / "hf_home" / "hub", tmp_path / "hf_home" / "datasets"
    for module, name, value in [(datasets.config, "HF_HUB_OFFLINE", True), (datasets.config, "HF_ENDPOINT", UNREACHABLE_HUB),
                                (datasets.config, "HF_DATASETS_CACHE", datasets_cache),
                                (huggingface_hub.constants, "HF_HUB_OFFLINE", True),
                                (huggingface_hub.constants, "ENDPOINT", UNREACHABLE_HUB),
                                (huggingface_hub.constants, "HF_HUB_CACHE", str(hub))]:
        monkeypatch.setattr(module, name, value)
    return hub, datasets_cache


def fixture_sized(monkeypatch, task: str, splits: tuple[str, ...]) -> None:
    import dataclasses

    from marlhf.data import tasks as task_table

    sized = dataclasses.replace(TASKS[task], expected_rows={split: len(read_rows(raw_path(task))) for split in splits})
    monkeypatch.setitem(task_table.TASKS_BY_HUB_ID, TASKS[task].hub_id, sized)  # the fixture is not the full split


def test_hub_id_without_data_dir_loads_offline_from_the_datasets_arrow_cache(tmp_path, monkeypatch, offline_caches):
    """Dahoas/full-hh-rlhf: `datasets` itself reloads the Arrow cache of the earlier load (HF_DATASETS_CACHE/
    Dahoas___full-hh-rlhf/default/0.0.0/<commit>), every stage's records as from the same rows in a local file."""
    from tests.hub_cache import put_in_datasets_cache

    _, datasets_cache = offline_caches
    rows = read_rows(raw_path("hh"))
    fixture_sized(monkeypatch, "hh", ("train", "test"))
    for stage in ("sft", "rm", "rl", "eval"):
        with pytest.raises(ConnectionError, match=r"Dahoas/full-hh-rlhf \(default revision\) split '(train|test)' "
                                                  r"is not in the local Hugging Face cache"):
            load_records("Dahoas/full-hh-rlhf", stage)  # nothing cached yet: an error, not a download
    put_in_datasets_cache(datasets_cache, "Dahoas/full-hh-rlhf", {"train": rows, "test": rows}, tmp_path)
    for stage in ("sft", "rm", "rl", "eval"):
        assert load_records("Dahoas/full-hh-rlhf", stage) == load_records(raw_path("hh"), stage, task="hh"), stage


def test_hub_id_with_data_dir_loads_offline_from_the_hub_cache_parquet_export(tmp_path, monkeypatch, offline_caches):
    """openai/summarize_from_feedback (revision refs/convert/parquet, data_dir comparisons): `datasets` cannot reload
    it offline (the online load's Arrow cache is looked up under another config id: default-data_dir=comparisons,
    not default-<hash>), so marlhf reads the Parquet export files the earlier load left in the hub cache
    (HF_HUB_CACHE/datasets--openai--summarize_from_feedback, refs/refs/convert/parquet -> snapshots/<commit>)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.hub_cache import put_in_datasets_cache, put_in_hub_cache

    hub, datasets_cache = offline_caches
    task = TASKS["tldr"]
    fixture_sized(monkeypatch, "tldr", ("train", "validation"))
    with pytest.raises(ConnectionError, match=r"openai/summarize_from_feedback \(revision='refs/convert/parquet', "
                                              r"data_dir='comparisons'\).*HF_HUB_OFFLINE / HF_DATASETS_OFFLINE.*"
                                              r"--dataset_task tldr"):
        load_records(task.hub_id, "rm")
    export = tmp_path / "export"
    for split in ("train", "validation"):
        (export / "comparisons" / split).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(read_rows(raw_path("tldr"))), export / "comparisons" / split / "0000.parquet")
    put_in_hub_cache(hub, task.hub_id, export, repo_type="dataset", revision=task.hub_kwargs["revision"])
    put_in_datasets_cache(datasets_cache, task.hub_id, {split: read_rows(raw_path("tldr")) for split in
                                                         ("train", "validation")}, tmp_path, data_dir="comparisons")
    with pytest.raises(ValueError, match="Couldn't find cache for openai/summarize_from_feedback for config "
                                         "'default-data_dir=comparisons'"):  # datasets alone, with both caches
        datasets.load_dataset(task.hub_id, split="train", **task.hub_kwargs)
    for stage in ("sft", "rm", "eval"):
        assert load_records(task.hub_id, stage) == load_records(raw_path("tldr"), stage, task="tldr"), stage


# --- Hub ids online: the Hub is asked within MARLHF_HUB_TIMEOUT, load_dataset has no total time limit ---------

@pytest.fixture
def online_hub(offline_caches, fake_hub, monkeypatch):
    """offline_caches' empty caches with both libraries online, at the Hub on 127.0.0.1 (tests/conftest.py)."""
    import datasets
    import huggingface_hub.constants

    hub, _ = offline_caches
    for module, name, value in [(datasets.config, "HF_HUB_OFFLINE", False),
                                (datasets.config, "HF_ENDPOINT", huggingface_hub.constants.ENDPOINT),
                                (huggingface_hub.constants, "HF_HUB_OFFLINE", False),
                                (huggingface_hub.constants, "HF_HUB_CACHE", str(hub))]:
        monkeypatch.setattr(module, name, value)
    return fake_hub


@pytest.mark.parametrize("status, expected", [(503, r"answered HTTP 503 Service Unavailable after \d+ tries in"),
                                              (None, r"failed \(timed out\) after 1 try in 2\.\d s")])
def test_a_hub_dataset_the_hub_does_not_serve_is_given_up_within_the_limit(online_hub, status, expected):
    import datasets

    from marlhf.errors import MarlhfError

    online_hub.status = status
    started = time.monotonic()
    with pytest.raises(MarlhfError, match=rf"^Dahoas/full-hh-rlhf \(default revision\) split 'train' is not in the "
                                          rf"local Hugging Face cache, and the Hub \(http://127.0.0.1:\d+\) is "
                                          rf"unreachable: it {expected}.*--dataset_task hh, or raise "
                                          rf"MARLHF_HUB_TIMEOUT \(now 2 s\)$"):
        load_records("Dahoas/full-hh-rlhf", "rl")
    assert time.monotonic() - started < 10  # behaviour, not a benchmark: load_dataset alone has no total limit
    assert set(online_hub.requests) == {"/datasets/Dahoas/full-hh-rlhf/resolve/main/README.md"}
    assert datasets.config.HF_HUB_OFFLINE is False  # a miss leaves the process online


def test_a_cached_hub_dataset_loads_offline_when_the_hub_hangs(online_hub, offline_caches, monkeypatch, tmp_path):
    import datasets

    from tests.hub_cache import put_in_datasets_cache

    rows = read_rows(raw_path("hh"))
    fixture_sized(monkeypatch, "hh", ("train", "test"))
    put_in_datasets_cache(offline_caches[1], "Dahoas/full-hh-rlhf", {"train": rows, "test": rows}, tmp_path)
    online_hub.status = None
    assert load_records("Dahoas/full-hh-rlhf", "rl") == load_records(raw_path("hh"), "rl", task="hh")
    assert datasets.config.HF_HUB_OFFLINE  # the next load reads the cache without asking the Hub again
    load_records("Dahoas/full-hh-rlhf", "eval")
    assert len(online_hub.requests) == 1


def test_a_hub_dataset_the_hub_does_not_have_is_one_line_at_once(online_hub):
    from marlhf.errors import MarlhfError

    online_hub.status = 404
    with pytest.raises(MarlhfError, match=r"dataset 'openai/summarize_from_feedback' is not a local .jsonl/.parquet "
                                          r"file, and the Hub \(http://127.0.0.1:\d+\) answered HTTP 404 Not Found "
                                          r"for it: check the id"):
        load_records("openai/summarize_from_feedback", "rl")
    # the dataset's URL at the revision its task loads, asked once (not there: asking again cannot help)
    assert online_hub.requests == ["/datasets/openai/summarize_from_feedback/resolve/refs%2Fconvert%2Fparquet/README.md"]


def test_a_dataset_from_the_plugin_guide_registers_and_loads(tmp_path):
    """The guide's dataset (docs/plugins.md), run as written: registered by name, read from a local file of raw
    rows through its `to_record`; unknown names and paths that are not a Task are one-line errors."""
    from marlhf.data.tasks import get_task, register_task

    guide = (Path(__file__).parents[2] / "docs" / "plugins.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", guide, re.S) if "register_task" in block)
    exec(code, {})
    try:
        path = tmp_path / "questions.jsonl"
        path.write_text('{"question": "why?"}\n{"question": ""}\n{"question": "how?"}\n')
        assert load_records(str(path), "rl", task="questions") == [{"prompt": "Q: why?\nA:"}, {"prompt": "Q: how?\nA:"}]
        with pytest.raises(ValueError, match="already registered"):
            register_task(dataclasses.replace(TASKS["questions"], stage_fractions={"rl": 0.5, "sft": 0.5}))
    finally:
        TASKS.pop("questions")
    with pytest.raises(ValueError, match=r"dataset_task must be one of .* got 'tldrr' \(did you mean 'tldr'\?\)"):
        get_task("tldrr")
    with pytest.raises(ValueError, match="dataset_task 'marlhf.data:load_records' is not a marlhf.data.tasks.Task"):
        get_task("marlhf.data:load_records")
