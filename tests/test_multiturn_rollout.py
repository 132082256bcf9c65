"""Multi-turn rollouts (marlhf.multiturn) on the hf engine: the row layout of docs/multiturn.md, batched equals one
at a time, chat templates and plain separators, limits, and each fault's documented end."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from marlhf.engines import HFEngine, HFOptions, model_positions
from marlhf.envs import Env
from marlhf.errors import MarlhfError
from marlhf.multiturn import (MultiTurnOptions, ObservationEncoder, _fitting_groups, EngineSampler, concat_rollouts,
                              rollout_episodes, turn_seed)
from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()


@pytest.fixture(scope="module")
def policy():
    return build_tiny_causal_lm(TOKENIZER).eval()


def _sampler(policy, noise: str = "row_generators", tokenizer=TOKENIZER, **sampling):
    engine = HFEngine()
    engine.options = HFOptions(sampling_noise=noise)
    engine.sync_weights(policy)
    settings = dict(temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    return EngineSampler(engine, **{**settings, **sampling})


class Script(Env):
    """Ends after `task` turns (terminated); replies `seen <turn> <chars of the action mod 3>`, so replies repeat
    among episodes; rewards turn + 0.5. Records what it was sent."""

    def reset(self, seed, task=None):
        self.turns, self.sent = task or 2, []
        return f"Human: start {seed % 3}\n\nAssistant:", {}

    def step(self, action_text):
        self.sent.append(action_text)
        turn = len(self.sent)
        return f"seen {turn} {len(action_text) % 3}", turn - 0.5, turn >= self.turns, False, {}


def _run(policy, tasks, seeds, noise="row_generators", env=Script, **options):
    envs = [env() for _ in tasks]
    rollout = rollout_episodes(envs, _sampler(policy, noise), TOKENIZER, seeds=seeds, tasks=tasks,
                               options=MultiTurnOptions(**{"max_turn_tokens": 6, **options}),
                               max_length=model_positions(policy))
    return rollout, envs


def _row(rollout, b):
    """Episode b's real tokens: (response ids, action mask, turn ids, log-probs)."""
    real = rollout.response_mask[b]
    return (rollout.response_ids[b, real].tolist(), rollout.action_mask[b, real].tolist(),
            rollout.turn_ids[b, real].tolist(), rollout.logprobs[b, real])


def test_the_row_layout_follows_the_contract(policy):
    tasks = [1, 3, 2, 4]
    rollout, envs = _run(policy, tasks, [11, 12, 13, 14])
    encoder = ObservationEncoder(TOKENIZER)
    assert rollout.num_turns.tolist() == tasks and rollout.terminated.all() and not rollout.truncated.any()
    assert rollout.turn_rewards.shape == rollout.turn_state_ids.shape == (4, 4)
    for b, env in enumerate(envs):
        ids, actions, turns, logprobs = _row(rollout, b)
        prompt = f"Human: start {(11 + b) % 3}\n\nAssistant:"
        assert rollout.prompt_ids[b, rollout.prompt_mask[b]].tolist() == encoder.first(prompt)
        expected_turns, position = [], 0
        for k, sent in enumerate(env.sent):  # action tokens decode to what the env got; replies sit between
            length = turns.count(k)
            assert turns[position:position + length] == [k] * length
            assert TOKENIZER.decode(ids[position:position + length], skip_special_tokens=True) == sent
            position += length
            expected_turns += [k] * length
            if k < len(env.sent) - 1:  # the last turn's reply is not appended
                reply = encoder.reply(f"seen {k + 1} {len(sent) % 3}")
                assert ids[position:position + len(reply)] == reply
                position += len(reply)
                expected_turns += [-1] * len(reply)
        assert position == len(ids) and turns == expected_turns and actions == [t >= 0 for t in turns]
        assert (logprobs[torch.tensor(actions)] < 0).all() and (logprobs[~torch.tensor(actions)] == 0).all()
        rewards = rollout.rewards[b, rollout.response_mask[b]]
        last_tokens = [max(i for i, t in enumerate(turns) if t == k) for k in range(tasks[b])]
        assert torch.nonzero(rewards).flatten().tolist() == last_tokens
        assert rewards[last_tokens].tolist() == [k + 0.5 for k in range(tasks[b])]
        assert rollout.turn_rewards[b].tolist() == [k + 0.5 if k < tasks[b] else 0.0 for k in range(4)]
    assert (rollout.response_ids[~rollout.response_mask] == TOKENIZER.pad_token_id).all()
    assert (rollout.turn_ids[~rollout.action_mask] == -1).all()
    assert not (rollout.action_mask & ~rollout.response_mask).any()
    assert rollout.metrics["env/action_tokens"] == rollout.action_mask.sum().item()
    assert rollout.metrics["env/observation_tokens"] == (rollout.response_mask & ~rollout.action_mask).sum().item()


