"""The demo task: gold reward, data generators, tokenizer."""

from __future__ import annotations

import pytest

from marlhf.demo.task import CLASSES, SEPARATOR, SYLLABLES, SyntheticTask, TaskConfig
from marlhf.demo.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def task():
    return SyntheticTask()


@pytest.fixture(scope="module")
def tokenizer(task):
    return train_tokenizer(task.pretraining_texts(2000, seed=0))


def reference_gold(task: SyntheticTask, response: str) -> float:
    """Word by word, as the README states the rule."""
    total, uses = 0.0, {}
    for word in response.split()[: task.config.num_words]:
        if word in task.words_by_class["bright"]:
            uses[word] = uses.get(word, 0) + 1
            total += 1.0 if uses[word] <= 2 else 0.0
        elif word in task.words_by_class["dark"] or word not in task.word_class:
            total -= 1.0
    return total / task.config.num_words


def test_lexicon_classes_are_disjoint_and_not_given_by_one_syllable(task):
    words = [w for c in CLASSES for w in task.words_by_class[c]]
    assert len(words) == len(set(words)) == 3 * task.config.words_per_class
    for word in words:
        pieces = [word[i:i + 2] for i in range(0, len(word), 2)]
        assert 2 <= len(pieces) <= 4 and all(p in SYLLABLES for p in pieces)
    # No first or last syllable tells the class: some syllable starts (and ends) words of every class.
    for position in (0, -2):
        classes_by_syllable = {}
        for word in words:
            classes_by_syllable.setdefault(word[position:][:2], set()).add(task.word_class[word])
        assert max(len(c) for c in classes_by_syllable.values()) == 3


def test_gold_reward_hand_computed(task):
    bright, plain, dark = (task.words_by_class[c] for c in CLASSES)
    w = task.config.num_words
    assert task.gold_reward(" ".join(bright[i % 16] for i in range(w))) == 1.0  # 16 words, none used thrice
    assert task.gold_reward(" ".join([bright[0]] * 4)) == 2 / w  # third and fourth uses score 0
    assert task.gold_reward(f"{plain[0]} {dark[0]} zzzz {bright[1]}") == (0 - 1 - 1 + 1) / w
    assert task.gold_reward("") == 0.0  # missing words score 0
    assert task.gold_reward(" ".join([dark[0]] * w + [bright[0]] * 5)) == -1.0  # words beyond W are not read


def test_gold_reward_matches_reference_on_generated_text(task):
    records = task.sft_records(300, seed=3) + task.sft_records(50, seed=4)
    for record in records:
        response = record["response"]
        truncated = " ".join(response.split()[:7])
        for text in (response, truncated, response + " " + response):
            assert task.gold_reward(text) == pytest.approx(reference_gold(task, text))


def test_gold_rewards_checks_lengths(task):
    with pytest.raises(ValueError, match="prompts and responses"):
        task.gold_rewards(["a"], [])


def test_generators_are_deterministic_and_seeded(task):
    assert task.sft_records(5, seed=1) == SyntheticTask().sft_records(5, seed=1)
    assert task.sft_records(5, seed=1) != task.sft_records(5, seed=2)
    assert task.prompts(50, seed=1) != task.prompts(50, seed=2)
    assert SyntheticTask(TaskConfig(seed=7)).word_class != task.word_class


def test_prompts_and_demonstrations_have_the_task_shape(task):
    for record in task.sft_records(50, seed=0):
        assert record["prompt"].endswith(" " + SEPARATOR)
        assert len(record["prompt"].split()) == task.config.prompt_words + 1
        assert len(record["response"].split()) == task.config.num_words
    words = [w for r in task.sft_records(400, seed=0) for w in r["response"].split()]
    typo_share = sum(w not in task.word_class for w in words) / len(words)
    assert typo_share == pytest.approx(task.config.typo_rate, abs=0.015)


def test_demonstrations_are_imperfect(task):
    gold = [task.gold_reward(r["response"]) for r in task.sft_records(500, seed=0)]
    mean = sum(gold) / len(gold)
    assert -0.2 < mean < 0.3  # far from the optimum of 1: there is something to learn
    assert max(gold) < 1.0


def test_preferences_follow_gold_with_noise(task):
    records = task.preference_records(1000, seed=0)
    agree = [task.gold_reward(r["chosen"]) > task.gold_reward(r["rejected"]) for r in records]
    assert all(r["chosen"] != r["rejected"] for r in records)
    assert 0.8 < sum(agree) / len(agree) < 1.0  # mostly right, sometimes flipped
    spread = [task.gold_reward(r["chosen"]) for r in records]
    assert min(spread) < -0.3 and max(spread) > 0.6  # pairs cover the range the policy may reach


