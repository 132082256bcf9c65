import json

import numpy as np
import pytest
import torch

from marlhf.evaluation.evaluate import (EvaluateConfig, best_of_n_table, generate_texts, reward_model_scores,
                                        run_evaluation, summarize_scores)
from marlhf.metrics import text_repetition
from marlhf.modeling import ScalarHeadModel
from tests.conftest import build_tiny_causal_lm

PROMPTS = ["Human: How do I bake bread?\n\nAssistant:", "def add(a, b):", "The quick brown fox",
           "POST\nSubreddit: r/test\nMy cat sleeps all day.\nTL;DR: ", "A short summary."]
RECORDS = [{"prompt": p} for p in PROMPTS]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir, tiny_tokenizer):
    torch.manual_seed(5)
    reward_model = ScalarHeadModel.from_pretrained(tiny_model_dir)
    path = tmp_path_factory.mktemp("tiny_rm")
    reward_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def second_policy_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("policy_b")
    build_tiny_causal_lm(tiny_tokenizer, seed=1).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def small_config(tmp_path, model_dir, reward_model_dir, **overrides):
    values = dict(model_name_or_path=str(model_dir), reward_model=str(reward_model_dir), output_dir=str(tmp_path / "eval"),
                  num_samples=len(PROMPTS), batch_size=3, max_response_length=6, max_prompt_length=64, seed=3)
    return EvaluateConfig(**{**values, **overrides})


def test_summarize_scores_matches_numpy():
    scores = np.random.default_rng(0).normal(size=101)
    summary = summarize_scores(scores)
    assert summary["count"] == 101
    assert summary["mean"] == pytest.approx(scores.mean()) and summary["std"] == pytest.approx(scores.std())
    assert summary["q50"] == pytest.approx(np.median(scores))
    assert summary["q05"] == pytest.approx(np.quantile(scores, 0.05))
    with pytest.raises(ValueError, match="empty"):
        summarize_scores([])


def test_best_of_n_table_matches_loop():
    scores = np.random.default_rng(1).normal(size=(7, 8))
    expected = [np.mean([max(row[:n]) for row in scores]) for n in (1, 2, 4, 8)]
    assert best_of_n_table(scores, [1, 2, 4, 8]) == pytest.approx(expected)
    with pytest.raises(ValueError, match="samples"):
        best_of_n_table(scores, [16])


def test_reward_model_scores_do_not_depend_on_batching(reward_model_dir, tiny_tokenizer):
    reward_model = ScalarHeadModel.from_pretrained(reward_model_dir)
    responses = [" yes", " a much longer answer with many words in it", "", " no.", " maybe"]
    batched = reward_model_scores(reward_model, tiny_tokenizer, PROMPTS, responses, batch_size=5)
    one_by_one = [reward_model_scores(reward_model, tiny_tokenizer, [p], [r], batch_size=1)[0]
                  for p, r in zip(PROMPTS, responses)]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert len(set(np.round(batched, 5))) > 1


def test_generate_texts_is_seeded_and_groups_samples(tiny_model_dir, tiny_tokenizer):
    policy = build_tiny_causal_lm(tiny_tokenizer)
    torch.manual_seed(0)
    first = generate_texts(policy, tiny_tokenizer, PROMPTS[:2], samples_per_prompt=3, batch_size=4, max_new_tokens=5)
    torch.manual_seed(0)
    again = generate_texts(policy, tiny_tokenizer, PROMPTS[:2], samples_per_prompt=3, batch_size=4, max_new_tokens=5)
    assert first == again
    assert [len(samples) for samples in first] == [3, 3]


def test_evaluate_one_checkpoint_writes_responses_and_summary(tmp_path, tiny_model_dir, reward_model_dir, tiny_tokenizer):
    config = small_config(tmp_path, tiny_model_dir, reward_model_dir)
    summary = run_evaluation(config, RECORDS, device="cpu")
    rows = [json.loads(line) for line in (tmp_path / "eval" / "responses.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    rescored = reward_model_scores(ScalarHeadModel.from_pretrained(reward_model_dir), tiny_tokenizer, PROMPTS,
                                   [r["response"] for r in rows], max_prompt_length=64)
    assert [r["score"] for r in rows] == pytest.approx(rescored, abs=1e-5)
    assert json.loads((tmp_path / "eval" / "summary.json").read_text()) == summary
    assert summary["mean"] == pytest.approx(np.mean(rescored), abs=1e-5)
    assert summary["repeated_word_3gram_fraction"] == pytest.approx(np.mean(text_repetition([r["response"] for r in rows])))


def test_compare_checkpoints(tmp_path, tiny_model_dir, second_policy_dir, reward_model_dir):
    config = small_config(tmp_path, tiny_model_dir, reward_model_dir, compare=(str(second_policy_dir),))
    comparison = run_evaluation(config, RECORDS, device="cpu")
    first, second = list(comparison["summaries"])
    out = tmp_path / "eval"
    for name in (first, second):
        assert len((out / name / "responses.jsonl").read_text().splitlines()) == len(PROMPTS)
    assert (out / "score_histograms.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / f"scatter_{first}_vs_{second}.png").read_bytes()[:4] == b"\x89PNG"
    scores = {name: np.array([json.loads(line)["score"] for line in (out / name / "responses.jsonl").read_text().splitlines()])
              for name in (first, second)}
    pair = comparison["pairs"][f"{second}_vs_{first}"]
    assert (pair["model"], pair["baseline"]) == (second, first)
    assert pair["mean_score_difference"] == pytest.approx((scores[second] - scores[first]).mean(), abs=1e-6)
    assert pair["fraction_model_higher"] == pytest.approx((scores[second] > scores[first]).mean())


def test_best_of_n_grid(tmp_path, tiny_model_dir, reward_model_dir):
    config = small_config(tmp_path, tiny_model_dir, reward_model_dir, best_of_n=(1, 2, 4),
                          best_of_n_temperatures=(0.5, 1.2), num_samples=3, max_response_length=4, batch_size=12)
    table = run_evaluation(config, RECORDS[:3], device="cpu")
    values = np.array(table["mean_best_score"])
    assert values.shape == (3, 2)
    assert np.all(np.diff(values, axis=0) >= 0)  # more samples never lower the best score
    out = tmp_path / "eval"
    assert json.loads((out / "best_of_n.json").read_text()) == table
    markdown = (out / "best_of_n.md").read_text().splitlines()
    assert markdown[0] == "| N \\ temperature | 0.5 | 1.2 |" and len(markdown) == 5
    assert (out / "best_of_n.png").read_bytes()[:4] == b"\x89PNG"


def test_config_validation():
    with pytest.raises(ValueError, match="reward_model is required"):
        EvaluateConfig()
    with pytest.raises(ValueError, match="samples_per_prompt"):
        EvaluateConfig(pass_at_k=(1, 20), samples_per_prompt=10)
    with pytest.raises(ValueError, match="best_of_n"):
        EvaluateConfig(reward_model="rm", best_of_n=(0, 4))
    with pytest.raises(ValueError, match="separate runs"):
        EvaluateConfig(reward_model="rm", best_of_n=(4,), compare=("b",))
