from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import marlhf.trainers.dpo as dpo
from marlhf.data.encoding import collate_pairs, encode_pairs
from marlhf.logging_utils import read_metrics
from marlhf.modeling import AdaptersDisabled
from marlhf.trainers.dpo import DPOConfig, response_logprob_sums, train_dpo


def _lengths(config) -> tuple[int, int]:
    return config.max_prompt_length, config.max_length


def _config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "dpo"), learning_rate=3e-3, per_device_batch_size=5, max_steps=8,
                  warmup_ratio=0.0, save_steps=0, max_prompt_length=32, max_length=64, beta=0.5, seed=0)
    values.update(overrides)
    return DPOConfig(**values)


def test_response_logprob_sums_match_per_row_reference(tmp_path, tiny_tokenizer, make_tiny_causal_lm, tiny_records):
    model = make_tiny_causal_lm().eval()
    pairs = encode_pairs(tiny_tokenizer, tiny_records["rm"][:3], *_lengths(_config(tmp_path)))
    with torch.no_grad():
        sums = response_logprob_sums(model, collate_pairs(pairs, tiny_tokenizer.pad_token_id, torch.device("cpu")))
        expected = []
        for ids, prompt_length in [c for c, _ in pairs] + [r for _, r in pairs]:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
            expected.append(sum(logprobs[t - 1, ids[t]] for t in range(prompt_length, len(ids))))
    torch.testing.assert_close(sums, torch.stack(expected), atol=1e-4, rtol=1e-5)


def test_dpo_prefers_chosen_after_training(tmp_path, tiny_tokenizer, make_tiny_causal_lm, tiny_records):
    model = make_tiny_causal_lm()
    reference = make_tiny_causal_lm()  # same seed: identical starting weights, never updated
    batch = collate_pairs(encode_pairs(tiny_tokenizer, tiny_records["rm"], *_lengths(_config(tmp_path))),
                          tiny_tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        ref_chosen, ref_rejected = response_logprob_sums(reference, batch).chunk(2)
    trained = train_dpo(_config(tmp_path), tiny_records["rm"], model=model, tokenizer=tiny_tokenizer)
    with torch.no_grad():
        chosen, rejected = response_logprob_sums(trained, batch).chunk(2)
    implicit_margin = ((chosen - ref_chosen) - (rejected - ref_rejected)).mean().item()
    assert implicit_margin > 1.0
    metrics = read_metrics(tmp_path / "dpo")
    assert metrics[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at the first step
    assert metrics[-1]["loss"] < 0.5
    assert {"accuracy", "chosen_reward", "rejected_reward", "margin", "grad_norm"} <= set(metrics[-1])
    assert (tmp_path / "dpo" / "model.safetensors").exists()


def _live_causal_lms() -> set[int]:
    return {id(o) for o in gc.get_objects() if issubclass(type(o), LlamaForCausalLM)}


def test_dpo_lora_reference_is_the_policy_with_adapters_off(tmp_path, tiny_tokenizer, make_tiny_causal_lm,
                                                            tiny_records, monkeypatch):
    calls, new_llamas = [], set()

    def spy(model, batch):
        if not calls:  # the first reference forward: every model is in place (gc is slow: look once)
            gc.collect()
            new_llamas.update(_live_causal_lms() - llamas_before)
        calls.append(model)
        return response_logprob_sums(model, batch)

    monkeypatch.setattr(dpo, "response_logprob_sums", spy)
    model = make_tiny_causal_lm()
    start_weights = {k: v.clone() for k, v in model.state_dict().items()}
    llamas_before = _live_causal_lms()
    config = _config(tmp_path, use_lora=True, lora_r=4, lora_alpha=8.0, learning_rate=3e-2)
    trained = train_dpo(config, tiny_records["rm"], model=model, tokenizer=tiny_tokenizer)

    ref, policy = calls[:2]  # per micro-batch: the reference, then the policy
    assert isinstance(ref, AdaptersDisabled) and ref.peft_model is policy
    assert not new_llamas  # no causal LM was created: the reference is no copy of the policy
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)

    metrics = read_metrics(tmp_path / "dpo")
    assert metrics[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # adapters start as a no-op: policy == reference
    assert metrics[-1]["loss"] < 0.5
    assert isinstance(trained, LlamaForCausalLM)
    saved = load_file(str(tmp_path / "dpo" / "model.safetensors"))
    assert saved.keys() == start_weights.keys()
    changed = [k for k in saved if not torch.equal(saved[k], start_weights[k])]
    assert sorted(changed) == sorted(k for k in saved if k.endswith(("q_proj.weight", "k_proj.weight",
                                                                       "v_proj.weight", "o_proj.weight")))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "dpo")
    batch = collate_pairs(encode_pairs(tiny_tokenizer, tiny_records["rm"], *_lengths(config)), tiny_tokenizer.pad_token_id,
                          torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(response_logprob_sums(reloaded, batch), response_logprob_sums(trained, batch))


def test_dpo_config_validation():
    with pytest.raises(ValueError, match="beta"):
        DPOConfig(beta=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(label_smoothing=0.5)
