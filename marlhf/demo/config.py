"""Options of `marlhf demo` (a light module: the command line builds its parser from it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from marlhf.config import ConfigBase, option
from marlhf.losses import SegmentWeighting
from marlhf.segments import ValueWeighting
from marlhf.termination import TERMINATION_RULES


BaselineMethod = Literal["rloo", "grpo", "reinforce", "dpo"]
GROUP_METHODS = {"rloo", "grpo"}  # baselines over groups of responses to one prompt
SAMPLES_PER_PROMPT = 4  # group size of rloo and grpo
MAX_PROMPT_TOKENS = 48  # prompts are 8 words + separator: about 25 tokens
# what only one task reads (the relay task has its own gold, demonstrations and four methods)
SINGLE_TURN_ONLY = ("num_words", "gold", "decision_rate", "clue_words", "reward", "gold_reward_scale",
                    "preference_records", "dpo_learning_rate", "value_weighting", "segment_weighting", "critic_init")
RELAY_ONLY = ("relay_rate",)


@dataclasses.dataclass(kw_only=True)
class DemoConfig(ConfigBase):
    """Sizes and hyper-parameters of the demo. The defaults fit in 10 minutes on 2 CPU cores."""

    out: str = option("demo_out", "output directory")
    seeds: tuple[int, ...] = option((0, 1), "PPO seeds; every method runs on each")
    terminations: tuple[str, ...] = option(
        (), "extra MA-PPO methods besides ppo (fixed:1) and ma_ppo (fixed:5): fixed:N, fixed:none (the whole response), randomized, "
            "perplexity, word (one macro action per word)")
    methods: tuple[BaselineMethod, ...] = option(
        (), "baselines besides PPO and MA-PPO: rloo, grpo, reinforce (critic-free advantages in the PPO loop), "
            "dpo (DPO on the reward model's preference pairs)")
    task: Literal["single_turn", "relay"] = option(
        "single_turn", "single_turn: one response per prompt, judged by the gold reward `gold`; relay: the multi-turn "
                       "task (marlhf/demo/README.md, 'Multi-turn task: relay'), trained on the environment's rewards "
                       "with turn-level MA-PPO, token-level PPO, GRPO and GiGPO (no reward model)")
    relay_rate: float = option(0.3, "task=relay: chance a demonstrated turn starts with the right word", ge=0, le=1)
    task_seed: int = option(1234, "seed of the lexicon and of every data set")
    num_words: int = option(20, "words per demonstration, and words the gold reward reads", ge=1)
    gold: Literal["word_scores", "ordered_copy", "alternation", "decision"] = option(
        "word_scores", "the task's gold reward: mean word score (bright +1, plain 0, dark -1), or the prompt's "
                       "words repeated in order (longest common subsequence; not a sum over words), or bright and "
                       "plain words alternating (+1 for a change of class, 0 for a repeat, dark -1; not a sum over "
                       "words), or decided by 3 words (share of the first 3 markers 'so' followed by the prompt's "
                       "last word; the rest is filler)")
    decision_rate: float = option(0.3, "gold=decision: chance an SFT demonstration's word after a marker is the clue",
                                  ge=0, le=1)
    clue_words: int | None = option(4, "gold=decision: prompts end with one of this many words, the clue (none: any "
                                       "word of the lexicon)", ge=1, le=48)
    reward: Literal["model", "gold"] = option(
        "model", "what PPO optimises: the reward model's score, or the gold reward times gold_reward_scale; the "
                 "gold reward is what results are judged by either way")
    gold_reward_scale: float = option(4.0, "reward=gold: factor on the gold reward (x4 spans the reward model's "
                                           "range)", gt=0)
    pretrain_texts: int = option(8000, "pre-training texts (one epoch)", ge=64)
    sft_records: int = option(3000, "SFT demonstrations (one epoch; task relay: demonstrated episodes, a record per "
                                    "turn)", ge=32)
    preference_records: int = option(4000, "preference pairs for the reward model (one epoch)", ge=64)
    ppo_steps: int = option(50, "PPO steps per run", ge=1)
    ppo_batch_size: int = option(
        32, f"responses per PPO step, one per prompt (rloo, grpo: {SAMPLES_PER_PROMPT} per prompt to "
            f"1/{SAMPLES_PER_PROMPT} of the prompts); two mini-batches of half", ge=2)
    ppo_learning_rate: float = option(3e-4, "policy learning rate", gt=0)
    dpo_learning_rate: float = option(3e-4, "learning rate of the dpo method", gt=0)
    critic_learning_rate: float = option(1e-3, "critic learning rate", gt=0)
    value_weighting: ValueWeighting = option(
        "first", "MA-PPO's segment values from token values (PPOConfig.value_weighting; first: the value where the "
                 "macro action starts, see Study I, docs/studies/credit-assignment.md; equal: the paper's)")
    lam: float = option(1.0, "GAE lambda of the PPO-loop methods (PPOConfig.lam; 0.95: the paper's, and the "
                             "default before Study II, docs/studies/lambda.md)", ge=0, le=1)
    segment_weighting: SegmentWeighting = option(
        "tokens", "MA-PPO's policy loss over macro actions (PPOConfig.segment_weighting)")
    critic_init: Literal["reward", "sft"] = option(
        "reward", "critic initialisation: the reward model (the paper's choice) or the SFT model with a fresh head")
    kl_coef: float = option(0.05, "KL penalty coefficient", ge=0)
    eval_prompts: int = option(128, "held-out prompts of the final evaluation", ge=1)
    num_threads: int | None = option(
        1, "torch CPU threads while the demo runs (none: leave torch's setting); with other processes on a 2-core "
           "machine one thread pre-trained 3x faster than two", ge=1)
    curve_smoothing: int = option(5, "moving-average window (steps) of the gold curves and of steps_to_parity", ge=1)
    smoke_test: bool = option(False, "set by --quick: the run checks that the pipeline works; its report says its "
                                     "figures are not results")

    def validate(self) -> None:
        super().validate()
        if len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise ValueError(f"seeds must be distinct and not empty, got {self.seeds}")
        if not all(0 <= seed < 2**32 for seed in self.seeds):  # what torch and numpy accept
            raise ValueError(f"seeds must be 0 to 2**32 - 1, got {self.seeds}")
        if self.ppo_batch_size % 2:
            raise ValueError(f"ppo_batch_size must be even (two PPO mini-batches), got {self.ppo_batch_size}")
        methods = [parse_termination(spec)[0] for spec in self.terminations]
        if len(set(methods)) != len(methods) or set(methods) & {"ppo", "ma_ppo"}:
            raise ValueError(f"terminations repeat a method (ppo and ma_ppo always run): {self.terminations}")
        if self.task == "relay" and (self.terminations or self.methods):
            raise ValueError("task relay compares its own four methods; terminations and methods are single_turn's")
        unread = [name for name in (RELAY_ONLY if self.task == "single_turn" else SINGLE_TURN_ONLY)
                  if getattr(self, name) != DemoConfig.__dataclass_fields__[name].default]
        if unread:  # no option is set and then silently ignored
            raise ValueError(f"task {self.task} does not read {', '.join(unread)} (options of the other task)")
        if len(set(self.methods)) != len(self.methods):  # the names themselves are checked against the Literal
            raise ValueError(f"methods repeat a name: {self.methods}")
        if set(self.methods) & GROUP_METHODS and self.ppo_batch_size % SAMPLES_PER_PROMPT:
            raise ValueError(f"ppo_batch_size must be a multiple of {SAMPLES_PER_PROMPT} with methods rloo or grpo "
                             f"({SAMPLES_PER_PROMPT} responses per prompt), got {self.ppo_batch_size}")

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A shortened run (under a minute on 2 cores) for tests and a first look."""
        values = dict(seeds=(0,), pretrain_texts=2048, sft_records=512, preference_records=1024, ppo_steps=12,
                      ppo_batch_size=16, ppo_learning_rate=1e-3, eval_prompts=16, curve_smoothing=2, smoke_test=True)
        if overrides.get("task") == "relay":
            del values["preference_records"]  # relay has no reward model
        return cls(**{**values, **overrides})


NOT_IN_DEMO = ("fixed", "parsing")  # fixed takes its n; the demo's language has no parser


def parse_termination(spec: str) -> tuple[str, dict[str, Any]]:
    """`fixed:N`, `fixed:none`, or the name of another registered rule but parsing (randomized, perplexity, word, ...)
    -> (method name, PPOConfig options)."""
    rule, _, argument = spec.partition(":")
    if rule == "fixed" and argument:
        if argument == "none":  # as `marlhf ppo --ngram none`: the whole response is one macro action
            return "ma_ppo_fixed_inf", {"termination": "fixed", "ngram": None}
        if argument.isdigit() and int(argument) >= 1:
            name = "ppo" if argument == "1" else "ma_ppo" if argument == "5" else f"ma_ppo_fixed{argument}"
            return name, {"termination": "fixed", "ngram": int(argument)}
    elif rule in TERMINATION_RULES and rule not in NOT_IN_DEMO and not argument:
        return f"ma_ppo_{rule}", {"termination": rule}
    others = ", ".join(name for name in sorted(TERMINATION_RULES) if name not in NOT_IN_DEMO)
    raise ValueError(f"terminations: cannot read {spec!r}; use fixed:N, fixed:none or a registered rule ({others})")
