from __future__ import annotations

import pytest
import torch

from marlhf.data.encoding import collate_pairs, encode_pairs
from marlhf.logging_utils import read_metrics
from marlhf.modeling import ScalarHeadModel
from marlhf.trainers.reward import RewardConfig, pair_scores, split_records, train_reward_model


def _lengths(config) -> tuple[int, int]:
    return config.max_prompt_length, config.max_length


def _config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "rm"), learning_rate=3e-3, per_device_batch_size=4, max_steps=12,
                  warmup_ratio=0.0, save_steps=0, max_prompt_length=32, max_length=64, eval_fraction=0.2,
                  eval_steps=6, seed=0)
    values.update(overrides)
    return RewardConfig(**values)


def test_pair_scores_are_the_last_token_values(tmp_path, tiny_tokenizer, make_tiny_causal_lm, tiny_records):
    model = ScalarHeadModel(make_tiny_causal_lm().model)
    config = _config(tmp_path)
    pairs = encode_pairs(tiny_tokenizer, tiny_records["rm"][:3], *_lengths(config))
    chosen, rejected = pair_scores(model, collate_pairs(pairs, tiny_tokenizer.pad_token_id, torch.device("cpu")))
    for row, (chosen_example, rejected_example) in enumerate(pairs):
        for example, score in ((chosen_example, chosen[row]), (rejected_example, rejected[row])):
            ids = torch.tensor([example[0]])
            torch.testing.assert_close(score, model.score(ids, torch.ones_like(ids))[0], atol=1e-5, rtol=1e-5)


def test_split_records_is_seeded_and_disjoint(tiny_records):
    train, held_out = split_records(tiny_records["rm"], 0.2, seed=1)
    assert len(held_out) == 2 and len(train) == 8
    assert split_records(tiny_records["rm"], 0.2, seed=1) == (train, held_out)
    assert not {r["chosen"] for r in train} & {r["chosen"] for r in held_out}
    assert split_records(tiny_records["rm"], 0.0, seed=1) == (tiny_records["rm"], [])


def test_reward_model_learns_the_preference(tmp_path, tiny_tokenizer, make_tiny_causal_lm, tiny_records):
    model = ScalarHeadModel(make_tiny_causal_lm().model)
    pairs = encode_pairs(tiny_tokenizer, tiny_records["rm"], *_lengths(_config(tmp_path)))
    batch = collate_pairs(pairs, tiny_tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        margin_before = torch.sub(*pair_scores(model, batch)).mean().item()
    trained = train_reward_model(_config(tmp_path), tiny_records["rm"], model=model, tokenizer=tiny_tokenizer)
    with torch.no_grad():
        chosen, rejected = pair_scores(trained, batch)
    assert (chosen - rejected).mean().item() > margin_before + 1.0
    metrics = read_metrics(tmp_path / "rm")
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert [m["step"] for m in metrics if "eval/accuracy" in m] == [6, 12]
    assert metrics[-1]["eval/accuracy"] == 1.0
    reloaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        torch.testing.assert_close(pair_scores(reloaded, batch)[0], chosen)


def test_reward_lora_trains_adapters_and_head_and_saves_the_merged_model(tmp_path, tiny_tokenizer,
                                                                        make_tiny_causal_lm, tiny_records):
    model = ScalarHeadModel(make_tiny_causal_lm().model)
    start_weights = {k: v.clone() for k, v in model.state_dict().items()}
    batch = collate_pairs(encode_pairs(tiny_tokenizer, tiny_records["rm"], *_lengths(_config(tmp_path))),
                          tiny_tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        margin_before = torch.sub(*pair_scores(model, batch)).mean().item()
    config = _config(tmp_path, use_lora=True, lora_r=4, lora_alpha=8.0, learning_rate=1e-2)
    trained = train_reward_model(config, tiny_records["rm"], model=model, tokenizer=tiny_tokenizer)

    trainable = [name for name, p in model.named_parameters() if p.requires_grad]  # model keeps its adapters
    assert "head.weight" in trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert isinstance(trained, ScalarHeadModel) and not any("lora_" in n for n, _ in trained.named_parameters())
    with torch.no_grad():
        chosen, rejected = pair_scores(trained, batch)
    assert (chosen - rejected).mean().item() > margin_before + 1.0

    # The saved model is plain (backbone weights + head) and scores as the trained one does.
    reloaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    saved = {f"backbone.{k}": v for k, v in reloaded.backbone.state_dict().items()}
    saved.update({f"head.{k}": v for k, v in reloaded.head.state_dict().items()})
    assert saved.keys() == start_weights.keys()
    changed = {k for k in saved if not torch.equal(saved[k], start_weights[k])}
    attention = {k for k in saved if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))}
    assert changed == attention | {"head.weight", "head.bias"}
    with torch.no_grad():
        torch.testing.assert_close(pair_scores(reloaded, batch)[0], chosen)


def test_reward_config_validation(tmp_path):
    with pytest.raises(ValueError, match="eval_fraction"):
        _config(tmp_path, eval_fraction=1.0)
    with pytest.raises(ValueError, match="chosen"):
        train_reward_model(_config(tmp_path), [{"prompt": "p", "rejected": "r"}], model=object(), tokenizer=object())
