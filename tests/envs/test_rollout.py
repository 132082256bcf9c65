"""The three libraries' environments batched through the multi-turn rollout (marlhf.multiturn) with a tiny model:
one row per episode, the library's rewards on the turns' last action tokens. Training steps on them:
test_documented_commands.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from marlhf.engines import HFEngine, HFOptions, model_positions
from marlhf.envs import make_env
from marlhf.multiturn import EngineSampler, MultiTurnOptions, rollout_episodes
from tests.envs.episodes import GSM8K_RECORD as RECORD


@pytest.fixture(scope="module")
def long_tiny_policy(tiny_tokenizer):
    """The tests' tiny model with room for a TextArena prompt (about 600 tokens of the tiny tokenizer)."""
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tiny_tokenizer.pad_token_id, bos_token_id=tiny_tokenizer.bos_token_id,
                         eos_token_id=tiny_tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _rollout(policy, tokenizer, envs, tasks=None, **options):
    engine = HFEngine()
    engine.options = HFOptions()
    engine.sync_weights(policy)
    generate = EngineSampler(engine, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    return rollout_episodes(envs, generate, tokenizer, seeds=list(range(len(envs))), tasks=tasks,
                            options=MultiTurnOptions(**{"max_turn_tokens": 8, **options}),
                            max_length=model_positions(policy))


def _check_rows(rollout) -> None:
    """Each turn's reward sits on its last action token, and the rewards tensor holds nothing else."""
    for b in range(rollout.rewards.shape[0]):
        for k in range(int(rollout.num_turns[b])):
            last = int((rollout.turn_ids[b] == k).nonzero().max())
            assert rollout.rewards[b, last] == rollout.turn_rewards[b, k]
    assert rollout.rewards.sum() == pytest.approx(float(rollout.turn_rewards.sum()))


def test_textarena_games_in_one_batch(long_tiny_policy, tiny_tokenizer):
    """Invalid moves of the tiny model: a retry, then the library ends the game (TicTacToe: a loss, -1)."""
    pytest.importorskip("textarena", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    envs = [make_env("textarena:GuessTheNumber-v0"), make_env("textarena:Mastermind-v0"),
            make_env("textarena:TicTacToe-v0", {"opponent": "tests.envs.test_textarena:first_free_cell"})]
    rollout = _rollout(long_tiny_policy, tiny_tokenizer, envs, max_turns=4)
    assert rollout.terminated.all() and rollout.num_turns.tolist() == [2, 2, 2]
    assert rollout.turn_rewards[2, 1] == -1.0 and rollout.action_mask.any(1).all()
    _check_rows(rollout)


def test_a_skyrl_gym_episode_of_three_turns_with_per_turn_rewards(long_tiny_policy, tiny_tokenizer):
    pytest.importorskip("skyrl_gym", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    rollout = _rollout(long_tiny_policy, tiny_tokenizer, [make_env("skyrl_gym:gsm8k_multi_turn")] * 1, [RECORD])
    assert rollout.terminated.tolist() == [True] and rollout.num_turns.tolist() == [3]
    assert (~rollout.action_mask & rollout.response_mask).any()  # the environment's messages between the turns
    _check_rows(rollout)


def test_reasoning_gym_tasks_are_episodes_of_one_turn(long_tiny_policy, tiny_tokenizer):
    pytest.importorskip("reasoning_gym", reason="the envs extra is not installed (pip install \"marlhf[envs]\")")
    envs = [make_env(f"reasoning_gym:{name}", {"size": 4}) for name in ("chain_sum", "prime_factorization")]
    rollout = _rollout(long_tiny_policy, tiny_tokenizer, envs)
    assert rollout.terminated.all() and rollout.num_turns.tolist() == [1, 1]
    assert (rollout.action_mask == rollout.response_mask).all()
    _check_rows(rollout)
