"""PPO at scale on one process: LoRA adapters (the reference is the policy with its adapters switched off, no
second copy), bf16 autocast and gradient checkpointing reach the rollout and the update."""

from __future__ import annotations

import gc

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import marlhf.trainers.ppo as ppo
from marlhf.logging_utils import read_metrics
from marlhf.modeling import AdaptersDisabled
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.test_ppo import RECORDS, count_e


def _live_causal_lms() -> set[int]:
    return {id(o) for o in gc.get_objects() if issubclass(type(o), LlamaForCausalLM)}


def _config(tmp_path, **overrides) -> PPOConfig:
    values = dict(output_dir=str(tmp_path / "ppo"), model_name_or_path="unused", per_device_batch_size=4,
                  mini_batch_size=4, max_prompt_length=32, max_response_length=6, max_length=64, max_steps=2,
                  learning_rate=1e-2, critic_learning_rate=1e-2, warmup_ratio=0.0, lr_scheduler="constant",
                  save_steps=0, seed=3, use_lora=True, lora_r=4, lora_alpha=8.0)
    values.update(overrides)
    return PPOConfig(**values)


def test_lora_reference_shares_the_policy_weights(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    seen = {}
    score_responses = ppo.score_responses

    def spy(*args, **kwargs):
        seen["policy"], seen["ref"], seen["critic"] = kwargs["policy"], kwargs["ref"], kwargs["critic"]
        gc.collect()
        seen["new_llamas"] = _live_causal_lms() - llamas_before
        return score_responses(*args, **kwargs)

    monkeypatch.setattr(ppo, "score_responses", spy)
    start = make_tiny_causal_lm()
    llamas_before = _live_causal_lms()
    start_weights = {k: v.clone() for k, v in start.state_dict().items()}
    # two mini-batches: the rollout scores with the models themselves (one update per step would reuse its forwards)
    returned = train_ppo(_config(tmp_path, mini_batch_size=2), RECORDS, policy=start, tokenizer=tiny_tokenizer,
                         reward_fn=count_e)

    ref, policy = seen["ref"], seen["policy"]
    assert isinstance(ref, AdaptersDisabled) and ref.peft_model is policy
    assert not seen["new_llamas"]  # no causal LM was created: the reference is no copy of the policy
    base = policy.get_base_model()
    assert {id(p) for p in base.parameters()} <= {id(p) for p in policy.parameters()}
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    # the critic (fresh head on the policy's transformer) trains adapters and its head only
    critic_trainable = [n for n, p in seen["critic"].named_parameters() if p.requires_grad]
    assert all("lora_" in n or n.startswith("head.") for n in critic_trainable)

    # The run trained the adapters; the saved and returned policy is the merged, plain model.
    metrics = read_metrics(tmp_path / "ppo")
    assert metrics[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[-1]["objective/kl"] != 0.0
    assert isinstance(returned, LlamaForCausalLM)
    saved = load_file(str(tmp_path / "ppo" / "model.safetensors"))
    assert saved.keys() == start_weights.keys()
    changed = [k for k in saved if not torch.equal(saved[k], start_weights[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for k in changed)


def test_lora_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="lora_r"):
        _config(tmp_path, lora_r=0)
    assert _config(tmp_path, resume="latest").resume == "latest"  # LoRA runs resume like full ones


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one process-wide state: other tests set it up with mixed_precision="no"."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_and_gradient_checkpointing_reach_rollout_and_update(tmp_path, make_tiny_causal_lm, tiny_tokenizer,
                                                                  monkeypatch, fresh_accelerator_state):
    seen = {"rollout": set(), "policy_update": set(), "critic_update": set()}
    score_responses, response_logprobs, response_values = (ppo.score_responses, ppo.response_logprobs,
                                                           ppo.response_values)

    def spy_score(*args, **kwargs):
        seen["rollout"].add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return score_responses(*args, **kwargs)

    def dtype_of_update(key, model, forward, *args, **kwargs):
        dtypes = []  # of a linear layer's output: bf16 under autocast (the residual stream stays float32)
        prefix = "model" if key == "policy_update" else "backbone"
        layer = model.get_submodule(f"{prefix}.layers.0.mlp.down_proj")
        handle = layer.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
        try:
            result = forward(model, *args, **kwargs)
        finally:
            handle.remove()
        checkpointing = (model.backbone if key == "critic_update" else model).is_activation_checkpointing
        seen[key].add((dtypes[0], checkpointing))
        return result

    monkeypatch.setattr(ppo, "score_responses", spy_score)
    monkeypatch.setattr(ppo, "response_logprobs", lambda model, *a, **k: dtype_of_update(
        "policy_update", model, response_logprobs, *a, **k))
    monkeypatch.setattr(ppo, "response_values", lambda model, *a, **k: dtype_of_update(
        "critic_update", model, response_values, *a, **k))
    config = _config(tmp_path, use_lora=False, mixed_precision="bf16", gradient_checkpointing=True, max_steps=1)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert seen["rollout"] == {(True, torch.bfloat16)}
    assert seen["policy_update"] == {(torch.bfloat16, True)}
    assert seen["critic_update"] == {(torch.bfloat16, True)}
