from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from marlhf.modeling import AdaptersDisabled, ScalarHeadModel, add_lora, apply_lora, merge_lora, sequence_logprobs
from marlhf.run_config import TrainingConfig


def _nudge_adapters(model) -> None:
    """LoRA's B matrices start at zero (adapters are a no-op at first): move every trainable weight."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05)


def test_lora_trains_only_adapters_and_disabled_is_the_base_model(make_tiny_causal_lm):
    base_params = sum(p.numel() for p in make_tiny_causal_lm().parameters())
    model = add_lora(make_tiny_causal_lm(), r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    # 2 layers x (q: 32->32, v: 32->16) x (A: r x in + B: out x r)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert sum(p.numel() for p in model.parameters()) - base_params == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)

    ids = torch.randint(3, 300, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = sequence_logprobs(model, ids, mask, num_tokens=4)
        torch.testing.assert_close(before, sequence_logprobs(make_tiny_causal_lm(), ids, mask, num_tokens=4))
        _nudge_adapters(model)
        adapted = sequence_logprobs(model, ids, mask, num_tokens=4)
        disabled = sequence_logprobs(AdaptersDisabled(model), ids, mask, num_tokens=4)
    assert not torch.allclose(adapted, before)
    torch.testing.assert_close(disabled, before)  # same weights, adapters off
    torch.testing.assert_close(sequence_logprobs(model, ids, mask, num_tokens=4), adapted)  # switched back on


def test_lora_critic_keeps_a_trainable_head(make_tiny_causal_lm):
    critic = add_lora(ScalarHeadModel(make_tiny_causal_lm().model), r=2)
    assert isinstance(critic, ScalarHeadModel)
    trainable = [name for name, p in critic.named_parameters() if p.requires_grad]
    assert "head.weight" in trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    ids = torch.randint(3, 300, (2, 6))
    values = critic(ids, torch.ones_like(ids))
    values.sum().backward()
    assert critic.head.weight.grad is not None
    assert all(p.grad is None for name, p in critic.named_parameters() if not p.requires_grad)


def test_disabled_adapters_run_in_eval_mode(make_tiny_causal_lm):
    """The reference of a LoRA policy in train mode must not see the policy's dropout."""
    model = add_lora(make_tiny_causal_lm(), r=2)
    for layer in model.get_base_model().model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = torch.randint(3, 300, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = sequence_logprobs(model.eval(), ids, mask)  # B = 0: adapters are a no-op
        model.train()
        assert not torch.allclose(sequence_logprobs(model, ids, mask), expected)  # dropout is on
        torch.testing.assert_close(sequence_logprobs(AdaptersDisabled(model), ids, mask), expected)
    assert model.training


def test_apply_lora_follows_the_config_and_merge_lora_copies(make_tiny_causal_lm):
    plain = make_tiny_causal_lm()
    assert apply_lora(plain, TrainingConfig(use_lora=False)) is plain
    model = apply_lora(plain, TrainingConfig(use_lora=True, lora_r=2, lora_alpha=6.0, lora_target_modules=("v_proj",)))
    lora_layer = model.get_base_model().model.layers[0].self_attn.v_proj
    assert lora_layer.r["default"] == 2 and lora_layer.scaling["default"] == 3.0
    assert not hasattr(model.get_base_model().model.layers[0].self_attn.q_proj, "lora_A")
    _nudge_adapters(model)
    ids = torch.randint(3, 300, (2, 9))
    mask = torch.ones_like(ids)
    merged = merge_lora(model)
    assert type(merged) is LlamaForCausalLM and not any("lora_" in n for n, _ in merged.named_parameters())
    assert any("lora_" in n for n, _ in model.named_parameters())  # the model keeps its adapters
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(merged, ids, mask), sequence_logprobs(model, ids, mask))

    critic = add_lora(ScalarHeadModel(make_tiny_causal_lm().model), r=2)
    _nudge_adapters(critic)
    merged_critic = merge_lora(critic)
    assert isinstance(merged_critic, ScalarHeadModel)
    assert not any("lora_" in n for n, _ in merged_critic.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged_critic(ids, mask), critic(ids, mask))


def test_lora_bad_input(make_tiny_causal_lm):
    with pytest.raises(ValueError, match="r must"):
        add_lora(make_tiny_causal_lm(), r=0)
    with pytest.raises(ValueError, match="target_modules"):
        add_lora(make_tiny_causal_lm(), target_modules=())
    with pytest.raises(ValueError, match="peft model"):
        AdaptersDisabled(make_tiny_causal_lm())
