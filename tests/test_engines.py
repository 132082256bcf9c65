"""The rollout-engine seam: PPO samples only through `sync_weights` + `generate` and closes the engine when training
ends (also on an error), so an engine is one class."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marlhf.engines import ENGINES, Generation, HFEngine, get_engine, register_engine
from marlhf.logging_utils import read_metrics
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.test_ppo import RECORDS, _config, count_e


class CountingEngine(HFEngine):
    """An engine of its own (here: the HF sampler, counting what the trainer asks of it)."""

    instances: list["CountingEngine"] = []

    def __init__(self, context=None) -> None:
        super().__init__(context)
        self.synced, self.calls, self.closed = [], [], 0
        CountingEngine.instances.append(self)

    def sync_weights(self, policy):
        self.synced.append(id(policy))
        super().sync_weights(policy)

    def generate(self, prompt_ids, prompt_mask, **sampling):
        self.calls.append(sampling)
        return super().generate(prompt_ids, prompt_mask, **sampling)

    def close(self):
        self.closed += 1
        super().close()


def test_ppo_samples_through_the_engine_and_a_registered_engine_trains_alike(tmp_path, make_tiny_causal_lm,
                                                                          tiny_tokenizer):
    register_engine("counting")(CountingEngine)
    try:
        config = _config(tmp_path, max_steps=2)
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        counted = dataclasses.replace(config, output_dir=str(tmp_path / "counted"), rollout_engine="counting")
        train_ppo(counted, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    finally:
        ENGINES.pop("counting")
    (engine,) = CountingEngine.instances
    assert len(engine.calls) == len(engine.synced) == 2 and len(set(engine.synced)) == 1 and engine.closed == 1
    assert all(len(call["row_seeds"]) == config.rollout_size and call["temperature"] == config.temperature
               for call in engine.calls)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "counted")) == strip(read_metrics(tmp_path / "ppo"))


def test_engine_errors():
    with pytest.raises(ValueError, match="rollout_engine"):
        PPOConfig(rollout_engine="sglang")
    with pytest.raises(ValueError, match="rollout_engine"):
        get_engine("sglang")
    with pytest.raises(RuntimeError, match="sync_weights"):
        HFEngine().generate(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="already registered"):
        register_engine("hf")(CountingEngine)


class NoLogprobsEngine(HFEngine):
    """An engine that ignores `return_logprobs`."""

    closed = 0

    def close(self):
        NoLogprobsEngine.closed += 1
        super().close()

    def generate(self, prompt_ids, prompt_mask, **sampling):
        generation = super().generate(prompt_ids, prompt_mask, **sampling)
        assert isinstance(generation, Generation) and (generation.logprobs is not None) == sampling["return_logprobs"]
        return Generation(generation.response_ids, generation.response_mask)


def test_sampling_logprobs_missing_from_the_engine_is_an_error_not_a_silent_recompute(tmp_path, make_tiny_causal_lm,
                                                                                     tiny_tokenizer):
    register_engine("no_logprobs")(NoLogprobsEngine)
    try:
        config = _config(tmp_path, max_steps=1, rollout_engine="no_logprobs", log_rollout_logprob_diff=True)
        with pytest.raises(ValueError, match="no sampling log-probs"):
            train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    finally:
        ENGINES.pop("no_logprobs")
    assert NoLogprobsEngine.closed == 1  # closed on the error too
