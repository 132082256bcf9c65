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


@pytest.fixture(scope="module")
def decision():
    return SyntheticTask(TaskConfig(gold="decision"))


def decision_reference(task: SyntheticTask, response: str, prompt: str) -> float:
    """Slot by slot, as the README states the rule: the first 3 markers among the first W words, each right when
    the next slot (also among the first W) holds the prompt's last word."""
    clue = [w for w in prompt.split() if w != SEPARATOR][-1]
    words = response.split()[: task.config.num_words]
    right = markers = 0
    for slot, word in enumerate(words):
        if word == "so" and slot + 1 < len(words) and markers < 3:
            markers += 1
            right += words[slot + 1] == clue
    return right / 3


def check_decision_rule(task: SyntheticTask, gold) -> None:
    """Hand-built responses against `gold(response, prompt)`: passes for the rule, fails for a wrong one."""
    prompt = task.prompts(1, seed=0)[0]["prompt"]
    words = prompt.split()[:-1]
    clue, other = words[-1], next(w for w in words if w != words[-1])
    filler = [w for w in task.words_by_class["plain"] if w not in words][:14]
    w = task.config.num_words

    def response(decisions: list[str], fill: list[str] = filler) -> str:
        # filler, then "so <decision>" blocks spread over the 20 slots
        out, fill = [], iter(fill)
        for d in decisions:
            out += [next(fill), next(fill), "so", d]
        return " ".join(out + list(fill))

    assert len(response([clue] * 3).split()) == w
    assert gold(response([clue] * 3), prompt) == 1.0  # every decision right
    assert gold(response([clue, other, clue]), prompt) == pytest.approx(2 / 3)  # a prompt word, not the clue
    assert gold(response([other] * 3), prompt) == 0.0
    assert gold(response([clue, clue]), prompt) == pytest.approx(2 / 3)  # a missing marker loses its decision
    assert gold(" ".join(filler + [clue] * 6), prompt) == 0.0  # the clue without markers earns nothing
    assert gold(response([clue, "zzzz", "sa"]), prompt) == pytest.approx(1 / 3)  # non-words after a marker: wrong
    # Filler does not change the reward: other words, non-words, dark words, the clue itself in filler slots.
    for fill in (filler[::-1], ["kakakaka"] * 14, list(task.words_by_class["dark"][:14]), [clue] * 14):
        assert gold(response([clue, other, clue], fill), prompt) == pytest.approx(2 / 3)
    assert gold(response([clue] * 3) + " so " + other, prompt) == 1.0  # a 4th marker (and words past W) unread
    assert gold(f"so {other} " + response([clue] * 3), prompt) == pytest.approx(2 / 3)  # only the first 3 markers
    assert gold(" ".join(filler[:13] + ["so", clue] * 3 + ["x", "so"]), prompt) == 1.0
    assert gold(f"so so {clue} so {clue}", prompt) == pytest.approx(2 / 3)  # "so so": the first one's word is "so"
    past_w = " ".join(filler[:14] + ["so", clue] * 2 + ["x", "so", clue])  # the last marker's word is slot W + 1
    assert gold(past_w, prompt) == pytest.approx(2 / 3)
    assert gold("", prompt) == 0.0


def test_decision_gold_reward_hand_computed(decision):
    check_decision_rule(decision, decision.gold_reward)
    check_decision_rule(decision, lambda response, prompt: decision_reference(decision, response, prompt))


@pytest.mark.parametrize("wrong_rule", ["first_prompt_word", "clue_anywhere", "every_marker", "reads_past_w"])
def test_decision_rule_check_fails_for_a_wrong_rule(decision, wrong_rule):
    task = decision

    def wrong(response: str, prompt: str) -> float:
        words = prompt.split()[:-1]
        clue = words[0] if wrong_rule == "first_prompt_word" else words[-1]
        read = response.split()[: None if wrong_rule == "reads_past_w" else task.config.num_words]
        if wrong_rule == "clue_anywhere":
            return min(read.count(clue), 3) / 3
        after = [read[i + 1] for i in range(len(read) - 1) if read[i] == "so"]
        return sum(word == clue for word in (after if wrong_rule == "every_marker" else after[:3])) / 3

    with pytest.raises(AssertionError):
        check_decision_rule(task, wrong)


def test_decision_gold_reward_range_determinism_and_reference(decision):
    records = decision.sft_records(300, seed=3)
    pairs = decision.preference_records(300, seed=3)
    texts = [(r["response"], r["prompt"]) for r in records]
    texts += [(p[key], p["prompt"]) for p in pairs for key in ("chosen", "rejected")]
    for response, prompt in texts:
        for variant in (response, " ".join(response.split()[:7]), response + " " + response):
            gold = decision.gold_reward(variant, prompt)
            assert gold in (0.0, 1 / 3, 2 / 3, 1.0)
            assert gold == pytest.approx(decision_reference(decision, variant, prompt))
            assert SyntheticTask(TaskConfig(gold="decision")).gold_reward(variant, prompt) == gold
    with pytest.raises(ValueError, match="prompt"):
        decision.gold_reward(records[0]["response"])
    assert decision.gold_reward("so kaka", SEPARATOR) == 0.0  # a prompt without words: no clue
    assert decision.gold_rewards([records[0]["prompt"]], [records[0]["response"]]) == [
        decision.gold_reward(records[0]["response"], records[0]["prompt"])]


