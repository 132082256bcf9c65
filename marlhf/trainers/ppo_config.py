"""`PPOConfig`: the options of PPO / MA-PPO and of its critic-free baselines (`marlhf ppo --help` lists them by
section). The algorithm they control is described in docs/algorithm.md and marlhf/trainers/ppo.py.

One home per option. `PPOConfig` declares the options of the run itself (models, optimisation, budget, sampling,
KL, logging) and, per plug-in kind, the option that names the plug-in (`termination`, `advantage`, `policy_loss`,
`rollout_engine`) and its block `<kind>_options`. A plug-in's options are declared once, by the dataclass it
registers (marlhf.plugins), with their types, defaults, bounds and help. Their values live in the kind's block.

Read an option from its typed block: `config.plugin_options("advantage").lam` (the chosen plug-in's options
dataclass), `config.kl_control.kl_target`, `config.async_rollout.max_staleness`. A check of one plug-in's options
alone lives in its options dataclass (`__post_init__`); `validate` keeps the rules between a block and the run's
own options.

Flat names are input aliases. Every option of marlhf's built-in plug-ins is also taken flat, `--ngram 5`, `lam: 1`
in a file, `PPOConfig(lam=1)` in Python: `FLAT_OPTIONS` is generated from the plug-ins' dataclasses when this module
is imported (a name declared twice is an error), and `expand_values` moves a flat value into its kind's block when
a config is built (marlhf.config). A flat name is not an attribute. `to_dict` (and so config.yaml) writes them
flat, as before. A plug-in of the same kind that declares an option of a flat name gets its value (`lam` reaches a
user's estimator that declares `lam`).

Option blocks of no plug-in kind (`BLOCKS`): options that belong together but name no plug-in (the asynchronous
rollouts', the adaptive KL controller's) are declared by one dataclass each, their values held in the block
`<kind>_options`, read through a typed property (`config.kl_control`), and taken flat the same way
(`--max_staleness 1`). `to_dict` writes them flat only: such a block holds nothing but them.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping
from typing import Any, Literal

from marlhf.segments import ValueWeighting
from marlhf.config import add_option_argument, check_bounds, coerce_option, option
from marlhf.errors import did_you_mean
from marlhf import engines, estimators, policy_losses, termination
from marlhf.imports import import_function
from marlhf.engines.hf import HFOptions
from marlhf.engines.worker import AsyncRolloutOptions
from marlhf.kl_control import AdaptiveKLController, AdaptiveKLOptions
from marlhf.losses import LossAggregation, check_loss_options
from marlhf.multiturn import MultiTurnOptions
from marlhf.plugins import Plugin, Registry
from marlhf.policy_losses.ppo import ClippedOptions
from marlhf.run_config import TrainingConfig

__all__ = ["PPOConfig", "PLUGINS", "BLOCKS", "FLAT_OPTIONS", "FlatOption", "flat_options", "import_named_plugins"]

# The options that name a plug-in (marlhf.plugins), each with its block of options `<option>_options`.
PLUGINS: dict[str, Registry] = {"termination": termination.REGISTRY, "advantage": estimators.REGISTRY,
                                "policy_loss": policy_losses.REGISTRY, "rollout_engine": engines.REGISTRY}

# The option blocks of no plug-in kind, {kind: the dataclass declaring its options}, each held in `<kind>_options`.
BLOCKS: dict[str, type] = {"kl_control": AdaptiveKLOptions, "async_rollout": AsyncRolloutOptions,
                           "multi_turn": MultiTurnOptions}


@dataclasses.dataclass(frozen=True)
class FlatOption:
    """An option of a built-in plug-in that PPOConfig also takes flat: its kind (`termination`), the plug-in that
    declares it (`fixed`; None for an option of a block of no plug-in kind, BLOCKS), and its declaration (the
    dataclass field, with default, help and bounds, and its type)."""

    name: str
    kind: str
    plugin: str | None
    field: dataclasses.Field
    annotation: Any

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def owner(self) -> str:
        """What declares it, for messages: `termination rule 'fixed'`, or the block `async_rollout_options`."""
        return f"{self.kind}_options" if self.plugin is None else f"{PLUGINS[self.kind].kind} {self.plugin!r}"


def flat_options(plugins: Mapping[str, Registry], blocks: Mapping[str, type] | None = None) -> dict[str, FlatOption]:
    """{name: FlatOption} for every option of every plug-in of marlhf's own (its options dataclass is defined in
    marlhf) and of every block of no plug-in kind ({kind: options dataclass}), read off the dataclasses. A name
    two of them declare is a TypeError: a flat name means one option."""
    declared = [(kind, name, registry.get(name).options) for kind, registry in plugins.items()
                for name in registry.names()] + [(kind, None, options) for kind, options in (blocks or {}).items()]
    found: dict[str, FlatOption] = {}
    for kind, name, options in declared:
        if options is None or options.__module__.split(".")[0] != "marlhf":
            continue
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            if f.name in found:
                other = found[f.name]
                raise TypeError(f"option {f.name!r} is declared by {_declarer(kind, name)} and by "
                                f"{_declarer(other.kind, other.plugin)}: a flat option must name one option; "
                                "rename one")
            found[f.name] = FlatOption(f.name, kind, name, f, hints[f.name])
    return found


def _declarer(kind: str, plugin: str | None) -> str:
    return f"{kind}_options" if plugin is None else f"{kind} {plugin!r}"


FLAT_OPTIONS: dict[str, FlatOption] = flat_options(PLUGINS, BLOCKS)


def import_named_plugins(argv: list[str]) -> None:
    """Import the plug-ins named by dotted path in command-line arguments, so that `--help` lists them and their
    options (one that does not import is reported when the options are checked)."""
    for flag, value in zip(argv, argv[1:]):
        if flag.lstrip("-") in PLUGINS and ":" in value and not value.lstrip().startswith("{"):
            try:
                PLUGINS[flag.lstrip("-")].get(value)
            except ValueError:
                pass


@dataclasses.dataclass(kw_only=True)
class PPOConfig(TrainingConfig):
    """PPO / MA-PPO and the critic-free baselines (RLOO, GRPO, REINFORCE) on prompt records."""

    output_dir: str = option("outputs/ppo", "directory for checkpoints, metrics.jsonl, config.yaml and the final "
                                            "policy")
    model_name_or_path: str = option("google/gemma-2b", "SFT model: initial policy and frozen reference")
    reward_model_name_or_path: str | None = option(
        None, "reward model (ScalarHeadModel directory); required unless train_ppo gets a reward function")
    critic_model_name_or_path: str | None = option(
        None, "critic initialisation (none: the reward model, as in the paper; without one, the SFT model "
              "with a fresh value head)")
    learning_rate: float = option(1.5e-5, "policy peak AdamW learning rate", gt=0)
    critic_learning_rate: float = option(1.5e-5, "critic peak AdamW learning rate", gt=0)
    per_device_batch_size: int = option(8, "prompts per PPO step on each process", ge=1)
    mini_batch_size: int = option(
        8, "responses per optimizer update (per process); each is split into gradient_accumulation_steps pieces",
        ge=1)
    ppo_epochs: int = option(1, "passes of PPO updates over each rollout", ge=1)
    rollout_engine: str = option("hf", "what samples the responses (marlhf.engines): hf, transformers' generate on "
                                       "the policy, an engine registered with register_engine, or a dotted path "
                                       "package.module:factory")
    rollout_engine_options: dict[str, Any] | None = option(
        None, "the engine's options, a YAML mapping such as '{kv_cache: static}' (a built-in engine's are also flags, "
              "below; marlhf.plugins)")
    old_logprobs_from: Literal["recompute", "sampling"] = option(
        "recompute", "where the old log-probs (the PPO ratio's denominator) come from: a forward pass over prompt + "
                     "response (exact), or the sampling pass (one forward fewer per step, as TRL's PPO does; a "
                     "KV-cached pass can differ from a full forward, more so in bf16). One update per step takes "
                     "them from the update's forward either way. Old name: rollout_logprobs")
    log_rollout_logprob_diff: bool = option(
        False, "also take the engine's sampling log-probs and log rollout/logprob_diff_mean and _max, |sampling - "
               "trainer log-prob| over response tokens: how far the rollout engine's numerics are from the "
               "trainer's (needs the trainer's own: old_logprobs_from='recompute' or one update per step)")
    forward_batch_size: int | None = option(
        None, "rows per forward pass when scoring a rollout, rows of similar length together with their common "
              "padding cut (none: the update's piece size, mini_batch_size / gradient_accumulation_steps)", ge=1)
    max_prompt_length: int = option(512, "prompt budget in tokens (what happens to longer prompts: long_prompts)",
                                    ge=1)
    long_prompts: Literal["drop", "truncate"] = option(
        "drop", "prompts over max_prompt_length tokens are dropped (the released code's RL stage) or keep their last "
                "max_prompt_length tokens and leading <bos>, as SFT, reward modelling, DPO and evaluation do")
    max_response_length: int = option(512, "sample at most N response tokens", ge=1)
    max_length: int = option(1024, "context budget: must hold max_prompt_length + max_response_length", ge=2)

    # Sampling. Log-probs are taken under logits / temperature, the distribution the tokens came from.
    temperature: float = option(0.8, "sampling temperature (>= 0.01: below it logits / temperature overflow the "
                                     "log-probs)", ge=0.01)
    top_k: int = option(50, "sample from the k most likely tokens (0: no top-k)", ge=0)
    top_p: float = option(1.0, "nucleus sampling mass (1: off)", gt=0, le=1)

    # Macro actions.
    termination: str = option(
        "fixed", "macro-action termination rule: fixed, randomized, perplexity, parsing, word (one macro action per "
                 "word, read off the tokenizer's vocabulary), low_prob (SPO: one starts at each token sampled with "
                 "probability below a threshold), another rule registered with "
                 "marlhf.termination.register_termination, or a dotted path package.module:function")
    termination_options: dict[str, Any] | None = option(
        None, "the rule's options, a YAML mapping such as '{ngram: 3}' or a user's rule's '{sentences: 2}' (a "
              "built-in rule's are also flags, below; marlhf.plugins)")
    last_token_own_segment: bool = option(
        False, "the last response token forms its own macro action (the released code's layout)")

    # Rewards and advantages.
    reward: Literal["model", "code"] = option(
        "model", "score source: the reward model, or the unit tests in each record's input_output (APPS, run in "
                 "a sandbox); reward_fns, or a reward function passed to train_ppo, override both")
    reward_fns: tuple[str, ...] = option(
        (), "reward functions by dotted path package.module:function, in TRL's convention fn(prompts, completions, "
            "**record_fields) -> scores (or marlhf's fn(prompts, completions)), summed with reward_weights; each "
            "logged as rewards/<name>")
    reward_weights: tuple[float, ...] | None = option(None, "weights of reward_fns (none: 1 each)")
    advantage: str = option(
        "gae", "gae: critic + GAE over macro actions; rloo/grpo/reinforce: critic-free sequence advantages; "
               "prefix_tree: TEMPO's prefix-tree TD correction on grpo; entropy_weighted: GTPO / GRPO-S, from the "
               "policy's entropy at each token (computed only for it, in the scoring forward); mc_segment: "
               "Monte-Carlo values at macro-action boundaries (VinePPO / SPO-chain); gigpo: GiGPO's episode and "
               "anchor-state groups over multi-turn episodes; an "
               "estimator registered with marlhf.estimators.register_estimator, or a dotted path "
               "package.module:function")
    advantage_options: dict[str, Any] | None = option(
        None, "the estimator's options, a YAML mapping such as '{lam: 0.95}' (a built-in estimator's are also "
              "flags, below; marlhf.plugins)")
    num_samples_per_prompt: int = option(1, "responses sampled per prompt (rloo and grpo need >= 2)", ge=1)
    kl_coef: float = option(0.05, "KL penalty coefficient (k1 estimator, on every token); 0 with a termination "
                                   "rule that does not read the reference drops the reference model (no "
                                   "forward, no copy; objective/kl is then not logged)", ge=0)
    rm_score_clip: float | None = option(
        None, "clip reward scores to [-c, c] before use (the released code uses 2.5; none: no clipping)", gt=0)
    critic_warmup_steps: int = option(
        0, "the first N PPO steps train only the critic on their rollouts, the policy frozen (VC-PPO's value "
           "pretraining; OpenRLHF's freezing_steps, verl's critic_warmup); counted in the step budget", ge=0)
    kl_control_options: dict[str, Any] | None = option(
        None, "the adaptive KL controller's options (marlhf.kl_control.AdaptiveKLOptions), a YAML mapping such as "
              "'{kl_target: 6}' (each is also a flag, below)")
    max_generated_tokens: int | None = option(
        None, "token budget: end the run after the first step at which the tokens generated so far reach N, even "
              "before max_steps (every sampled response token and every Monte-Carlo continuation token, over all "
              "processes: the sums of rollout/tokens and rollout/mc_tokens, logged so far as "
              "rollout/generated_tokens; kept in checkpoints); none: off", ge=1)
    min_generated_tokens: int | None = option(
        None, "token budget: do not end the run at max_steps before the tokens generated so far (as "
              "max_generated_tokens counts them) reach N; it goes on a step at a time until they do, the "
              "learning-rate schedule laid out over max_steps and held at its last value past it (cosine's: 0); "
              "none: off", ge=1)
    value_weighting: ValueWeighting = option(
        "first", "a macro action's value from its token values: the first token's, the value of the state where "
                 "the macro action starts (first; not in the paper, the default since Study I, the credit-"
                 "assignment study), or the paper's: equal weights (equal), the last token only (unit), weights "
                 "growing towards the last token (position)")
    whiten_advantages: bool = option(False, "normalise advantages over the batch (the released runs do not)")
    advantage_mask_threshold: float | None = option(
        None, "SPO's probability mask, for any estimator: keep a token's advantage only where the sampling policy "
              "gave the sampled token probability below this, 0 elsewhere (after whiten_advantages, which whitens "
              "over all response tokens where SPO whitens over the kept ones; SPO: 0.9; none: off)",
        ge=0, le=1)

    # Losses.
    policy_loss: str = option(
        "ppo", "the policy loss (marlhf.policy_losses): ppo, the clipped surrogate with one ratio per macro action, "
               "a loss registered with register_policy_loss, or a dotted path package.module:function")
    policy_loss_options: dict[str, Any] | None = option(
        None, "the policy loss's options, a YAML mapping such as '{clip_range: 0.1}' (a built-in loss's are also "
              "flags, below; marlhf.plugins)")
    value_clip_range: float | None = option(
        0.2, "clip range of the critic around its rollout values, as in the released code (none: off)", gt=0)
    value_loss_granularity: Literal["segment", "token"] = option(
        "segment", "critic loss: each macro action's weighted value regressed to its return (paper), or each "
                   "token's value regressed to its macro action's return (released code)")
    loss_agg_mode: LossAggregation = option(
        "token-mean", "how policy and value losses are averaged (verl's names): one mean over the mini-batch's "
                      "tokens, or over responses of each response's token mean (the released runs: batch size 1 "
                      "with accumulation) or token sum")
    logprob_temperature: Literal["sampling", "raw"] = option(
        "sampling", "log-probs for the ratio, the KL penalty and the perplexity rule from logits / temperature "
                    "(the distribution sampled from) or from raw logits (the released code)")

    # Asynchronous rollouts (marlhf.trainers.staleness, marlhf.engines.worker; docs/async.md).
    async_rollout_options: dict[str, Any] | None = option(
        None, "the asynchronous rollouts' options (marlhf.engines.worker.AsyncRolloutOptions), a YAML mapping such "
              "as '{max_staleness: 1, rollout_workers: 1}' (each is also a flag, below)")

    # Multi-turn environments (marlhf.envs, marlhf.multiturn; docs/multiturn.md).
    env: str | None = option(
        None, "train on episodes of this environment (marlhf.envs): a registered name, package.module:Class or "
              "path/to/file.py:Class; each step's episodes start from env.reset(seed, task), task = the dataset "
              "record; the score is the environment's rewards; the episodes run on rollout_engine, here or in the "
              "rollout workers (none: single-turn prompts)")
    env_options: dict[str, Any] | None = option(
        None, "the environment's own options, a YAML mapping (what it registered with register_env)")
    multi_turn_options: dict[str, Any] | None = option(
        None, "the multi-turn rollout's limits (marlhf.multiturn.MultiTurnOptions), a YAML mapping such as "
              "'{max_turns: 3}' (each is also a flag, below)")

    # LoRA (lora_r, lora_alpha, lora_target_modules: TrainingConfig).
    use_lora: bool = option(
        False, "train LoRA adapters on policy and critic; the reference is the policy with its adapters off "
               "(no second copy); the final policy is saved merged")

    # Each plug-in's own options follow the section that names its kind, one section per plug-in (add_arguments).
    HELP_SECTIONS = {
        "sampling": ("rollout_engine", "rollout_engine_options", "old_logprobs_from", "log_rollout_logprob_diff",
                     "logprob_temperature", "forward_batch_size", "max_prompt_length", "long_prompts",
                     "max_response_length", "max_length", "temperature", "top_k", "top_p"),
        "macro actions": ("termination", "termination_options", "last_token_own_segment"),
        "rewards and advantages": ("reward", "reward_fns", "reward_weights", "advantage", "advantage_options",
                                   "num_samples_per_prompt", "kl_coef", "kl_control_options", "rm_score_clip",
                                   "critic_warmup_steps", "value_weighting", "whiten_advantages",
                                   "advantage_mask_threshold"),
        "losses": ("policy_loss", "policy_loss_options", "loss_agg_mode", "value_clip_range", "value_loss_granularity"),
        "asynchronous rollouts": ("async_rollout_options",),
        "multi-turn environments": ("env", "env_options", "multi_turn_options"),
        "LoRA": ("use_lora", "lora_r", "lora_alpha", "lora_target_modules"),
    }
    RENAMED = {"rollout_logprobs": "old_logprobs_from"}

    def validate(self) -> None:
        super().validate()
        self._check_blocks()
        if self.max_prompt_length + self.max_response_length > self.max_length:
            raise ValueError(f"max_prompt_length + max_response_length ({self.max_prompt_length} + "
                             f"{self.max_response_length}) must be <= max_length ({self.max_length})")
        self._check_plugins()
        minimum = self.plugin("advantage").min_samples_per_prompt
        if self.num_samples_per_prompt < minimum:
            raise ValueError(f"advantage={self.advantage!r} needs num_samples_per_prompt >= {minimum}, "
                             f"got {self.num_samples_per_prompt}")
        if self.rollout_size % self.mini_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must divide the responses per step "
                             f"(per_device_batch_size x num_samples_per_prompt = {self.rollout_size})")
        engine = self.plugin_options("rollout_engine")
        if isinstance(engine, HFOptions) and engine.kv_cache != "dynamic" and self.mixed_precision != "no":
            # transformers allocates a static cache in the model's dtype, and autocast hands it bf16/fp16 keys
            raise ValueError(f"kv_cache={engine.kv_cache!r} needs mixed_precision='no' (got "
                             f"{self.mixed_precision!r}): the static cache is allocated in the weights' dtype; use "
                             "kv_cache='dynamic'")
        loss = self.plugin_options("policy_loss")
        if isinstance(loss, ClippedOptions):
            check_loss_options(self.loss_agg_mode, loss.ratio_granularity, loss.segment_weighting)
        else:
            check_loss_options(self.loss_agg_mode)
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_fns):
            raise ValueError(f"reward_weights ({len(self.reward_weights)}) must give one weight per reward_fns entry "
                             f"({len(self.reward_fns)})")
        for path in self.reward_fns:
            import_function(path, "reward_fns")  # a path that does not import stops here
        if self.logprob_temperature == "raw" and self.old_logprobs_from == "sampling":
            raise ValueError("logprob_temperature='raw' needs old_logprobs_from='recompute' (the sampling pass's "
                             "log-probs are under logits / temperature)")
        self._check_rollout_logprobs()
        self._check_env()
        if self.plugin("advantage").reads_entropy and self.keeps_sampling_logprobs:
            raise ValueError(f"advantage={self.advantage!r} reads the policy's entropy at each token, which the "
                             "trainer's forward gives and old_logprobs_from='sampling' skips: use "
                             "old_logprobs_from='recompute'")
        if "tis_cap" in (self.policy_loss_options or {}) and "tis_cap" not in self.plugin("policy_loss").option_names:
            raise ValueError(f"tis_cap is an option of the ppo policy loss; policy_loss={self.policy_loss!r} does "
                             "not take it")
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ValueError(f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide "
                             f"mini_batch_size ({self.mini_batch_size})")
        if self.critic_warmup_steps and not self.uses_critic:
            raise ValueError(f"critic_warmup_steps={self.critic_warmup_steps} needs a critic; advantage="
                             f"{self.advantage!r} has none (use advantage='gae')")
        kl_control = self.kl_control
        if kl_control.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef from its start value, which must be > 0 (got kl_coef=0)")
        if (self.min_generated_tokens is not None and self.max_generated_tokens is not None
                and self.min_generated_tokens > self.max_generated_tokens):
            raise ValueError(f"min_generated_tokens ({self.min_generated_tokens}) must be <= max_generated_tokens "
                             f"({self.max_generated_tokens})")
        if kl_control.kl_target is not None:  # the horizon against the responses per step, and the bound
            AdaptiveKLController(self.kl_coef, kl_control.kl_target, kl_control.kl_horizon, self.rollout_size,
                                 kl_control.kl_coef_max)

    def _check_rollout_logprobs(self) -> None:
        """What a stale rollout and comparing the engine's log-probs with the trainer's need."""
        stale = self.async_rollout.max_staleness > 0
        if stale and self._tis_cap is not None:
            raise ValueError("max_staleness > 0 corrects the rollout's lag and the engine's numerics together (the ppo "
                             "loss's staleness_correction, 'tis' for truncation): unset tis_cap")
        if self.compares_rollout_logprobs:
            what = ("max_staleness" if stale else "log_rollout_logprob_diff" if self.log_rollout_logprob_diff
                    else "tis_cap")
            if self.keeps_sampling_logprobs:
                raise ValueError(f"{what} compares the engine's sampling log-probs with the trainer's, which "
                                 "old_logprobs_from='sampling' does not compute: use old_logprobs_from='recompute'")
            if self.logprob_temperature == "raw":
                raise ValueError(f"{what} needs logprob_temperature='sampling' (the engine's log-probs are under "
                                 "logits / temperature)")

    @property
    def rollout_size(self) -> int:
        """Responses sampled per PPO step on each process."""
        return self.per_device_batch_size * self.num_samples_per_prompt

    @property
    def counts_generated_tokens(self) -> bool:
        """Whether a token budget is set: the run then counts its generated tokens (one read to the host a step)."""
        return self.max_generated_tokens is not None or self.min_generated_tokens is not None

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probs are taken at (ratio, KL penalty, perplexity rule)."""
        return self.temperature if self.logprob_temperature == "sampling" else 1.0

    @property
    def compares_rollout_logprobs(self) -> bool:
        """Whether the engine's sampling log-probs are kept beside the trainer's (the diff metrics, TIS, and with
        max_staleness the behaviour policy's log-probs of the decoupled loss)."""
        return self.log_rollout_logprob_diff or self._tis_cap is not None or self.async_rollout.max_staleness > 0

    @property
    def keeps_sampling_logprobs(self) -> bool:
        """Whether the sampling pass's log-probs are the old log-probs (the step runs no scoring forward of the
        policy)."""
        return self.old_logprobs_from == "sampling" and not self.reuses_rollout_forward

    @property
    def _tis_cap(self) -> float | None:
        """The policy loss's truncated importance sampling cap: the ppo loss's option (a user's loss may declare it
        too); None for a loss without one."""
        return getattr(self.plugin_options("policy_loss"), "tis_cap", None)

    @property
    def uses_critic(self) -> bool:
        return self.plugin("advantage").needs_critic

    @property
    def uses_reference(self) -> bool:
        """Whether anything reads the frozen reference: the KL penalty, or a termination rule that reads its
        log-probs (perplexity, or any rule not registered as reference-free). Without one, PPO neither keeps
        nor runs it (TRL's GRPO does the same at beta 0)."""
        return self.kl_coef > 0 or self.plugin("termination").reads_reference

    @property
    def reuses_rollout_forward(self) -> bool:
        """One update per step, of the whole rollout in one piece: the rollout's policy and critic forwards
        then run with gradients and the update backpropagates through them instead of running them again
        (the weights do not change in between, so this is exact). Both graphs are held at once."""
        return (self.ppo_epochs == 1 and self.mini_batch_size == self.rollout_size
                and self.gradient_accumulation_steps == 1)

    # ---- the typed blocks: where an option of a plug-in or a block is read -----------------------------------
    @property
    def kl_control(self) -> AdaptiveKLOptions:
        """The adaptive KL controller's options: kl_control_options' values, their declared defaults for the rest."""
        return self.block_options("kl_control")

    @property
    def async_rollout(self) -> AsyncRolloutOptions:
        """The asynchronous rollouts' options: async_rollout_options' values, their declared defaults for the rest."""
        return self.block_options("async_rollout")

    @property
    def multi_turn(self) -> MultiTurnOptions:
        """The multi-turn rollout's limits: multi_turn_options' values, their declared defaults for the rest."""
        return self.block_options("multi_turn")

    def _check_env(self) -> None:
        """--env runs episodes on the rollout engine (a server's too: the environments stay in this process, which
        asks it for each round), in this process or in the rollout workers, scored by the environment; the rest not
        yet."""
        if self.env is None:
            if self.env_options:
                raise ValueError("env_options needs env (the environment they configure)")
            return
        refused = [name for name, used in (("reward_fns", self.reward_fns), ("reward='code'", self.reward == "code"),
                                           (f"advantage='mc_segment' with termination={self.termination!r} (its "
                                            "continuations start at turn starts only)",
                                            self.advantage == "mc_segment" and self.termination != "turn"),
                                           ("old_logprobs_from='sampling'", self.keeps_sampling_logprobs))
                   if used]
        if refused:
            raise ValueError(f"env={self.env!r} with {', '.join(refused)}: not yet (multi-turn training runs episodes "
                             "on a rollout engine here or in rollout workers, scored by the environment's rewards)")

    def block_options(self, kind: str) -> Any:
        """The options of the block of no plug-in kind `kind` (BLOCKS), as its dataclass."""
        return BLOCKS[kind](**(getattr(self, f"{kind}_options") or {}))

    def plugin(self, option: str) -> Plugin:
        """The plug-in that the option `option` (termination, advantage, policy_loss, rollout_engine) names."""
        return PLUGINS[option].get(getattr(self, option))

    def plugin_options(self, option: str) -> Any:
        """The named plug-in's options: those of its block `<option>_options`, the flat options' values for the
        names it declares, and its dataclass's defaults for the rest."""
        plugin = self.plugin(option)
        block = getattr(self, f"{option}_options") or {}
        flat = {name: self._flat_value(name) for name in plugin.option_names
                if name in FLAT_OPTIONS and FLAT_OPTIONS[name].kind == option}
        return plugin.make_options({**{k: v for k, v in block.items() if k not in FLAT_OPTIONS}, **flat})

    def _flat_value(self, name: str) -> Any:
        """The value of the flat option `name` (FLAT_OPTIONS): its kind's block's, else its declared default."""
        flat = FLAT_OPTIONS[name]
        return (getattr(self, f"{flat.kind}_options") or {}).get(name, flat.default)

    @classmethod
    def _field_set(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    def _check_blocks(self) -> None:
        """Each block's built-in options checked (type and bounds, the error naming the plug-in and the option; one
        given flat was checked under its flat name by expand_values), those at their default dropped (so equal
        configs compare equal), a block left empty None."""
        for kind in (*PLUGINS, *BLOCKS):
            block = dict(getattr(self, f"{kind}_options") or {})
            unknown = sorted(set(block) - set(FLAT_OPTIONS)) if kind in BLOCKS else []
            if unknown:
                declared = [f.name for f in dataclasses.fields(BLOCKS[kind])]
                raise ValueError(f"{kind}_options has no option {unknown[0]!r}{did_you_mean(unknown[0], declared)}; "
                                 f"its options: {', '.join(declared)}")
            for key in [key for key in block if key in FLAT_OPTIONS]:
                flat = FLAT_OPTIONS[key]
                if flat.kind != kind:
                    raise ValueError(f"{kind}_options: {key!r} is an option of {flat.owner}: set it as {key} or in "
                                     f"{flat.kind}_options")
                block[key] = _checked(flat, block[key], f"{flat.owner} option {key!r}")
                if block[key] == flat.default:
                    del block[key]
            object.__setattr__(self, f"{kind}_options", block or None)

    def _check_plugins(self) -> None:
        """Each plug-in resolves and takes its options, each block makes its dataclass. A flat option of another
        engine than the chosen one, set away from its default, is an error (the engine samples its own way); the
        other kinds' flat options may stay set for a plug-in not chosen (configs keep parsing_language for
        `--termination parsing`)."""
        for kind in PLUGINS:
            self.plugin(kind)  # an unknown name or a path that does not import stops here
            self.plugin_options(kind)  # unknown keys, wrong types and the options' own rules stop here
        for kind in BLOCKS:
            self.block_options(kind)  # the block's own rules
        engine = self.plugin("rollout_engine")
        for name, value in (self.rollout_engine_options or {}).items():
            if name in FLAT_OPTIONS and name not in engine.option_names:
                raise ValueError(f"{name}={value!r} is the {FLAT_OPTIONS[name].plugin} engine's option; "
                                 f"rollout_engine={self.rollout_engine!r} samples its own way")

    @classmethod
    def input_names(cls) -> list[str]:
        return super().input_names() + list(FLAT_OPTIONS)

    @classmethod
    def declarations(cls) -> dict[str, tuple[Any, dataclasses.Field]]:
        flat = {name: (option.annotation, option.field) for name, option in FLAT_OPTIONS.items()}
        return {**super().declarations(), **flat}

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        return {**super().option_defaults(), **{name: list(flat.default) if isinstance(flat.default, tuple)
                                                else flat.default for name, flat in FLAT_OPTIONS.items()}}

    @classmethod
    def as_written(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Also a flat option that an earlier version kept in its block (`termination_options: {threshold: 0.8}`)
        written flat."""
        values = super().as_written(values)
        for kind in (*PLUGINS, *BLOCKS):
            block = values.get(f"{kind}_options")
            if isinstance(block, dict) and set(block) & set(FLAT_OPTIONS):
                values.update({k: v for k, v in block.items() if k in FLAT_OPTIONS})
                values[f"{kind}_options"] = {k: v for k, v in block.items() if k not in FLAT_OPTIONS} or None
        return values

    def to_dict(self) -> dict[str, Any]:
        """The options as a config file holds them: the flat options (all of them, at their values) after their
        kind's block, which keeps only the options of plug-ins outside marlhf (None when there are none); a block
        of no plug-in kind (BLOCKS) holds only flat options and is not written."""
        values = {}
        for name, value in super().to_dict().items():
            kind = name.removesuffix("_options")
            if kind == name or kind not in PLUGINS and kind not in BLOCKS:
                values[name] = value
                continue
            if kind in PLUGINS:
                values[name] = {k: v for k, v in (value or {}).items() if k not in FLAT_OPTIONS} or None
            for flat in FLAT_OPTIONS.values():
                if flat.kind == kind:
                    value = self._flat_value(flat.name)
                    values[flat.name] = list(value) if isinstance(value, tuple) else value
        return values

    @classmethod
    def expand_values(cls, values: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Options as given (a file, the command line, keyword arguments) as fields: a plug-in given as a block,
        `termination: {name: fixed, ngram: 3}` (a YAML mapping, or its text from the command line), becomes the
        option naming it and its options; a flat option (`ngram: 3`) goes to its kind's block `<kind>_options`.
        An option given twice with different values is an error when `strict`; else the flat one wins (what
        `dataclasses.replace(config, ngram=3)` needs)."""
        values = super().expand_values(values, strict)
        blocks = {}
        for kind in (*PLUGINS, *BLOCKS):
            block = values.get(f"{kind}_options")
            if isinstance(block, str):  # YAML text from the command line
                block = coerce_option(f"{kind}_options", block, dict[str, Any] | None)
            if block is not None and not isinstance(block, dict):
                continue  # the field's check names it
            blocks[kind] = dict(block or {})
        for kind in PLUGINS:
            named = values.get(kind)
            if isinstance(named, str) and named.lstrip().startswith("{"):
                named = coerce_option(kind, named, dict[str, Any])
            if not isinstance(named, dict):
                continue
            named = dict(named)
            if "name" not in named:
                raise ValueError(f"{kind}: a block needs the plug-in's name, e.g. '{kind}: {{name: ..., ...}}'")
            values[kind] = named.pop("name")
            for key, value in named.items():
                _put(blocks, values, key, value, kind, True, f"the {kind} block")
        for key in [key for key in values if key in FLAT_OPTIONS]:
            _put(blocks, values, key, _checked(FLAT_OPTIONS[key], values.pop(key), key), None, strict, None)
        for kind, block in blocks.items():
            if block or values.get(f"{kind}_options") is not None:
                values[f"{kind}_options"] = block or None
        return values

    @classmethod
    def add_arguments(cls, parser) -> None:
        """The options by section; after the section that names a plug-in kind, one section per built-in plug-in
        with its own options (each option listed once, under its plug-in), and the plug-ins of other packages
        registered so far with their options (a plug-in named by dotted path on the command line is imported
        first, so it is listed too: import_named_plugins)."""
        super().add_arguments(parser)
        groups = parser._action_groups
        for kind in BLOCKS:  # a block of no plug-in kind: its options right after it, in its section
            group = next(g for g in groups if any(a.dest == f"{kind}_options" for a in g._group_actions))
            actions, count = group._group_actions, len(group._group_actions)
            for flat in FLAT_OPTIONS.values():
                if flat.kind == kind:
                    add_option_argument(group, [f"--{flat.name}"], flat.name, flat.annotation, flat.field)
            added, actions[count:] = actions[count:], []
            after = next(i for i, a in enumerate(actions) if a.dest == f"{kind}_options") + 1
            actions[after:after] = added
        for kind, registry in PLUGINS.items():
            after = next(g for g in groups if any(a.dest == kind for a in g._group_actions))
            sections = []
            for name in registry.names():
                plugin = registry.get(name)
                own = [flat for flat in FLAT_OPTIONS.values() if flat.kind == kind and flat.plugin == name]
                if own:
                    summary = (inspect.getdoc(plugin.obj) or "").split("\n\n")[0].replace("\n", " ")
                    group = parser.add_argument_group(
                        f"{registry.kind} {name} (--{kind} {name}; its options also in {kind}_options)",
                        summary or None)
                    for flat in own:
                        add_option_argument(group, [f"--{flat.name}"], flat.name, flat.annotation, flat.field)
                    sections.append(group)
            others = [registry.get(name).describe() for name in registry.names()
                      if not any(flat.kind == kind and flat.plugin == name for flat in FLAT_OPTIONS.values())]
            if others:
                sections.append(parser.add_argument_group(
                    f"the other {registry.kind}s: name (option=default, ...), options in {kind}_options",
                    "; ".join(others)))
            for group in sections:  # listed right after the section that names the kind
                groups.remove(group)
            index = groups.index(after) + 1
            groups[index:index] = sections


def _checked(flat: FlatOption, value: Any, label: str) -> Any:
    """`value` of the flat option checked against its declaration (type, bounds), in canonical form; an error
    names `label`."""
    value = coerce_option(label, value, flat.annotation)
    check_bounds(label, value, flat.field.metadata.get("bounds", {}))
    return value


def _put(blocks: dict[str, dict], values: dict[str, Any], key: str, value: Any, kind: str | None, strict: bool,
         where: str | None) -> None:
    """Put `key: value` of a plug-in block or a flat option into its block (a flat option goes to its own kind's;
    an option of no built-in plug-in to `kind`'s). A value the block already holds differently is an error when
    `strict`."""
    home = FLAT_OPTIONS[key].kind if key in FLAT_OPTIONS else kind
    block = blocks.setdefault(home, {})
    if strict and key in block and block[key] != value:
        first, second = (block[key], value)
        raise ValueError(f"{key} is given twice: {first!r} and {second!r}" + (f" in {where}" if where else ""))
    block[key] = value


_clash = sorted(set(FLAT_OPTIONS) & PPOConfig._field_set())
if _clash:
    raise TypeError(f"PPOConfig declares {_clash[0]!r}, a built-in plug-in's option: one home per option")