def test_tokenizer_splits_words_and_round_trips(task, tokenizer):
    records = task.sft_records(100, seed=5)
    lengths = [len(tokenizer(r["response"])["input_ids"]) for r in records]
    words = sum(len(r["response"].split()) for r in records)
    assert min(lengths) >= 48  # long responses: the credit assignment problem
    assert sum(lengths) / words >= 2.0  # words span several tokens on average
    for record in records[:20]:
        joined = record["prompt"] + " " + record["response"]
        ids = tokenizer(joined)["input_ids"]
        assert ids == tokenizer(record["prompt"])["input_ids"] + tokenizer(record["response"])["input_ids"]
        assert tokenizer.decode(ids) == joined
        assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == joined
    assert tokenizer.unk_token_id not in tokenizer(" ".join(task.word_class))["input_ids"]


def test_tokenizer_ids_do_not_depend_on_hash_order(tokenizer):
    # Single characters come first, in sorted order, then the merges in the order they were learned.
    vocab = {t: i for t, i in tokenizer.get_vocab().items() if t not in tokenizer.all_special_tokens}
    characters = [t for t in vocab if len(t.removeprefix("##")) == 1]
    assert sorted(characters, key=vocab.get) == sorted(characters)
    assert max(vocab[t] for t in characters) < min(vocab[t] for t in vocab if len(t.removeprefix("##")) > 1)


def test_tokenizer_rejects_empty_corpus():
    with pytest.raises(ValueError, match="texts"):
        train_tokenizer([])


def lcs_reference(a: list[str], b: list[str]) -> int:
    """Brute force over the subsequences of the shorter list (small inputs only)."""
    import itertools

    short, long_ = (a, b) if len(a) <= len(b) else (b, a)
    for size in range(len(short), 0, -1):
        for picked in itertools.combinations(short, size):
            it = iter(long_)
            if all(any(x == y for y in it) for x in picked):
                return size
    return 0


def test_longest_common_subsequence_matches_brute_force():
    import random

    from marlhf.demo.task import longest_common_subsequence

    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 7))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 9))]
        assert longest_common_subsequence(a, b) == lcs_reference(a, b), (a, b)


def test_ordered_copy_gold_reward_and_data():
    from marlhf.demo.task import prompt_words

    task = SyntheticTask(TaskConfig(gold="ordered_copy"))
    prompt = task.prompts(1, seed=0)[0]["prompt"]
    target = prompt_words(prompt)
    assert len(target) == task.config.prompt_words and SEPARATOR not in target
    assert task.gold_reward(" ".join(target), prompt) == 1.0
    backwards = target[::-1]  # the right words in the wrong order: only the LCS is paid
    assert task.gold_reward(" ".join(backwards), prompt) == lcs_reference(target, backwards) / len(target) < 1.0
    assert task.gold_reward(" ".join(target[:4]), prompt) == 0.5
    filler = " ".join(task.words_by_class["plain"][:5])
    assert task.gold_reward(filler + " " + " ".join(target), prompt) == (20 - 5 >= 8) * 1.0  # within 20 words
    assert task.gold_reward(" ".join(["kaka"] * 19 + target), prompt) == 1 / len(target)  # words past W unread
    with pytest.raises(ValueError, match="prompt"):
        task.gold_reward(" ".join(target))
    records = task.sft_records(400, seed=0)
    gold = [task.gold_reward(r["response"], r["prompt"]) for r in records]
    assert 0.3 < sum(gold) / len(gold) < 0.55 and max(gold) < 1.0  # imperfect demonstrations
    assert all(len(r["response"].split()) == task.config.num_words for r in records)
    pairs = task.preference_records(500, seed=0)
    agree = [task.gold_reward(p["chosen"], p["prompt"]) > task.gold_reward(p["rejected"], p["prompt"]) for p in pairs]
    assert 0.8 < sum(agree) / len(agree) < 1.0
    # The default task's data do not change with the new option (same draws as before it existed).
    assert SyntheticTask().gold_rewards(["p"], ["x"]) == [SyntheticTask().gold_reward("x")]
    with pytest.raises(ValueError, match="gold"):
        SyntheticTask(TaskConfig(gold="lcs"))


@pytest.fixture(scope="module")
def alternation():
    return SyntheticTask(TaskConfig(gold="alternation"))


def alternation_reference(task: SyntheticTask, response: str) -> float:
    """Pair by pair, as the README states the rule."""
    total, uses, previous = 0.0, {}, None
    for word in response.split()[: task.config.num_words]:
        word_class = task.word_class.get(word)
        if word_class in ("bright", "plain"):
            uses[word] = uses.get(word, 0) + 1
            total += 1.0 if word_class != previous and uses[word] <= 2 else 0.0
        else:
            total -= 1.0
        previous = word_class
    return total / task.config.num_words