def test_decision_config_is_checked():
    with pytest.raises(ValueError, match="decision_rate"):
        SyntheticTask(TaskConfig(gold="decision", decision_rate=1.5))
    with pytest.raises(ValueError, match="clue_words"):
        SyntheticTask(TaskConfig(gold="decision", clue_words=0))
    with pytest.raises(ValueError, match="num_words"):
        SyntheticTask(TaskConfig(gold="decision", num_words=5))
    from marlhf.demo.config import DemoConfig

    with pytest.raises(ValueError, match="decision_rate"):
        DemoConfig(gold="decision", decision_rate=-0.1)


def test_decision_demonstrations_and_preferences(decision):
    from marlhf.demo.task import decision_clue

    task = decision
    records = task.sft_records(1000, seed=0)
    assert records == SyntheticTask(TaskConfig(gold="decision")).sft_records(1000, seed=0)
    assert records != task.sft_records(1000, seed=1)
    assert all(r["prompt"].endswith(" " + SEPARATOR) and len(r["response"].split()) == task.config.num_words
               for r in records)
    # Exactly 3 markers, never adjacent nor last: each decision is a word; right at decision_rate (+ chance 1/48).
    assert all(r["response"].split().count("so") == 3 and len(task.decision_words(r["response"])) == 3
               and "so" not in task.decision_words(r["response"]) for r in records)
    right = [w == decision_clue(r["prompt"]) for r in records for w in task.decision_words(r["response"])]
    expected = task.config.decision_rate + (1 - task.config.decision_rate) / 48
    assert sum(right) / len(right) == pytest.approx(expected, abs=0.03)
    gold = [task.gold_reward(r["response"], r["prompt"]) for r in records]
    assert sum(gold) / len(gold) == pytest.approx(expected, abs=0.03)  # far from the optimum of 1
    closer = SyntheticTask(TaskConfig(gold="decision", decision_rate=0.8)).sft_records(400, seed=0)
    assert sum(task.gold_reward(r["response"], r["prompt"]) for r in closer) / len(closer) > 0.7
    filler = [w for r in records for w in r["response"].split() if w != "so"]
    assert sum(w not in task.word_class for w in filler) / len(filler) == pytest.approx(
        task.config.typo_rate * 14 / 17, abs=0.015)  # misspellings only in filler, never a decision word
    texts = task.pretraining_texts(500, seed=0)  # markers, but the clue only by chance
    pretrain_right = [w == decision_clue(t[: t.index(SEPARATOR) + 1]) for t in texts
                      for w in task.decision_words(t[t.index(SEPARATOR) + 2:])]
    assert len(pretrain_right) == 1500 and sum(pretrain_right) / 1500 < 0.05

    # Prompts end with one of clue_words words (the clue); with clue_words None, with any word, as Task 1's prompts.
    assert {decision_clue(r["prompt"]) for r in records} == set(task.clue_words)
    assert len(task.clue_words) == task.config.clue_words == 4
    assert SyntheticTask(TaskConfig(gold="decision", clue_words=None)).prompts(50, seed=1) == SyntheticTask().prompts(
        50, seed=1)

    pairs = task.preference_records(1000, seed=0)
    assert pairs == task.preference_records(1000, seed=0)
    assert all(set(p) == {"prompt", "chosen", "rejected"} and p["chosen"] != p["rejected"] for p in pairs)
    agree = [task.gold_reward(p["chosen"], p["prompt"]) > task.gold_reward(p["rejected"], p["prompt"]) for p in pairs]
    assert 0.9 < sum(agree) / len(agree) < 1.0  # the same Bradley-Terry noise; gaps of 1/3 are rarely flipped

    def clue_count(response: str, prompt: str) -> int:
        return response.split()[: task.config.num_words].count(decision_clue(prompt))

    # Counting the clue anywhere agrees less with the labels: its place after a marker is what the pairs teach.
    agree_count = [clue_count(p["chosen"], p["prompt"]) > clue_count(p["rejected"], p["prompt"]) for p in pairs]
    assert sum(agree_count) < sum(agree) - 100
    # The other tasks' data do not change with the new option.
    assert SyntheticTask().sft_records(3, seed=0) == SyntheticTask(TaskConfig(decision_rate=0.9)).sft_records(3, seed=0)
    assert SyntheticTask().pretraining_texts(3, seed=0) == SyntheticTask(
        TaskConfig(decision_rate=0.9)).pretraining_texts(3, seed=0)


def test_decision_marker_is_a_token_of_its_tokenizer(decision):
    tokenizer = train_tokenizer(decision.pretraining_texts(500, seed=0))
    record = decision.sft_records(1, seed=0)[0]
    ids = tokenizer(record["response"])["input_ids"]
    assert tokenizer.decode(ids) == record["response"]
    assert tokenizer.convert_tokens_to_ids("so") in ids  # the marker is one token, so its decision follows it
