from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from marlhf.checkpoint import list_checkpoints
from marlhf.data.encoding import encode_prompt_response
from marlhf.logging_utils import read_metrics
from marlhf.trainers.sft import IGNORE_INDEX, SFTConfig, collate_sft, train_sft
from tests.trainers.killed_run import run_until_killed

REPO_ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "sft"), learning_rate=1e-2, per_device_batch_size=4, max_steps=8,
                  warmup_ratio=0.25, save_steps=0, max_prompt_length=32, max_length=64, seed=3)
    values.update(overrides)
    return SFTConfig(**values)


def _fixed_batch_loss(model, tokenizer, records):
    examples = [encode_prompt_response(tokenizer, r["prompt"], r["response"], 32, 64) for r in records]
    with torch.no_grad():
        return model(**collate_sft(examples, tokenizer.pad_token_id, torch.device("cpu"))).loss.item()


def test_labels_cover_response_only(tiny_tokenizer):
    ids, prompt_length = encode_prompt_response(tiny_tokenizer, "a prompt that is long", " reply", 3, 64)
    assert prompt_length == 3 and ids[-1] == tiny_tokenizer.eos_token_id
    batch = collate_sft([(ids, prompt_length), ([5, 6, 7], 1)], tiny_tokenizer.pad_token_id, torch.device("cpu"))
    labels = batch["labels"]
    assert (labels[0, :3] == IGNORE_INDEX).all() and (labels[0, 3:] == batch["input_ids"][0, 3:]).all()
    assert labels[1].tolist()[:3] == [IGNORE_INDEX, 6, 7] and (labels[1, 3:] == IGNORE_INDEX).all()


def test_sft_loss_goes_down(tmp_path, make_tiny_causal_lm, tiny_tokenizer, tiny_records):
    model = make_tiny_causal_lm()
    before = _fixed_batch_loss(model, tiny_tokenizer, tiny_records["sft"])
    trained = train_sft(_config(tmp_path), tiny_records["sft"], model=model, tokenizer=tiny_tokenizer)
    after = _fixed_batch_loss(trained, tiny_tokenizer, tiny_records["sft"])
    assert after < before - 0.5
    metrics = read_metrics(tmp_path / "sft")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert {"loss", "grad_norm", "learning_rate", "epoch"} <= set(metrics[0])
    assert metrics[-1]["epoch"] == 4.0
    assert (tmp_path / "sft" / "model.safetensors").exists() and (tmp_path / "sft" / "config.yaml").exists()


ATTENTION_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def test_sft_lora_trains_adapters_and_saves_the_merged_model(tmp_path, make_tiny_causal_lm, tiny_tokenizer,
                                                            tiny_records):
    model = make_tiny_causal_lm()
    start_weights = {k: v.clone() for k, v in model.state_dict().items()}
    before = _fixed_batch_loss(model, tiny_tokenizer, tiny_records["sft"])
    config = _config(tmp_path, use_lora=True, lora_r=4, lora_alpha=8.0, learning_rate=3e-2, save_steps=4)
    trained = train_sft(config, tiny_records["sft"], model=model, tokenizer=tiny_tokenizer)

    # add_lora put the adapters into `model` itself; merge_lora kept them there
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert isinstance(trained, LlamaForCausalLM)  # merged: no peft wrapper, no LoRA layers
    # 5.79 -> 5.53: adapters on the attention only, with random frozen embeddings and LM head, learn less
    assert _fixed_batch_loss(trained, tiny_tokenizer, tiny_records["sft"]) < before - 0.15
    assert (tmp_path / "sft" / "checkpoint-4" / "model" / "adapter_model.safetensors").exists()

    saved = load_file(str(tmp_path / "sft" / "model.safetensors"))
    assert saved.keys() == start_weights.keys()
    changed = [k for k in saved if not torch.equal(saved[k], start_weights[k])]
    assert sorted(changed) == sorted(k for k in saved if k.endswith(ATTENTION_WEIGHTS))  # 2 layers x q, k, v, o
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "sft")
    assert _fixed_batch_loss(reloaded, tiny_tokenizer, tiny_records["sft"]) == pytest.approx(
        _fixed_batch_loss(trained, tiny_tokenizer, tiny_records["sft"]), abs=1e-5)


