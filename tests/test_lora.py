from __future__ import annotations

import pytest
import torch

from marlhf.modeling import AdaptersDisabled, ScalarHeadModel, add_lora, sequence_logprobs


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


def test_lora_bad_input(make_tiny_causal_lm):
    with pytest.raises(ValueError, match="r must"):
        add_lora(make_tiny_causal_lm(), r=0)
    with pytest.raises(ValueError, match="target_modules"):
        add_lora(make_tiny_causal_lm(), target_modules=())
    with pytest.raises(ValueError, match="peft model"):
        AdaptersDisabled(make_tiny_causal_lm())
