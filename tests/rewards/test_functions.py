"""Reward functions in TRL's convention: record fields as keyword lists, several functions with weights,
dotted paths from the command line, each logged as rewards/<name>."""

from __future__ import annotations

import pytest

from marlhf.logging_utils import read_metrics
from marlhf.rewards.functions import RewardFunctions, takes_record_fields
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.test_ppo import _config

RECORDS = [{"prompt": f"Human: say something about {topic}\n\nAssistant:", "topic": topic, "target": len(topic)}
           for topic in ("cats", "dogs", "bread", "rain", "code", "tea", "maps", "boats")]
SEEN: list[dict] = []


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def topic_mentioned(prompts, completions, topic, target, **others):
    SEEN.append({"prompts": prompts, "topic": topic, "target": target})
    return [float(t in c) + 0.0 * n for c, t, n in zip(completions, topic, target)]


def test_the_convention_is_read_off_the_signature():
    assert not takes_record_fields(count_e) and takes_record_fields(topic_mentioned)
    assert takes_record_fields(lambda prompts, completions, **fields: [])
    combined = RewardFunctions([count_e, topic_mentioned], weights=[1.0, 2.0])
    SEEN.clear()
    scores = combined(["p1", "p2"], ["eel cats", "tea"], topic=["cats", "dogs"], target=[4, 4])
    assert scores == [2.0 + 2.0, 1.0 + 0.0] and combined.last_means == {"count_e": 1.5, "topic_mentioned": 0.5}
    with pytest.raises(ValueError, match="2 reward_weights for 1"):
        RewardFunctions([count_e], [1.0, 2.0])
    with pytest.raises(ValueError, match="returned 1 scores for 2"):
        RewardFunctions([lambda p, c: [1.0]])(["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="NaN or inf"):
        RewardFunctions([lambda p, c: [float("nan")] * len(c)])(["a"], ["x"])


def test_ppo_passes_each_row_its_record_fields_and_logs_each_function(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    SEEN.clear()
    config = _config(tmp_path, reward_fns=("tests.rewards.test_functions:count_e",
                                           "tests.rewards.test_functions:topic_mentioned"),
                     reward_weights=(1.0, 0.5), num_samples_per_prompt=2, per_device_batch_size=4, mini_batch_size=8)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)
    by_prompt = {r["prompt"]: r for r in RECORDS}
    for call in SEEN:  # every response got its own record's fields, in row order
        assert call["topic"] == [by_prompt[p]["topic"] for p in call["prompts"]]
        assert call["target"] == [by_prompt[p]["target"] for p in call["prompts"]]
    metrics = read_metrics(config.output_dir)
    for m in metrics:
        assert m["objective/rm_score"] == pytest.approx(m["rewards/count_e"] + 0.5 * m["rewards/topic_mentioned"])


def test_bad_reward_options_stop_at_the_config():
    with pytest.raises(ValueError, match="cannot import"):
        PPOConfig(reward_fns=("no_such_module:score",))
    with pytest.raises(ValueError, match="dotted path"):
        PPOConfig(reward_fns=("score",))
    with pytest.raises(ValueError, match="one weight per reward_fns"):
        PPOConfig(reward_fns=("tests.rewards.test_functions:count_e",), reward_weights=(1.0, 2.0))