def test_actions_are_the_sampled_ids_never_the_retokenized_text(policy):
    sampler, sampled = _sampler(policy), []

    class Recording:  # the sampler, keeping each call's sampled ids by episode seed and turn
        new_cache = sampler.new_cache

        def __call__(self, ids, mask, seeds, n, cache=None):
            generation = sampler(ids, mask, seeds, n, cache)
            sampled.extend(zip(seeds, generation.response_ids[:, :6].tolist(), generation.response_mask.tolist()))
            return generation

    tasks, seeds = [3, 2, 3, 1, 3, 2], [30, 31, 32, 33, 34, 35]
    rollout = rollout_episodes([Script() for _ in tasks], Recording(), TOKENIZER, seeds=seeds, tasks=tasks,
                               options=MultiTurnOptions(max_turn_tokens=6), max_length=model_positions(policy))
    by_seed = {seed: [token for token, real in zip(ids, mask) if real] for seed, ids, mask in sampled}
    retokenized_differs = False
    for b, seed in enumerate(seeds):
        ids, _, turns, _ = _row(rollout, b)
        for k in range(tasks[b]):
            action = [token for token, turn in zip(ids, turns) if turn == k]
            assert action == by_seed[turn_seed(seed, k)][:6]
            text = TOKENIZER.decode(action, skip_special_tokens=True)
            retokenized_differs |= TOKENIZER(text, add_special_tokens=False)["input_ids"] != action
    assert retokenized_differs  # re-tokenizing the transcript would have changed some actions' ids


def test_turn_state_ids_are_equal_exactly_for_equal_observations(policy):
    rollout, _ = _run(policy, [3] * 6, list(range(6)))
    for b in range(6):
        for k in range(3):
            state = rollout.states[rollout.turn_state_ids[b, k]]
            assert state.startswith("Human: start") if k == 0 else state.startswith(f"seen {k}")
    keys = [(b, k) for b in range(6) for k in range(3)]
    for b, k in keys:
        for c, j in keys:
            same_text = rollout.states[rollout.turn_state_ids[b, k]] == rollout.states[rollout.turn_state_ids[c, j]]
            assert same_text == (rollout.turn_state_ids[b, k] == rollout.turn_state_ids[c, j])
    assert len(set(rollout.turn_state_ids[:, 0].tolist())) == 3  # seeds mod 3: three first observations


@pytest.mark.parametrize("noise", ["row_generators", "counter_hash"])
def test_a_batched_rollout_equals_the_episodes_run_one_at_a_time(policy, noise):
    tasks, seeds = [3, 1, 4, 2, 3], [5, 6, 7, 8, 2**32 - 1]
    batched, _ = _run(policy, tasks, seeds, noise, max_response_tokens=40)
    for b in range(len(tasks)):
        alone, _ = _run(policy, tasks[b:b + 1], seeds[b:b + 1], noise, max_response_tokens=40)
        ids, actions, turns, logprobs = _row(batched, b)
        assert (ids, actions, turns) == _row(alone, 0)[:3]  # token for token
        torch.testing.assert_close(logprobs, _row(alone, 0)[3], rtol=0, atol=1e-5)
        for name in ("num_turns", "terminated", "truncated"):
            assert getattr(batched, name)[b].tolist() == getattr(alone, name)[0].tolist()
        assert batched.turn_rewards[b, :tasks[b]].tolist() == alone.turn_rewards[0].tolist()


class SeedRecorder(Script):
    """Script that records the seed its reset got."""

    def reset(self, seed, task=None):
        self.reset_seed = seed
        return super().reset(seed, task)


