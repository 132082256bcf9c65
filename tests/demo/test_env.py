"""The demo's multi-turn task `relay` (marlhf.demo.env): its rule, its registration, and a full episode of the
demo's tiny model through the multi-turn rollout."""

from __future__ import annotations

import pytest
import torch

from marlhf.demo.env import RelayEnv, RelayOptions
from marlhf.demo.pretrain import tiny_llama
from marlhf.demo.task import SyntheticTask
from marlhf.demo.tokenizer import train_tokenizer
from marlhf.engines import HFEngine, model_positions
from marlhf.envs import get_env, make_env
from marlhf.multiturn import MultiTurnOptions, EngineSampler, rollout_episodes


def _bright(env: RelayEnv) -> str:
    return env.task.words_by_class["bright"][0]


def test_right_turns_earn_the_outcome_and_each_depends_on_the_last_reply():
    env = RelayEnv()
    prompt, info = env.reset(5)
    assert prompt.endswith("|") and len(prompt.split()) == 9 and info["relayed"] == env.relayed
    reply, reward, terminated, truncated, _ = env.step(_bright(env) + " whatever follows")
    assert (reward, terminated, truncated) == (pytest.approx(1 / 3), False, False)
    assert reply == f"{env.relayed[0]} |"
    reply, reward, *_ = env.step(reply.split()[0])  # repeat what the environment just said
    assert reward == pytest.approx(1 / 3) and reply == f"{env.relayed[1]} |"
    _, reward, terminated, _, _ = env.step(env.relayed[0])  # the earlier word is wrong now
    assert reward == 0.0 and terminated
    other = RelayEnv()
    other.reset(6)
    assert other.relayed != env.relayed  # the right later actions differ between episodes
    wrong = RelayEnv()
    wrong.reset(5)
    assert [wrong.step(text)[1] for text in (env.task.words_by_class["dark"][0], "", "ka |")] == [0.0, 0.0, 0.0]


def test_registered_with_typed_options_and_cloned_by_replay():
    assert get_env("relay").obj is RelayEnv
    env = make_env("relay", {"turns": 5})
    assert env.options == RelayOptions(turns=5)
    with pytest.raises(ValueError, match=">= 2"):
        make_env("relay", {"turns": 1})
    env.reset(3, {"prompt": "ka | "})
    env.step(_bright(env))
    clone = env.clone()
    assert clone.turn == 1 and clone.relayed == env.relayed
    assert clone.step(env.relayed[0]) == env.step(env.relayed[0])


def test_a_full_episode_of_the_demo_model():
    task = SyntheticTask()
    tokenizer = train_tokenizer(task.pretraining_texts(300, seed=0))
    torch.manual_seed(0)
    policy = tiny_llama(tokenizer).eval()
    engine = HFEngine()
    engine.sync_weights(policy)
    generate = EngineSampler(engine, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    envs = [RelayEnv() for _ in range(4)]
    rollout = rollout_episodes(envs, generate, tokenizer, seeds=[0, 1, 2, 3],
                               options=MultiTurnOptions(max_turns=3, max_turn_tokens=8),
                               max_length=model_positions(policy), env_name="relay")
    assert rollout.num_turns.tolist() == [3] * 4 and rollout.terminated.all() and not rollout.truncated.any()
    assert set(rollout.turn_rewards.flatten().tolist()) <= {0.0, 1 / 3}
    torch.testing.assert_close(rollout.rewards.sum(1), rollout.turn_rewards.sum(1))
    for b, env in enumerate(envs):
        observations = rollout.response_ids[b, rollout.response_mask[b] & ~rollout.action_mask[b]]
        assert tokenizer.decode(observations.tolist()).split() == [env.relayed[0], "|", env.relayed[1], "|"]
