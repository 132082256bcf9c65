"""Each command gets a small valid input (tiny models, a few records, one step) with one or two things broken:
its config file (syntax, encoding, path), an option (type, range, misspelt or unknown key), its data file
(empty, not UTF-8, not JSON, fields missing, duplicates, BOM, CRLF), its model
path, or its output directory (a file, or holding an earlier run). `harness.check` asserts the outcome."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import given, seed
from hypothesis import strategies as st

from tests.fuzz import SEED
from tests.fuzz.harness import Example, check, config_classes, fuzz_settings
from tests.fuzz.strategies import ENCODINGS, broken_yaml, field_invalid_values, misspellings

CONFIGS = config_classes()
PROMPTS = [f"Human: count to {i}\n\nAssistant:" for i in range(6)]
RECORDS = {
    "sft": [{"prompt": p, "response": f" {i} {i + 1}"} for i, p in enumerate(PROMPTS)],
    "rm": [{"prompt": p, "chosen": " a fine answer", "rejected": " no."} for p in PROMPTS],
    "rl": [{"prompt": p} for p in PROMPTS],
}
STAGE = {"sft": "sft", "reward": "rm", "dpo": "rm", "ppo": "rl", "evaluate": "rl"}
SMALL = {"max_steps": 1, "per_device_batch_size": 2, "max_prompt_length": 16, "max_length": 32, "save_steps": 0}


def base_values(command: str, models: dict[str, Path]) -> dict[str, typing.Any]:
    """A valid tiny config of `command` (a run of one step on the tiny models)."""
    if command == "demo":
        return {"out": "out", "ppo_steps": 1}
    policy, reward = str(models["policy"]), str(models["reward"])
    if command == "evaluate":
        return {"model_name_or_path": policy, "reward_model": reward, "dataset": "data.jsonl", "num_samples": 2,
                "batch_size": 2, "max_prompt_length": 16, "max_response_length": 2, "output_dir": "out"}
    values = {"model_name_or_path": policy, "dataset": "data.jsonl", "output_dir": "out", **SMALL}
    if command == "reward":
        values.update(eval_fraction=0.0)
    if command == "ppo":
        values.update(reward_model_name_or_path=reward, mini_batch_size=2, max_prompt_length=24,
                      max_response_length=4)
    return values


def jsonl(rows) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


# Ways the data file can be broken: (bytes, refused?). A refused one must name the file.
def data_cases(stage: str) -> dict[str, tuple[bytes, bool]]:
    good = jsonl(RECORDS[stage])
    field = "prompt"
    return {
        "empty": (b"", True),
        "blank lines": (b"\n\n  \n", True),
        "latin-1": (good + '{"prompt": "caf\xe9"}\n'.encode("latin-1"), True),
        "not json": (good + b"{prompt: 1,\n", True),
        "json array line": (good + b"[1, 2]\n", True),
        "field missing": (jsonl([{"other": "x"}]), True),
        "field not a string": (jsonl([{**RECORDS[stage][0], field: 3}]), True),
        "whole file one array": (json.dumps(RECORDS[stage]).encode(), True),
        "duplicates": (good + good, False),
        "crlf": (good.replace(b"\n", b"\r\n"), False),
        "bom": (b"\xef\xbb\xbf" + good, False),
    }


@st.composite
def trainer_examples(draw, command: str, models: dict[str, Path]) -> Example:
    values = base_values(command, models)
    output = "out" if command == "demo" else "output_dir"
    example = Example([command], must_fail=False)
    flags: list[str] = []
    config_bytes: bytes | None = None
    config_path = "config.yaml"
    data = jsonl(RECORDS[STAGE[command]]) if command in STAGE else None
    encoding = None
    # The demo's output is checked by the pipeline, which the test stubs out.
    kinds = ["option", "unknown key", "config file", "config path", "encoding"]
    kinds += ["output", "data", "data path", "model"] if command in STAGE else []
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=2, unique=True)):
        if kind == "option":
            name = draw(st.sampled_from(CONFIGS[command].field_names()))
            bad = draw(field_invalid_values(CONFIGS[command], name))
            if bad.words is not None and draw(st.booleans()):
                flags += [f"--{name}", *bad.words]
            else:
                values[name] = bad.value
            example.culprits.add(name)
            example.must_fail = True
        elif kind == "unknown key":
            word = draw(st.sampled_from(CONFIGS[command].field_names()).flatmap(misspellings)
                        .filter(lambda w: w not in CONFIGS[command].field_names() and w.isidentifier()))
            if draw(st.booleans()):
                flags += [f"--{word}", "1"]
            else:
                values[word] = 1
            example.culprits.add(word)
            example.must_fail = True
        elif kind == "config file":
            _, config_bytes = draw(broken_yaml(values))
            example.culprits.add(config_path)
            example.must_fail = True
        elif kind == "config path":
            config_path = draw(st.sampled_from(["missing.yaml", "folder.yaml", "dangling.yaml", "plain/config.yaml"]))
            example.dirs.append("folder.yaml")
            example.symlinks["dangling.yaml"] = "nowhere.yaml"
            example.files["plain"] = b"a file, not a folder\n"
            example.culprits.add(config_path)
            example.must_fail = True
        elif kind == "output":
            case = draw(st.sampled_from(["a file", "earlier run", "under a file"]))
            if case == "a file":
                example.files["out"] = b"not a directory\n"
            elif case == "earlier run" and command != "evaluate":  # evaluate writes over an earlier evaluation
                # as a run leaves it: its lock file is empty once released
                example.files.update({"out/config.yaml": yaml.safe_dump(values).encode(),
                                      "out/metrics.jsonl": b'{"step": 1, "loss": 1.0}\n',
                                      "out/checkpoint-1/model.safetensors": b"weights", "out/.marlhf.lock": b""})
                example.protected = ("out",)
            else:
                example.files["plain"] = b"a file, not a folder\n"
                values[output] = "plain/out"
            example.culprits.update({"out", output, "overwrite_output_dir"})
            example.must_fail = True
        elif kind == "encoding":
            encoding = draw(st.sampled_from(range(len(ENCODINGS))))
        elif kind == "data":
            _, (data, refused) = draw(st.sampled_from(sorted(data_cases(STAGE[command]).items())))
            example.culprits.add("data.jsonl")
            example.must_fail |= refused
        elif kind == "data path":
            values["dataset"] = draw(st.sampled_from(["missing.jsonl", "folder.jsonl", "data.txt", "data.parquet"]))
            example.dirs.append("folder.jsonl")
            example.files.update({"data.txt": data or b"", "data.parquet": data or b""})
            example.culprits.update({values["dataset"], "dataset"})
            example.must_fail = True
        elif kind == "model":
            model = draw(st.sampled_from(["./no_model", "empty_model", "data.jsonl", "broken_model"]))
            example.dirs.append("empty_model")
            example.files["broken_model/config.json"] = b'{"model_type": "llama", '
            values["model_name_or_path"] = model
            example.culprits.update({model.lstrip("./"), "model_name_or_path"})
            example.must_fail = True
    if data is not None:
        example.files["data.jsonl"] = data
    if config_path == "config.yaml":
        if config_bytes is None and encoding is not None:
            config_bytes = ENCODINGS[encoding](values)
        example.files["config.yaml"] = config_bytes or yaml.safe_dump(values).encode()
    else:  # the values go on the command line; the config path is what is broken
        flags = [word for name, value in values.items() for word in _flag(CONFIGS[command], name, value)] + flags
    example.argv += ["--config", config_path, *flags]
    example.output = (values.get(output, "out") if isinstance(values.get(output), str) else "out",)
    return example


def _flag(config: type, name: str, value: typing.Any) -> list[str]:
    hint = typing.get_type_hints(config).get(name)
    if hint is bool:
        return [f"--{name}" if value else f"--no-{name}"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", json.dumps(value) if isinstance(value, dict) else str(value)]


FULL_EXAMPLES = {"sft": 25, "reward": 20, "dpo": 20, "ppo": 30, "evaluate": 20, "demo": 25}


@pytest.mark.parametrize("command", sorted(FULL_EXAMPLES))
def test_config_commands(command, fuzz_models, monkeypatch, fuzz_depth):
    # A demo that the fuzzer left valid would train for minutes: it stops where the pipeline would start.
    monkeypatch.setattr("marlhf.demo.pipeline.run_demo", lambda config: None)
    shared = [fuzz_models["policy"], fuzz_models["reward"]]

    @fuzz_settings(FULL_EXAMPLES[command], fuzz_depth)
    @seed(SEED)
    @given(example=trainer_examples(command, fuzz_models))
    def fuzz(example: Example) -> None:
        check(example, shared)

    fuzz()