def test_env_seeds_reset_the_environments_and_seeds_sample_the_turns(policy):
    """Two episodes reset with one env seed (a prompt's group) start from one state and sample from their own seeds:
    each equals its episode run alone with that env seed, and, with an env seed that its observations do not show
    (7 and 4 both give 'start 1'), what it samples under its own seed alone."""
    tasks, seeds = [2, 2], [5, 6]
    envs = [SeedRecorder() for _ in tasks]
    options = MultiTurnOptions(max_turn_tokens=6, max_response_tokens=40)
    grouped = rollout_episodes(envs, _sampler(policy), TOKENIZER, seeds=seeds, env_seeds=[7, 7], tasks=tasks,
                               options=options, max_length=model_positions(policy))
    assert [env.reset_seed for env in envs] == [7, 7]
    assert grouped.turn_state_ids[0, 0] == grouped.turn_state_ids[1, 0]  # one anchor state at turn 0
    for b in range(2):
        alone = rollout_episodes([SeedRecorder()], _sampler(policy), TOKENIZER, seeds=seeds[b:b + 1],
                                 env_seeds=[4], tasks=tasks[b:b + 1], options=options,
                                 max_length=model_positions(policy))
        assert _row(grouped, b)[:3] == _row(alone, 0)[:3]
    assert _row(grouped, 0)[0] != _row(grouped, 1)[0]  # the samples differ
    with pytest.raises(ValueError, match="env_seeds"):
        rollout_episodes([Script(), Script()], _sampler(policy), TOKENIZER, seeds=[0, 1], env_seeds=[0])


def test_shares_joined_by_concat_rollouts_are_the_whole_batch(policy):
    """What the trainer makes of two rollout workers' shares (marlhf.trainers.staleness): the rollout of all the
    rows at once, padding and state ids included; the counts summed (each share counts its own generate calls)."""
    tasks, seeds = [3, 1, 4, 2, 3], [5, 6, 7, 8, 9]
    whole, _ = _run(policy, tasks, seeds, max_response_tokens=40)
    joined = concat_rollouts([_run(policy, tasks[rows], seeds[rows], max_response_tokens=40)[0]
                              for rows in (slice(0, 2), slice(2, 5))], TOKENIZER.pad_token_id)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "action_mask", "turn_ids", "rewards",
                 "turn_rewards", "turn_state_ids", "num_turns", "terminated", "truncated"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    torch.testing.assert_close(joined.logprobs, whole.logprobs, rtol=0, atol=1e-5)
    assert joined.states == whole.states
    timings = ("env/generate_calls", "env/step_seconds", "env/generate_seconds")
    assert {k: v for k, v in joined.metrics.items() if k not in timings} == \
        {k: v for k, v in whole.metrics.items() if k not in timings}


class Ragged(Script):
    """Script with replies of 0-3 words (so with no separator some replies are empty)."""

    def reset(self, seed, task=None):
        self.seed = seed
        return super().reset(seed, task)

    def step(self, action_text):
        reply, *rest = super().step(action_text)
        return " ".join(["ab"] * ((self.seed + len(self.sent)) % 4)), *rest


