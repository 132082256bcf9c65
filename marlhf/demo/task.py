"""The demo's synthetic task: a tiny language whose words span several tokens, with a known gold reward.

Words are 2-4 syllables long (a syllable is a consonant and a vowel). Every word of the lexicon belongs
to one of three classes, assigned at random, so no single syllable (and no single token) tells the class:
"bright" words score +1, "plain" words 0, "dark" words -1. Strings outside the lexicon score -1 too.

gold reward of a response = (1/W) * sum over its first W words of the word scores, with W = `num_words`
(20 by default) and a bright word scoring 0 after its second use (so repeating one word does not pay).
Missing words score 0, so short responses lose. The reward comes only at the end of a response of about 60 tokens
and depends on whole words scattered all over it: that is the credit assignment problem of RLHF in
miniature.

A second gold reward, `gold="ordered_copy"` (the credit-assignment study's Task 2), is not a sum of per-word
scores: the response should repeat the prompt's words in the prompt's order, and

gold reward = LCS(prompt words, first W response words) / (number of prompt words), in [0, 1],

the length of the longest common subsequence. Whether a word earns credit depends on which prompt words the
response has matched before it, so a critic cannot score words one by one.

A third gold reward, `gold="alternation"`, is not a sum of per-word scores either, but needs no copying: the
response should alternate bright and plain words. Over its first W word slots,

gold reward = (1/W) * sum of: +1 for a bright or plain word whose class differs from the previous word's (the
first word counts as a change), 0 for a bright or plain word of the previous word's class or used for the third
time or more, -1 for a dark word or a string that is not a word, 0 for a missing word; in [-1, 1].

So "bright plain bright plain" scores 4/W and "bright bright plain plain", the same words, 2/W: a word's credit
depends on its neighbour. 20 bright words, the optimum of `word_scores`, score 1/W here.

A fourth gold reward, `gold="decision"` (Task 4), is decided by a few words: the clue is the prompt's last word
(before the separator; prompts draw it from `clue_words` words of the lexicon, 4 by default), the marker is the
one-syllable word `so` (never a lexicon word nor a misspelling, which have 2-4 syllables), and over the first W
words of the response

gold reward = (number of the first 3 markers whose next word is the clue) / 3, in [0, 1].

Every other word is filler and does not change the reward; a missing marker, or a marker in the last word slot,
is a decision lost.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Literal

CONSONANTS = "klmnrstv"
VOWELS = "ao"
SYLLABLES = tuple(c + v for c in CONSONANTS for v in VOWELS)
CLASSES = ("bright", "plain", "dark")
CLASS_SCORES = {"bright": 1.0, "plain": 0.0, "dark": -1.0}
INVALID_SCORE = -1.0
SEPARATOR = "|"  # ends every prompt; a word of its own for the tokenizer
MAX_BRIGHT_USES = 2  # a bright word scores only on its first uses (alternation: a bright or plain word)
GOLD_REWARDS = ("word_scores", "ordered_copy", "alternation", "decision")
ALTERNATING = ("bright", "plain")  # alternation: the classes whose changes pay
MARKER = "so"  # decision: one syllable, so neither a lexicon word nor a misspelling (both have 2-4)
DECISIONS = 3  # decision: the words after the first DECISIONS markers are all the gold reward reads


@dataclass(frozen=True)
class TaskConfig:
    """Shape of the synthetic task. The defaults are what `marlhf demo` uses."""

    words_per_class: int = 16
    prompt_words: int = 8
    num_words: int = 20  # W: response length of demonstrations and number of words the gold reward reads
    typo_rate: float = 0.05  # share of invalid words in SFT demonstrations
    preference_temperature: float = 0.1  # Bradley-Terry noise of the gold labeller
    seed: int = 1234
    gold: Literal["word_scores", "ordered_copy", "alternation", "decision"] = "word_scores"  # (module docstring)
    copy_rate: float = 0.35  # ordered_copy: share of the prompt's words an SFT demonstration repeats
    alternation_rate: float = 0.1  # alternation: chance an SFT demonstration's next word switches bright <-> plain
    decision_rate: float = 0.3  # decision: chance an SFT demonstration's word after a marker is the clue
    clue_words: int | None = 4  # decision: prompts end with one of this many words (None: any word of the lexicon)


class SyntheticTask:
    """Lexicon, gold reward and data generators of the demo. Everything is a pure function of `config.seed`."""

    def __init__(self, config: TaskConfig | None = None):
        self.config = config or TaskConfig()
        if self.config.words_per_class < MAX_BRIGHT_USES or self.config.num_words < 1:
            raise ValueError("config: words_per_class must be >= 2 and num_words >= 1")
        if self.config.gold not in GOLD_REWARDS:
            raise ValueError(f"config: gold must be one of {GOLD_REWARDS}, got {self.config.gold!r}")
        if self.config.gold == "decision" and self.config.num_words < 2 * DECISIONS:
            raise ValueError(f"config: gold='decision' needs num_words >= {2 * DECISIONS} (a marker and a word for "
                             f"each of {DECISIONS} decisions), got {self.config.num_words}")
        if not 0.0 <= self.config.decision_rate <= 1.0:
            raise ValueError(f"config: decision_rate must be in [0, 1], got {self.config.decision_rate}")
        if self.config.clue_words is not None and not 1 <= self.config.clue_words <= 3 * self.config.words_per_class:
            raise ValueError(f"config: clue_words must be None or 1 to {3 * self.config.words_per_class}, got "
                             f"{self.config.clue_words}")
        rng = random.Random(self.config.seed)
        num_words = self.config.words_per_class * len(CLASSES)
        words: set[str] = set()
        while len(words) < num_words:
            words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3, 3, 4)))))
        shuffled = sorted(words)
        rng.shuffle(shuffled)
        k = self.config.words_per_class
        self.words_by_class = {c: tuple(sorted(shuffled[i * k : (i + 1) * k])) for i, c in enumerate(CLASSES)}
        self.word_class = {w: c for c, ws in self.words_by_class.items() for w in ws}
        # decision: the words a prompt may end with, so the clue that decides the response
        clues = self.config.clue_words or len(self.word_class)
        self.clue_words = tuple(random.Random(f"clues-{self.config.seed}").sample(sorted(self.word_class), clues))

    # ---------------------------------------------------------------- gold reward
    def word_scores(self, response: str) -> list[float]:
        """Score of each of the first `num_words` words of `response` (whitespace separated)."""
        scores = []
        uses: Counter[str] = Counter()
        for word in response.split()[: self.config.num_words]:
            word_class = self.word_class.get(word)
            if word_class is None:
                scores.append(INVALID_SCORE)
                continue
            uses[word] += 1
            if word_class == "bright" and uses[word] > MAX_BRIGHT_USES:
                scores.append(0.0)
            else:
                scores.append(CLASS_SCORES[word_class])
        return scores

    def alternation_scores(self, response: str) -> list[float]:
        """alternation: score of each of the first `num_words` words of `response`, given the word before it."""
        scores = []
        uses: Counter[str] = Counter()
        previous = None  # class of the previous word (None: none yet, or not a word)
        for word in response.split()[: self.config.num_words]:
            word_class = self.word_class.get(word)
            if word_class not in ALTERNATING:
                scores.append(INVALID_SCORE)
            else:
                uses[word] += 1
                scores.append(1.0 if word_class != previous and uses[word] <= MAX_BRIGHT_USES else 0.0)
            previous = word_class
        return scores

    def decision_words(self, response: str) -> list[str]:
        """decision: the word after each of the first DECISIONS markers among the first `num_words` words (a marker
        in the last slot has none; in `so so w` the first marker's word is the second marker)."""
        words = response.split()[: self.config.num_words]
        return [words[i + 1] for i in range(len(words) - 1) if words[i] == MARKER][:DECISIONS]

    def gold_reward(self, response: str, prompt: str | None = None) -> float:
        """word_scores: in [-1, 1], 1 means `num_words` bright words, none used more than twice.
        ordered_copy: in [0, 1], 1 means the prompt's words all appear in order (needs `prompt`).
        alternation: in [-1, 1], 1 means `num_words` words alternating bright and plain, none used more than twice.
        decision: in [0, 1], the share of the first DECISIONS markers (`so`) among the first `num_words` words that
        are followed by the clue, the prompt's last word (needs `prompt`); a missing marker counts as a wrong
        decision and every other word is filler that does not change the reward."""
        if self.config.gold == "word_scores":
            return sum(self.word_scores(response)) / self.config.num_words
        if self.config.gold == "alternation":
            return sum(self.alternation_scores(response)) / self.config.num_words
        if prompt is None:
            raise ValueError(f"the {self.config.gold} gold reward needs the prompt")
        if self.config.gold == "decision":
            clue = decision_clue(prompt)
            return sum(word == clue for word in self.decision_words(response)) / DECISIONS
        target = prompt_words(prompt)
        return longest_common_subsequence(target, response.split()[: self.config.num_words]) / max(len(target), 1)

    def gold_rewards(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Batch form, with the (prompt, response) signature of an external reward function."""
        if len(prompts) != len(responses):
            raise ValueError(f"prompts and responses differ in length: {len(prompts)} != {len(responses)}")
        return [self.gold_reward(r, p) for p, r in zip(prompts, responses)]

    # ---------------------------------------------------------------- generators
    def _invalid_word(self, rng: random.Random) -> str:
        while True:
            word = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3, 4))))
            if word not in self.word_class:
                return word

    def _words(self, rng: random.Random, n: int, class_probs: dict[str, float], typo_rate: float) -> list[str]:
        out = []
        for _ in range(n):
            if rng.random() < typo_rate:
                out.append(self._invalid_word(rng))
            else:
                word_class = rng.choices(CLASSES, weights=[class_probs[c] for c in CLASSES])[0]
                out.append(rng.choice(self.words_by_class[word_class]))
        return out

    def _alternating_words(self, rng: random.Random, n: int, class_probs: dict[str, float], typo_rate: float,
                           alternation_rate: float) -> list[str]:
        """alternation: as `_words`, but after a bright (plain) word the next word is plain (bright) with chance
        `alternation_rate`, else of a class drawn from `class_probs`."""
        out, previous = [], None
        for _ in range(n):
            if rng.random() < typo_rate:
                out.append(self._invalid_word(rng))
                previous = None
                continue
            if previous in ALTERNATING and rng.random() < alternation_rate:
                word_class = ALTERNATING[1 - ALTERNATING.index(previous)]
            else:
                word_class = rng.choices(CLASSES, weights=[class_probs[c] for c in CLASSES])[0]
            out.append(rng.choice(self.words_by_class[word_class]))
            previous = word_class
        return out

    def _prompt(self, rng: random.Random) -> tuple[str, dict[str, float]]:
        """A prompt and its class mix (a Dirichlet draw, so prompts lean towards different classes)."""
        draws = [rng.gammavariate(1.0, 1.0) for _ in CLASSES]
        mix = {c: d / sum(draws) for c, d in zip(CLASSES, draws)}
        words = self._words(rng, self.config.prompt_words, mix, 0.0)
        if self.config.gold == "decision" and self.config.clue_words is not None:
            words[-1] = rng.choice(self.clue_words)  # the clue
        return " ".join(words) + " " + SEPARATOR, mix

    def _demonstration_mix(self, prompt_mix: dict[str, float]) -> dict[str, float]:
        # The demonstrator half follows the prompt's mix, half a fixed mediocre one: imperfect on purpose.
        base = {"bright": 0.4, "plain": 0.35, "dark": 0.25}
        return {c: 0.5 * prompt_mix[c] + 0.5 * base[c] for c in CLASSES}

    def prompts(self, n: int, seed: int) -> list[dict]:
        """`n` RL / evaluation records {"prompt"}; different seeds give disjoint-in-practice prompt sets."""
        rng = random.Random(f"prompts-{self.config.seed}-{seed}")
        return [{"prompt": self._prompt(rng)[0]} for _ in range(n)]

    def pretraining_texts(self, n: int, seed: int) -> list[str]:
        """Prompt and response joined, responses drawn with uniform class mix and no typos (decision: with
        DECISIONS markers, each followed by a uniformly drawn word, so the clue only by chance)."""
        rng = random.Random(f"pretrain-{self.config.seed}-{seed}")
        uniform = {c: 1 / len(CLASSES) for c in CLASSES}
        texts = []
        for _ in range(n):
            prompt, _ = self._prompt(rng)
            if self.config.gold == "decision":
                words = self._decision_response(rng, prompt, self.config.num_words, DECISIONS, 0.0, 0.0)
            else:
                words = self._words(rng, self.config.num_words, uniform, 0.0)
            texts.append(prompt + " " + " ".join(words))
        return texts

    def _decision_response(self, rng: random.Random, prompt: str, length: int, markers: int, decision_rate: float,
                           typo_rate: float, distractor_rate: float = 0.0) -> list[str]:
        """decision: `length` words, `markers` of them markers at random slots, each followed by the clue with chance
        `decision_rate`, else by another of the prompt's words with chance `distractor_rate`, else by a word drawn
        uniformly from the lexicon (the clue too); the rest uniformly drawn filler (`typo_rate` misspelt)."""
        clue, others = decision_clue(prompt), prompt_words(prompt)[:-1]
        lexicon = sorted(self.word_class)
        units = length - markers  # a marker and its word form one unit; blocks are the units that hold one
        blocks = set(rng.sample(range(units), markers))
        filler = iter(self._words(rng, units - markers, {c: 1 / len(CLASSES) for c in CLASSES}, typo_rate))
        words = []
        for unit in range(units):
            if unit not in blocks:
                words.append(next(filler))
            elif rng.random() < decision_rate:
                words += [MARKER, clue]
            else:
                words += [MARKER, rng.choice(others if others and rng.random() < distractor_rate else lexicon)]
        return words

    def _copy_response(self, rng: random.Random, prompt: str, length: int, copy_rate: float,
                       typo_rate: float) -> list[str]:
        """ordered_copy: `length` words that repeat a `copy_rate` share of the prompt's words in order, at random
        slots among uniformly drawn filler words."""
        kept = [w for w in prompt_words(prompt) if rng.random() < copy_rate][:length]
        slots = sorted(rng.sample(range(length), len(kept)))
        uniform = {c: 1 / len(CLASSES) for c in CLASSES}
        words = self._words(rng, length, uniform, typo_rate)
        for slot, word in zip(slots, kept):
            words[slot] = word
        return words

    def sft_records(self, n: int, seed: int) -> list[dict]:
        """Imperfect demonstrations {"prompt", "response"}: mean gold reward about 0.1 (word_scores), 0.4
        (ordered_copy), 0.15 (alternation) or `decision_rate` + (1 - `decision_rate`) / 48 (decision)."""
        rng = random.Random(f"sft-{self.config.seed}-{seed}")
        records = []
        for _ in range(n):
            prompt, mix = self._prompt(rng)
            if self.config.gold == "ordered_copy":
                words = self._copy_response(rng, prompt, self.config.num_words, self.config.copy_rate,
                                            self.config.typo_rate)
            elif self.config.gold == "alternation":
                words = self._alternating_words(rng, self.config.num_words, self._demonstration_mix(mix),
                                                self.config.typo_rate, self.config.alternation_rate)
            elif self.config.gold == "decision":
                words = self._decision_response(rng, prompt, self.config.num_words, DECISIONS,
                                                self.config.decision_rate, self.config.typo_rate)
            else:
                words = self._words(rng, self.config.num_words, self._demonstration_mix(mix), self.config.typo_rate)
            records.append({"prompt": prompt, "response": " ".join(words)})
        return records

    def preference_records(self, n: int, seed: int) -> list[dict]:
        """Pairs {"prompt", "chosen", "rejected"} labelled by the gold reward with Bradley-Terry noise.

        Each response draws its own class mix, length and vocabulary, so the pairs cover what a policy may
        drift to: the whole gold range, short responses and repeated words (which the gold reward does not pay).
        ordered_copy shuffles some responses, alternation groups some by class: the same words in an order that
        pays less, so the reward model has to learn the order. decision draws 0-4 markers, the rate of right
        decisions, wrong decisions half of the time from the prompt's other words, and for some responses the clue
        in filler slots, so the reward model has to learn which word goes where.
        """
        rng = random.Random(f"preferences-{self.config.seed}-{seed}")
        temperature = self.config.preference_temperature
        records = []
        while len(records) < n:
            prompt, _ = self._prompt(rng)
            pair = []
            for _ in range(2):
                if self.config.gold == "ordered_copy":
                    length = rng.randint(self.config.num_words // 2, self.config.num_words)
                    words = self._copy_response(rng, prompt, length, rng.random(), rng.uniform(0.0, 0.15))
                    if rng.random() < 0.3:  # the right words in a shuffled order: order is what is paid
                        rng.shuffle(words)
                elif self.config.gold == "alternation":
                    draws = [rng.gammavariate(0.7, 1.0) for _ in CLASSES]
                    mix = {c: d / sum(draws) for c, d in zip(CLASSES, draws)}
                    length = rng.randint(self.config.num_words // 2, self.config.num_words)
                    words = self._alternating_words(rng, length, mix, rng.uniform(0.0, 0.15), rng.random())
                    if rng.random() < 0.3:  # the same words grouped by class: as good as before under word_scores
                        rank = {c: rng.random() for c in CLASSES}
                        words.sort(key=lambda w: rank.get(self.word_class.get(w), 1.0))
                elif self.config.gold == "decision":
                    length = rng.randint(self.config.num_words // 2, self.config.num_words)
                    markers = min(rng.randint(0, DECISIONS + 1), length // 2)
                    words = self._decision_response(rng, prompt, length, markers, rng.random(),
                                                    rng.uniform(0.0, 0.15), distractor_rate=0.5)
                    if rng.random() < 0.3:  # the clue in filler slots: only its place after a marker pays
                        for slot in rng.sample(range(length), 3):
                            if words[slot] != MARKER and (slot == 0 or words[slot - 1] != MARKER):
                                words[slot] = decision_clue(prompt)
                else:
                    draws = [rng.gammavariate(0.7, 1.0) for _ in CLASSES]
                    mix = {c: d / sum(draws) for c, d in zip(CLASSES, draws)}
                    length = rng.randint(self.config.num_words // 2, self.config.num_words)
                    words = self._words(rng, length, mix, rng.uniform(0.0, 0.15))
                # a response that keeps repeating a few words (decision: filler, not an exploit of its reward)
                if self.config.gold != "decision" and rng.random() < 0.3:
                    words = [rng.choice(words[:3]) for _ in words]
                pair.append(" ".join(words))
            gap = self.gold_reward(pair[0], prompt) - self.gold_reward(pair[1], prompt)
            if gap == 0.0:
                continue
            first_preferred = rng.random() < 1.0 / (1.0 + math.exp(-gap / temperature))
            chosen, rejected = pair if first_preferred else pair[::-1]
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        return records


def prompt_words(prompt: str) -> list[str]:
    """The words of a prompt, without the separator."""
    return [w for w in prompt.split() if w != SEPARATOR]


def decision_clue(prompt: str) -> str | None:
    """decision: the prompt's last word (before the separator), the word each marker should be followed by."""
    words = prompt_words(prompt)
    return words[-1] if words else None


def longest_common_subsequence(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two word lists (dynamic programming, O(len(a) len(b)))."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]