def test_alternation_gold_reward_hand_computed(alternation):
    task = alternation
    bright, plain, dark = (task.words_by_class[c] for c in CLASSES)
    w = task.config.num_words
    b, p = bright[0], plain[0]
    # The same words in two orders: a word's credit depends on its neighbour, so no per-word score sums to both.
    assert task.gold_reward(f"{b} {p} {bright[1]} {plain[1]}") == 4 / w
    assert task.gold_reward(f"{b} {bright[1]} {p} {plain[1]}") == 2 / w
    assert task.gold_reward(" ".join(bright[i % 16] for i in range(w))) == 1 / w  # word_scores' optimum: 1/W here
    assert SyntheticTask().gold_reward(" ".join(bright[i % 16] for i in range(w))) == 1.0
    optimum = " ".join((bright if i % 2 == 0 else plain)[i // 2 % 16] for i in range(w))
    assert task.gold_reward(optimum) == 1.0
    assert task.gold_reward(" ".join([b, p] * 3)) == 4 / w  # third uses of a word score 0
    assert task.gold_reward(f"{b} {dark[0]} {b}") == (1 - 1 + 1) / w  # after a dark word: a change of class
    assert task.gold_reward(f"{p} zzzz {p}") == (1 - 1 + 1) / w  # a string that is not a word: -1, no class
    assert task.gold_reward("") == 0.0  # missing words score 0
    assert task.gold_reward(b) == 1 / w  # fewer than W words
    assert task.gold_reward(" ".join([dark[0]] * w + [b, p])) == -1.0  # words beyond W are not read
    assert task.gold_rewards(["p"], [b]) == [1 / w]  # the prompt is not read


def test_alternation_gold_matches_reference_on_generated_text(alternation):
    records = alternation.sft_records(200, seed=3)
    pairs = alternation.preference_records(200, seed=3)
    for text in [r["response"] for r in records] + [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]:
        for variant in (text, " ".join(text.split()[:7]), text + " " + text):
            assert alternation.gold_reward(variant) == pytest.approx(alternation_reference(alternation, variant))


def test_alternation_demonstrations_and_preferences():
    task = SyntheticTask(TaskConfig(gold="alternation"))
    records = task.sft_records(400, seed=0)
    assert records == SyntheticTask(TaskConfig(gold="alternation")).sft_records(400, seed=0)
    assert records != task.sft_records(400, seed=1)
    assert all(set(r) == {"prompt", "response"} and r["prompt"].endswith(" " + SEPARATOR) for r in records)
    assert all(len(r["response"].split()) == task.config.num_words for r in records)
    gold = [task.gold_reward(r["response"]) for r in records]
    assert 0.05 < sum(gold) / len(gold) < 0.25 and max(gold) < 1.0  # imperfect demonstrations
    words = [w for r in records for w in r["response"].split()]
    assert sum(w not in task.word_class for w in words) / len(words) == pytest.approx(task.config.typo_rate, abs=0.015)
    # alternation_rate makes demonstrations closer to the rule
    closer = SyntheticTask(TaskConfig(gold="alternation", alternation_rate=0.5)).sft_records(400, seed=0)
    assert sum(task.gold_reward(r["response"]) for r in closer) / len(closer) > sum(gold) / len(gold) + 0.1

    pairs = task.preference_records(1000, seed=0)
    assert pairs == task.preference_records(1000, seed=0)
    assert all(set(p) == {"prompt", "chosen", "rejected"} and p["chosen"] != p["rejected"] for p in pairs)
    agree = [task.gold_reward(p["chosen"]) > task.gold_reward(p["rejected"]) for p in pairs]
    assert 0.8 < sum(agree) / len(agree) < 1.0  # the same Bradley-Terry noise as the other tasks
    additive = SyntheticTask()  # word_scores on the same lexicon
    agree_additive = [additive.gold_reward(p["chosen"]) > additive.gold_reward(p["rejected"]) for p in pairs]
    assert sum(agree_additive) < sum(agree) - 50  # the labels are not word_scores': order matters
    # Responses good under word_scores and bad here are there (mostly bright, or grouped by class).
    assert any(additive.gold_reward(r) > 0.4 and task.gold_reward(r) < 0.2 for p in pairs
               for r in (p["chosen"], p["rejected"]))
    spread = [task.gold_reward(p["chosen"]) for p in pairs]
    assert min(spread) < -0.3 and max(spread) > 0.6
    # The other tasks' data do not change with the new option.
    assert SyntheticTask().sft_records(3, seed=0) == SyntheticTask(TaskConfig(alternation_rate=0.7)).sft_records(
        3, seed=0)