@pytest.mark.parametrize("separator", ["\n", ""])
def test_continuing_the_kv_cache_samples_what_reading_the_whole_context_samples(policy, separator):
    """The hf engine continues each round's KV cache (rows with holes: actions cut at the episode's budget, replies
    of different lengths); a plain generate function reads every context again. Same tokens."""
    sampler, cached_columns = _sampler(policy), []

    class Recording:  # the sampler, recording how many columns each call found in its cache
        new_cache = sampler.new_cache

        def __call__(self, ids, mask, seeds, n, cache=None):
            cached_columns.append(cache.get_seq_length() if cache is not None else None)
            return sampler(ids, mask, seeds, n, cache)

    runs = {}
    def plain(ids, mask, seeds, n):  # no new_cache: every call reads the whole contexts
        return sampler(ids, mask, seeds, n)

    for name, generate in (("continued", Recording()), ("plain", plain)):
        options = MultiTurnOptions(max_turn_tokens=6, max_response_tokens=34, observation_separator=separator)
        runs[name] = rollout_episodes([Ragged() for _ in range(5)], generate, TOKENIZER, seeds=[0, 1, 2, 3, 9],
                                      tasks=[4, 2, 5, 3, 4], options=options, max_length=model_positions(policy))
    continued, plain = runs["continued"], runs["plain"]
    assert torch.equal(continued.response_ids, plain.response_ids)
    assert torch.equal(continued.action_mask, plain.action_mask) and torch.equal(continued.num_turns, plain.num_turns)
    torch.testing.assert_close(continued.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    assert continued.truncated.any() and (continued.response_mask & ~continued.action_mask).any()
    assert continued.metrics["env/generate_calls"] == plain.metrics["env/generate_calls"] == continued.num_turns.max()
    assert cached_columns[0] == 0 and all(columns is not None for columns in cached_columns)
    assert all(columns > 0 for columns in cached_columns[1:]), cached_columns  # every later call continued


def test_a_one_turn_episode_samples_what_a_single_turn_rollout_of_its_seed_samples(policy):
    rollout, _ = _run(policy, [1, 1], [21, 22], max_turn_tokens=9)
    generation = _sampler(policy)(rollout.prompt_ids, rollout.prompt_mask, [21, 22], 9)
    width = rollout.response_ids.shape[1]
    assert torch.equal(rollout.response_ids, generation.response_ids[:, :width])
    assert torch.equal(rollout.action_mask, generation.response_mask[:, :width])
    torch.testing.assert_close(rollout.logprobs, generation.logprobs[:, :width])
    assert turn_seed(21, 0) == 21 and len({turn_seed(21, k) for k in range(5)}) == 5


def test_limits_on_turns_tokens_and_positions(policy):
    rollout, _ = _run(policy, [5, 1], [1, 2], max_turns=2)
    assert rollout.num_turns.tolist() == [2, 1] and rollout.truncated.tolist() == [True, False]
    assert rollout.metrics["env/turn_limit"] == 1
    rollout, _ = _run(policy, [9, 9], [1, 2], max_response_tokens=20)
    assert rollout.response_mask.sum(1).max() <= 20 and rollout.truncated.all()
    assert rollout.metrics["env/context_overflow"] == 2
    positions = model_positions(policy)  # episodes of different lengths near the model's positions: split calls

    per_x = len(TOKENIZER(" x", add_special_tokens=False)["input_ids"])
    base = len(TOKENIZER(Script().reset(0)[0])["input_ids"])

    class Long(Script):  # seed 0: 4 tokens from the end (room for 4 more), seed 1: 40 (a full turn of 6)
        def reset(self, seed, task=None):
            return Script.reset(self, seed, task)[0] + " x" * ((positions - 4 - 36 * seed - base) // per_x), {}

    rollout = rollout_episodes([Long(), Long()], _sampler(policy), TOKENIZER, seeds=[0, 1], tasks=[3, 3],
                               options=MultiTurnOptions(max_turn_tokens=6), max_length=positions)
    assert (rollout.prompt_mask.sum(1) + rollout.response_mask.sum(1)).max() <= positions
    assert rollout.truncated.tolist() == [True, False] and rollout.num_turns.tolist() == [1, 3]
    assert rollout.metrics["env/generate_calls"] == 4  # round 0 in two calls: 4 tokens left + 6 new ones do not fit
    assert _fitting_groups([10, 20, 18, 5], [6, 2, 4, 6], 22) == [[1], [2], [0, 3]]
    assert _fitting_groups([10, 20], [6, 2], None) == [[1, 0]]


def test_observation_encoding_with_a_chat_template():
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    encoder = ObservationEncoder(tokenizer)
    assert tokenizer.decode(encoder.first("hi")) == "<s>user: hi</s><s>assistant:"
    assert tokenizer.decode(encoder.reply("the door opens")) == "<s>user: the door opens</s><s>assistant:"
    tool = [{"role": "tool", "content": "42"}, {"role": "user", "content": "and?"}]
    assert tokenizer.decode(encoder.reply(tool)) == "<s>tool: 42</s><s>user: and?</s><s>assistant:"
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(MarlhfError, match="cannot be encoded alone"):
        ObservationEncoder(tokenizer).reply("x")
    plain = ObservationEncoder(TOKENIZER, separator="\n")
    assert TOKENIZER.decode(plain.reply("the door opens")) == "\nthe door opens\n"
    messages = [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
    assert TOKENIZER.decode(plain.reply(messages)) == "\na\nb\n"


def test_a_rollout_with_a_chat_template_encodes_each_reply_as_the_templates_delta(policy):
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    encoder = ObservationEncoder(tokenizer)
    envs = [Script(), Script()]
    rollout = rollout_episodes(envs, _sampler(policy, tokenizer=tokenizer), tokenizer, seeds=[4, 5], tasks=[3, 2],
                               options=MultiTurnOptions(max_turn_tokens=5), max_length=model_positions(policy))
    for b, env in enumerate(envs):
        assert rollout.prompt_ids[b, rollout.prompt_mask[b]].tolist() == encoder.first(
            f"Human: start {(4 + b) % 3}\n\nAssistant:")
        observed = rollout.response_ids[b, rollout.response_mask[b] & ~rollout.action_mask[b]].tolist()
        replies = [encoder.reply(f"seen {k + 1} {len(sent) % 3}") for k, sent in enumerate(env.sent[:-1])]
        assert observed == [token for reply in replies for token in reply]
        assert tokenizer.decode(replies[0]).startswith("<s>user: seen 1")


class Faulty(Script):
    """Script, with a fault at turn 1 of the episode whose task is negative (the fault named by `FAULT`)."""

    FAULT = "raise"

    def step(self, action_text):
        if self.turns < 0 and len(self.sent) == 1:
            self.sent.append(action_text)
            if self.FAULT == "raise":
                raise KeyError("no such room")
            if self.FAULT == "hang":
                time.sleep(3)
            if self.FAULT == "non_string":
                return 42, 0.0, False, False, {}
            if self.FAULT == "nan_reward":
                return "ok", float("nan"), False, False, {}
            if self.FAULT == "four_values":
                return "ok", 0.0, False, {}
        turns = abs(self.turns)
        self.sent.append(action_text)
        return f"seen {len(self.sent)}", 1.0, len(self.sent) >= turns, False, {}


@pytest.mark.parametrize("fault,kind,options", [("raise", "errors", {}), ("hang", "timeouts", {"step_timeout": 0.3})])
def test_a_step_that_raises_or_hangs_ends_its_episode_truncated_or_stops_the_run(policy, monkeypatch, fault, kind,
                                                                                 options):
    monkeypatch.setattr(Faulty, "FAULT", fault)
    started = time.perf_counter()
    rollout, _ = _run(policy, [3, -3, 3], [1, 2, 3], env=Faulty, **options)
    assert rollout.num_turns.tolist() == [3, 2, 3] and rollout.truncated.tolist() == [False, True, False]
    assert rollout.turn_rewards[1].tolist() == [1.0, 0.0, 0.0] and rollout.metrics[f"env/{kind}"] == 1
    assert time.perf_counter() - started < 3  # a hung step is abandoned at its time limit
    with pytest.raises(MarlhfError, match=r"^environment 'Faulty' at turn 1 of episode 1: step failed: "):
        _run(policy, [3, -3], [1, 2], env=Faulty, env_errors="raise", **options)


@pytest.mark.parametrize("fault,message", [
    ("non_string", r"^environment 'Faulty' at turn 1 of episode 1: the observation is a int, not text"),
    ("nan_reward", r"^environment 'Faulty' at turn 1 of episode 1: the reward nan is not a finite number$"),
    ("four_values",
     r"^environment 'Faulty' at turn 1 of episode 1: step returned tuple \('ok', 0.0, False, \{\}\), not \(observ"),
])
def test_an_environment_that_breaks_the_protocol_stops_the_run_in_one_line(policy, monkeypatch, fault, message):
    monkeypatch.setattr(Faulty, "FAULT", fault)
    with pytest.raises(MarlhfError, match=message) as error:
        _run(policy, [3, -3], [1, 2], env=Faulty)
    assert "\n" not in str(error.value)


def test_a_reset_that_raises_or_a_prompt_that_leaves_no_room_stops_the_run(policy):
    class BadReset(Script):
        def reset(self, seed, task=None):
            raise OSError("server down")

    with pytest.raises(MarlhfError,
                       match=r"^environment 'BadReset' at turn 0 of episode 0: reset raised OSError: server down$"):
        _run(policy, [2], [0], env=BadReset)
    with pytest.raises(MarlhfError, match="leaves no room in max_length 5"):
        rollout_episodes([Script()], _sampler(policy), TOKENIZER, seeds=[0], max_length=5)
    with pytest.raises(ValueError, match="as many seeds"):
        rollout_episodes([Script()], _sampler(policy), TOKENIZER, seeds=[0, 1])


def test_options_are_checked():
    with pytest.raises(ValueError, match="'max_turns' must be >= 1"):
        MultiTurnOptions(max_turns=0)
    with pytest.raises(ValueError, match="'env_errors' must be"):
        MultiTurnOptions(env_errors="ignore")
