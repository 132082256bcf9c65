from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from marlhf.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, load_state, resolve_resume,
                               save_checkpoint, save_state)
from marlhf.modeling import ScalarHeadModel, add_lora


def _train_steps(model, optimizer, scheduler, steps):
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 6))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _setup(make_tiny_causal_lm):
    model = make_tiny_causal_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def test_nested_state_round_trip(tmp_path):
    state = {"a": (1, 2.5, None, "x"), 3: [torch.arange(4), np.arange(3, dtype=np.uint32)], "t": torch.tensor(1.5),
             "nested": {"b": True, "nan": float("nan")}}
    save_state(tmp_path / "s", state)
    loaded = load_state(tmp_path / "s")
    assert loaded["a"] == (1, 2.5, None, "x")
    assert torch.equal(loaded[3][0], torch.arange(4)) and loaded[3][1].dtype == np.uint32
    assert loaded["t"].item() == 1.5 and loaded["nested"]["b"] is True and np.isnan(loaded["nested"]["nan"])
    with pytest.raises(TypeError, match="object"):
        save_state(tmp_path / "bad", {"x": object()})


def test_resume_restores_everything(tmp_path, make_tiny_causal_lm):
    torch.manual_seed(0)
    model, optimizer, scheduler = _setup(make_tiny_causal_lm)
    _train_steps(model, optimizer, scheduler, 2)
    save_checkpoint(tmp_path, 2, {"policy": model}, {"policy": optimizer}, {"policy": scheduler},
                    trainer_state={"epoch": 0, "seen": (1, 2)})
    random.random(), np.random.rand()
    _train_steps(model, optimizer, scheduler, 2)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    expected_draws = (random.random(), np.random.rand())

    model2, optimizer2, scheduler2 = _setup(lambda: make_tiny_causal_lm(seed=5))
    state = load_checkpoint(latest_checkpoint(tmp_path), {"policy": model2}, {"policy": optimizer2},
                            {"policy": scheduler2})
    assert state == {"epoch": 0, "seen": (1, 2), "step": 2}
    random.random(), np.random.rand()
    _train_steps(model2, optimizer2, scheduler2, 2)
    assert all(torch.equal(reference[k], v) for k, v in model2.state_dict().items())
    assert (random.random(), np.random.rand()) == expected_draws
    assert scheduler2.state_dict() == scheduler.state_dict()


def test_keep_last_k_and_atomicity(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    model = make_tiny_causal_lm()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"model": model}, tokenizer=tiny_tokenizer, save_total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    # a crash during a save leaves only a hidden temporary directory, which is ignored
    (tmp_path / ".tmp-checkpoint-5").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    save_checkpoint(tmp_path, 4, {"model": model})  # re-saving a step replaces it
    assert (tmp_path / "checkpoint-4" / "model" / "model.safetensors").exists()
    assert (tmp_path / "checkpoint-3" / "model" / "tokenizer.json").exists()


def test_resolve_resume(tmp_path, make_tiny_causal_lm):
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(ValueError, match="latest"):
        resolve_resume("latest", tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    save_checkpoint(tmp_path, 7, {"model": make_tiny_causal_lm()})
    assert resolve_resume("latest", tmp_path).name == "checkpoint-7"


def test_scalar_head_model_checkpoint(tmp_path, make_tiny_causal_lm):
    torch.manual_seed(1)
    critic = ScalarHeadModel(make_tiny_causal_lm().model)
    save_checkpoint(tmp_path, 1, {"critic": critic})
    torch.manual_seed(2)
    other = ScalarHeadModel(make_tiny_causal_lm(seed=3).model)
    load_checkpoint(tmp_path / "checkpoint-1", {"critic": other})
    ids = torch.randint(0, 50, (2, 5))
    mask = torch.ones_like(ids)
    assert torch.equal(critic(ids, mask), other(ids, mask))


def test_several_models_and_optimizers_keep_separate_files(tmp_path, make_tiny_causal_lm):
    torch.manual_seed(0)
    policy, policy_optimizer, policy_scheduler = _setup(make_tiny_causal_lm)
    critic = ScalarHeadModel(make_tiny_causal_lm(seed=1).model)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=5e-3)
    _train_steps(policy, policy_optimizer, policy_scheduler, 1)
    critic(torch.randint(0, 50, (2, 4)), torch.ones(2, 4, dtype=torch.long)).sum().backward()
    critic_optimizer.step()
    path = save_checkpoint(tmp_path, 1, {"policy": policy, "critic": critic},
                           {"policy": policy_optimizer, "critic": critic_optimizer}, {"policy": policy_scheduler})
    names = {p.name for p in path.iterdir()}
    assert {"policy", "critic", "optimizer.policy.json", "optimizer.critic.safetensors", "scheduler.policy.json",
            "rng_state.0.json", "trainer_state.json"} <= names
    new_policy, new_policy_optimizer, new_policy_scheduler = _setup(lambda: make_tiny_causal_lm(seed=7))
    new_critic = ScalarHeadModel(make_tiny_causal_lm(seed=8).model)
    new_critic_optimizer = torch.optim.AdamW(new_critic.parameters(), lr=5e-3)
    load_checkpoint(path, {"policy": new_policy, "critic": new_critic},
                    {"policy": new_policy_optimizer, "critic": new_critic_optimizer}, {"policy": new_policy_scheduler})
    for before, after in ((policy_optimizer, new_policy_optimizer), (critic_optimizer, new_critic_optimizer)):
        for state_before, state_after in zip(before.state.values(), after.state.values()):
            assert torch.equal(state_before["exp_avg"], state_after["exp_avg"])
    assert torch.equal(new_critic.head.weight, critic.head.weight)


def test_lora_checkpoint_holds_adapters_and_head_and_checks_them(tmp_path, make_tiny_causal_lm):
    policy, critic = add_lora(make_tiny_causal_lm(), r=2), add_lora(ScalarHeadModel(make_tiny_causal_lm().model), r=2)
    with torch.no_grad():  # LoRA's B matrices start at zero: make the adapters count
        for parameter in (*policy.parameters(), *critic.parameters()):
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter))
    path = save_checkpoint(tmp_path, 1, {"policy": policy, "critic": critic})
    assert not (path / "policy" / "model.safetensors").exists()  # the frozen base is not saved again

    new_policy = add_lora(make_tiny_causal_lm(), r=2)
    new_critic = add_lora(ScalarHeadModel(make_tiny_causal_lm().model), r=2)
    load_checkpoint(path, {"policy": new_policy, "critic": new_critic})
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), new_policy.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), new_critic.state_dict().values()))

    with pytest.raises(ValueError, match="other adapters"):
        load_checkpoint(path, {"policy": add_lora(make_tiny_causal_lm(), r=2, target_modules=("q_proj",))})
    save_checkpoint(tmp_path, 2, {"policy": make_tiny_causal_lm()})
    with pytest.raises(ValueError, match="no LoRA adapters"):
        load_checkpoint(tmp_path / "checkpoint-2", {"policy": new_policy})
    with pytest.raises(ValueError, match="LoRA adapters only"):
        load_checkpoint(path, {"policy": make_tiny_causal_lm()})