def test_sft_rejects_bad_records(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    with pytest.raises(ValueError, match="response"):
        train_sft(_config(tmp_path), [{"prompt": "hi"}], model=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        train_sft(_config(tmp_path), [{"prompt": "hi", "response": "yo"}], model=make_tiny_causal_lm(),
                  tokenizer=tiny_tokenizer)


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, tiny_model_dir, tiny_records):
    common = dict(model_name_or_path=str(tiny_model_dir), save_steps=2, save_total_limit=2,
                  gradient_accumulation_steps=2, per_device_batch_size=2)
    train_sft(_config(tmp_path, output_dir=str(tmp_path / "straight"), **common), tiny_records["sft"])

    crashed = _config(tmp_path, output_dir=str(tmp_path / "crashed"), **common)
    run_until_killed("marlhf.trainers.sft", "SFTConfig", "train_sft", crashed, tiny_records["sft"], kill_after=5,
                     work_dir=tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path / "crashed")] == ["checkpoint-2", "checkpoint-4"]
    assert read_metrics(tmp_path / "crashed")[-1]["step"] == 5

    resumed = dataclasses.replace(crashed, resume="latest")
    train_sft(resumed, tiny_records["sft"])
    straight, after_resume = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "crashed")
    assert [m["step"] for m in after_resume] == list(range(1, 9))
    assert after_resume == straight  # bit-exact: same batches, weights, optimizer and scheduler states
    weights_straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    weights_resumed = load_file(str(tmp_path / "crashed" / "model.safetensors"))
    assert all(torch.equal(weights_straight[k], weights_resumed[k]) for k in weights_straight)


_TWO_PROCESS_RUN = """
import json, os, sys
from marlhf.logging_utils import read_metrics
from marlhf.trainers.sft import SFTConfig, train_sft

config_path, records_path = sys.argv[1], sys.argv[2]
records = json.load(open(records_path))
config = SFTConfig.from_yaml(config_path)
train_sft(config, records)
straight = read_metrics(config.output_dir)
train_sft(SFTConfig.from_yaml(config_path, resume=config.output_dir + "/checkpoint-2"), records)
if int(os.environ["RANK"]) == 0:
    print("RESULT", json.dumps({"straight": straight, "resumed": read_metrics(config.output_dir),
                                "files": sorted(os.listdir(config.output_dir + "/checkpoint-4"))}))
"""


def test_two_process_run_shards_batches_and_resumes_exactly(tmp_path, tiny_model_dir, tiny_records):
    config = _config(tmp_path, model_name_or_path=str(tiny_model_dir), max_steps=4, save_steps=2,
                     per_device_batch_size=2, gradient_accumulation_steps=1)
    config.save_yaml(tmp_path / "config.yaml")
    (tmp_path / "records.json").write_text(json.dumps(tiny_records["sft"]))
    (tmp_path / "run.py").write_text(_TWO_PROCESS_RUN)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            str(tmp_path / "run.py"), str(tmp_path / "config.yaml"),
                            str(tmp_path / "records.json")], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=240)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.split("RESULT ", 1)[1])
    assert result["resumed"] == result["straight"] and [m["step"] for m in result["straight"]] == [1, 2, 3, 4]
    assert result["straight"][-1]["epoch"] == 2.0  # 8 records, 2 per process and step: 2 steps per epoch
    assert {"rng_state.0.json", "rng_state.1.json", "optimizer.model.json"} <= set(result["files"])


def test_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path, make_tiny_causal_lm, tiny_tokenizer, tiny_records):
    (tmp_path / "sft" / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"already holds an earlier run \(checkpoints"):
        train_sft(_config(tmp_path), tiny_records["sft"], model=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)


def test_warmup_steps_override_the_ratio_for_every_schedule():
    from marlhf.trainers.common import make_scheduler

    def learning_rates(schedule, **overrides):
        config = SFTConfig(model_name_or_path="unused", learning_rate=1.0, lr_scheduler=schedule, **overrides)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make_scheduler(optimizer, config, total_steps=10)
        rates = []
        for _ in range(5):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return rates

    assert learning_rates("linear", warmup_ratio=0.0, warmup_steps=4) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert learning_rates("linear", warmup_ratio=0.2) == pytest.approx([0.0, 0.5, 1.0, 0.875, 0.75])
    assert learning_rates("constant", warmup_steps=2) == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="warmup_steps"):
        SFTConfig(warmup_steps=-1)


def test_long_prompts_keep_their_leading_bos():
    """Left truncation keeps the special tokens a tokenizer puts in front (Gemma's <bos>), then the last tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from marlhf.data.encoding import encode_prompt_response, prompt_token_ids

    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate("abcdefgh")}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")
    prompt = "a b c d e f"
    assert tokenizer(prompt)["input_ids"] == [0, 3, 4, 5, 6, 7, 8]
    assert prompt_token_ids(tokenizer, prompt, 4) == [0, 6, 7, 8]  # <bos> + the last 3 tokens
    assert prompt_token_ids(tokenizer, prompt, 7) == [0, 3, 4, 5, 6, 7, 8]  # short enough: unchanged
    assert prompt_token_ids(tokenizer, prompt, 1) == [8]  # no room for the prefix: the last token only
    ids, prompt_length = encode_prompt_response(tokenizer, prompt, "g h", max_prompt_length=3, max_length=8)
    assert ids == [0, 7, 8, 9, 10, 1] and prompt_length == 3
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    plain.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert prompt_token_ids(plain, prompt, 2) == [7, 8]  # no special prefix: plain left truncation
