"""`PPOConfig`: the options of PPO / MA-PPO and of its critic-free baselines (`marlhf ppo --help` lists them by
section). The algorithm they control is described in docs/algorithm.md and marlhf/trainers/ppo.py."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from marlhf.advantages import LamSchedule, SegmentReward
from marlhf.segments import ValueWeighting
from marlhf.config import TrainingConfig, coerce_option, option
from marlhf import engines, estimators, policy_losses, termination
from marlhf.imports import import_function
from marlhf.kl_control import AdaptiveKLController
from marlhf.losses import LossAggregation, RatioGranularity, SegmentWeighting, check_loss_options
from marlhf.parsing import ParsingLanguage
from marlhf.engines.hf import KVCache, SamplingNoise
from marlhf.plugins import Plugin, Registry

__all__ = ["PPOConfig", "PLUGINS", "import_named_plugins"]

# The options that name a plug-in (marlhf.plugins), each with its block of options `<option>_options`.
PLUGINS: dict[str, Registry] = {"termination": termination.REGISTRY, "advantage": estimators.REGISTRY,
                                "policy_loss": policy_losses.REGISTRY, "rollout_engine": engines.REGISTRY}


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
        None, "the engine's own options that are not PPO options (a YAML mapping; marlhf.plugins)")
    rollout_logprobs: Literal["recompute", "sampling"] = option(
        "recompute", "the rollout's policy log-probs: a forward pass over prompt + response (exact), or kept from "
                     "the sampling pass (one forward fewer per step, as TRL's PPO does; a KV-cached pass can differ "
                     "from a full forward, more so in bf16). One update per step takes them from the update's "
                     "forward either way")
    log_rollout_logprob_diff: bool = option(
        False, "also take the engine's sampling log-probs and log rollout/logprob_diff_mean and _max, |sampling - "
               "trainer log-prob| over response tokens: how far the rollout engine's numerics are from the "
               "trainer's (needs the trainer's own: rollout_logprobs='recompute' or one update per step)")
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
    sampling_noise: SamplingNoise = option(
        "row_generators", "the hf engine's per-row Gumbel noise: one torch generator per row (B draws per token), "
                          "or a hash of (row seed, position, token) for all rows at once (for large GPU batches)")
    kv_cache: KVCache = option(
        "dynamic", "the hf engine's KV cache: grown each token (dynamic), allocated once (static), or static with "
                   "the decode step compiled by torch.compile (static_compiled); the same samples; static needs "
                   "mixed_precision no")

    # Macro actions.
    termination: str = option(
        "fixed", "macro-action termination rule: fixed, randomized, perplexity, parsing, word (one macro action per "
                 "word, read off the tokenizer's vocabulary), low_prob (SPO: one starts at each token sampled with "
                 "probability below a threshold), another rule registered with "
                 "marlhf.termination.register_termination, or a dotted path package.module:function")
    ngram: int | None = option(
        5, "fixed: tokens per macro action (1: token-level PPO; none: the whole response is one action)", ge=1)
    randomized_lengths: tuple[int, ...] = option((2, 3, 5, 10), "randomized: segment lengths to draw from", ge=1)
    repeat_times: int = option(3, "randomized: how often the list of lengths is repeated before shuffling", ge=1)
    parsing_cutoff: int = option(5, "parsing: a subtree with at most this many parser leaves is one action", ge=1)
    parsing_language: ParsingLanguage = option(
        "auto", "parsing: parser to use (auto: Python if the response parses as code)")
    termination_options: dict[str, Any] | None = option(
        None, "the rule's own options that are not PPO options, e.g. '{sentences: 2}' (a YAML mapping; "
              "marlhf.plugins)")
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
               "policy's entropy at each token (computed only for it, in the scoring forward); an "
               "estimator registered with marlhf.estimators.register_estimator, or a dotted path "
               "package.module:function")
    advantage_options: dict[str, Any] | None = option(
        None, "the estimator's own options that are not PPO options (a YAML mapping; marlhf.plugins)")
    num_samples_per_prompt: int = option(1, "responses sampled per prompt (rloo and grpo need >= 2)", ge=1)
    grpo_normalize_std: bool = option(True, "grpo: divide by the group's standard deviation")
    kl_coef: float = option(0.05, "KL penalty coefficient (k1 estimator, on every token); 0 with a termination "
                                   "rule that does not read the reference drops the reference model (no "
                                   "forward, no copy; objective/kl is then not logged)", ge=0)
    rm_score_clip: float | None = option(
        None, "clip reward scores to [-c, c] before use (the released code uses 2.5; none: no clipping)", gt=0)
    gamma: float = option(1.0, "discount over macro actions", ge=0, le=1)
    lam: float = option(1.0, "GAE lambda over macro actions (1 since Study II, whose tuning chose it for token-level "
                                 "PPO and MA-PPO alike; the paper's: 0.95)", ge=0, le=1)
    lam_critic: float | None = option(
        None, "GAE lambda of the critic's targets, apart from the actor's advantages (VC-PPO's decoupled GAE uses 1); "
              "over macro actions like lam: the segment values' regression targets (none: lam)", ge=0, le=1)
    lam_schedule: LamSchedule = option(
        "constant", "the actor's GAE lambda: lam for every response (constant), or VAPO's 1 - 1 / (lam_alpha * l) "
                    "for a response of l macro actions (l tokens at ngram 1; clamped to [0, 1]; the critic's "
                    "targets keep lam_critic, or lam)")
    lam_alpha: float = option(0.05, "length_adaptive: alpha (VAPO: 0.05)", gt=0)
    critic_warmup_steps: int = option(
        0, "the first N PPO steps train only the critic on their rollouts, the policy frozen (VC-PPO's value "
           "pretraining; OpenRLHF's freezing_steps, verl's critic_warmup); counted in the step budget", ge=0)
    kl_target: float | None = option(
        None, "adapt the KL coefficient after every step towards this KL (objective/kl), starting from kl_coef "
              "(Ziegler et al. 2019; none: kl_coef stays fixed); logged as objective/kl_coef, kept in checkpoints",
        gt=0)
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
    kl_horizon: int = option(10000, "kl_target: the controller's horizon in responses (smaller reacts faster; "
                                    "must exceed 0.2 x the responses per step)", ge=1)
    value_weighting: ValueWeighting = option(
        "first", "a macro action's value from its token values: the first token's, the value of the state where "
                 "the macro action starts (first; not in the paper, the default since Study I, the credit-"
                 "assignment study), or the paper's: equal weights (equal), the last token only (unit), weights "
                 "growing towards the last token (position)")
    segment_reward: SegmentReward = option(
        "sum", "reward of a macro action: sum of its token rewards (paper), their mean (released code with equal "
               "values), or weighted like its value (released code: value_weighting's weights)")
    whiten_advantages: bool = option(False, "normalise advantages over the batch (the released runs do not)")
    advantage_mask_threshold: float | None = option(
        None, "SPO's probability mask, for any estimator: keep a token's advantage only where the sampling policy "
              "gave the sampled token probability below this, 0 elsewhere (after whitening; SPO: 0.9; none: off)",
        ge=0, le=1)

    # Losses.
    policy_loss: str = option(
        "ppo", "the policy loss (marlhf.policy_losses): ppo, the clipped surrogate with one ratio per macro action, "
               "a loss registered with register_policy_loss, or a dotted path package.module:function")
    policy_loss_options: dict[str, Any] | None = option(
        None, "the policy loss's own options that are not PPO options (a YAML mapping; marlhf.plugins)")
    clip_range: float = option(0.2, "PPO clip range of the policy ratio", gt=0)
    ratio_granularity: RatioGranularity = option(
        "macro", "clip one joint ratio per macro action (paper) or per-token ratios (released code)")
    segment_weighting: SegmentWeighting = option(
        "tokens", "policy loss over macro actions: each weighted by its token count (tokens), a plain mean over "
                  "macro actions (uniform, the paper's expectation), or token-count weights on the geometric mean "
                  "of the token ratios (geometric, GSPO's length-normalised ratio)")
    tis_cap: float | None = option(
        None, "truncated importance sampling for an engine whose numerics differ from the trainer's: weight the "
              "ppo loss of each unit (token, or macro action with macro ratios) by min(pi_trainer / pi_rollout, "
              "tis_cap), the trainer's recomputed old probability over the engine's sampling one (a product over "
              "a macro action's tokens); none: off", gt=0)
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

    # Asynchronous rollouts (marlhf.staleness, marlhf.engines.worker; docs/async.md).
    max_staleness: int = option(
        0, "sample step t's responses with the policy after step max(start, t - k) in rollout worker processes, "
           "which work k steps ahead while the trainer trains; the loss corrects for the lag (the ppo loss's "
           "staleness_correction and behaviour_cap). 0: each step samples with its own policy (synchronous)", ge=0)
    rollout_workers: int = option(
        0, "rollout engine processes per training process, each step's responses split between them (0: the "
           "engine runs in the trainer, between the other stages; max_staleness > 0 needs >= 1)", ge=0)
    rollout_worker_threads: int = option(1, "torch CPU threads of each rollout worker", ge=1)
    rollout_worker_timeout: float = option(
        600.0, "seconds a waiting trainer gives a silent rollout worker (no result, no request started) before "
               "it stops the run: a hung worker", gt=0)

    # LoRA (lora_r, lora_alpha, lora_target_modules: TrainingConfig).
    use_lora: bool = option(
        False, "train LoRA adapters on policy and critic; the reference is the policy with its adapters off "
               "(no second copy); the final policy is saved merged")

    HELP_SECTIONS = {
        "sampling": ("rollout_engine", "rollout_engine_options", "rollout_logprobs", "log_rollout_logprob_diff",
                     "logprob_temperature", "forward_batch_size",
                     "max_prompt_length", "long_prompts", "max_response_length", "max_length", "temperature", "top_k",
                     "top_p", "sampling_noise", "kv_cache"),
        "macro actions": ("termination", "termination_options", "ngram", "randomized_lengths", "repeat_times", "parsing_cutoff",
                          "parsing_language", "last_token_own_segment"),
        "rewards and advantages": ("reward", "reward_fns", "reward_weights", "advantage", "advantage_options",
                                   "num_samples_per_prompt",
                                   "grpo_normalize_std", "kl_coef", "kl_target", "kl_horizon", "rm_score_clip",
                                   "gamma", "lam", "lam_critic", "lam_schedule", "lam_alpha", "critic_warmup_steps",
                                   "value_weighting", "segment_reward", "whiten_advantages",
                                   "advantage_mask_threshold"),
        "losses": ("policy_loss", "policy_loss_options", "clip_range", "ratio_granularity", "segment_weighting",
                   "tis_cap", "loss_agg_mode", "value_clip_range",
                   "value_loss_granularity"),
        "asynchronous rollouts": ("max_staleness", "rollout_workers", "rollout_worker_threads",
                                  "rollout_worker_timeout"),
        "LoRA": ("use_lora", "lora_r", "lora_alpha", "lora_target_modules"),
    }

    def validate(self) -> None:
        super().validate()
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
        if self.kv_cache != "dynamic" and self.mixed_precision != "no":
            # transformers allocates a static cache in the model's dtype, and autocast hands it bf16/fp16 keys
            raise ValueError(f"kv_cache={self.kv_cache!r} needs mixed_precision='no' (got {self.mixed_precision!r}): "
                             "the static cache is allocated in the weights' dtype; use kv_cache='dynamic'")
        if self.policy_loss == "ppo":
            check_loss_options(self.loss_agg_mode, self.ratio_granularity, self.segment_weighting)
        else:
            check_loss_options(self.loss_agg_mode)
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_fns):
            raise ValueError(f"reward_weights ({len(self.reward_weights)}) must give one weight per reward_fns entry "
                             f"({len(self.reward_fns)})")
        for path in self.reward_fns:
            import_function(path, "reward_fns")  # a path that does not import stops here
        if self.logprob_temperature == "raw" and self.rollout_logprobs == "sampling":
            raise ValueError("logprob_temperature='raw' needs rollout_logprobs='recompute' (the sampling pass's "
                             "log-probs are under logits / temperature)")
        self._check_rollout_logprobs()
        if self.plugin("advantage").reads_entropy and self.rollout_logprobs == "sampling" and not \
                self.reuses_rollout_forward:
            raise ValueError(f"advantage={self.advantage!r} reads the policy's entropy at each token, which the "
                             "trainer's forward gives and rollout_logprobs='sampling' skips: use "
                             "rollout_logprobs='recompute'")
        if self.tis_cap is not None and "tis_cap" not in self.plugin("policy_loss").option_names:
            raise ValueError(f"tis_cap is an option of the ppo policy loss; policy_loss={self.policy_loss!r} does "
                             "not take it")
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ValueError(f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide "
                             f"mini_batch_size ({self.mini_batch_size})")
        if self.critic_warmup_steps and not self.uses_critic:
            raise ValueError(f"critic_warmup_steps={self.critic_warmup_steps} needs a critic; advantage="
                             f"{self.advantage!r} has none (use advantage='gae')")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef from its start value, which must be > 0 (got kl_coef=0)")
        if (self.min_generated_tokens is not None and self.max_generated_tokens is not None
                and self.min_generated_tokens > self.max_generated_tokens):
            raise ValueError(f"min_generated_tokens ({self.min_generated_tokens}) must be <= max_generated_tokens "
                             f"({self.max_generated_tokens})")
        if self.kl_target is not None:
            AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon, self.rollout_size)  # checks horizon

    def _check_rollout_logprobs(self) -> None:
        """The asynchronous rollouts' needs, and what comparing the engine's log-probs with the trainer's needs."""
        if self.max_staleness and not self.rollout_workers:
            raise ValueError(f"max_staleness={self.max_staleness} samples ahead of training in rollout worker "
                             "processes: set rollout_workers >= 1")
        if self.max_staleness and self.tis_cap is not None:
            raise ValueError("max_staleness > 0 corrects the rollout's lag and the engine's numerics together (the ppo "
                             "loss's staleness_correction, 'tis' for truncation): unset tis_cap")
        if self.compares_rollout_logprobs:
            what = ("max_staleness" if self.max_staleness else "log_rollout_logprob_diff"
                    if self.log_rollout_logprob_diff else "tis_cap")
            if self.rollout_logprobs == "sampling" and not self.reuses_rollout_forward:
                raise ValueError(f"{what} compares the engine's sampling log-probs with the trainer's, which "
                                 "rollout_logprobs='sampling' does not compute: use rollout_logprobs='recompute'")
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
        return self.log_rollout_logprob_diff or self.tis_cap is not None or self.max_staleness > 0

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

    # ---- plug-ins (marlhf.plugins) -------------------------------------------------------------------------
    def plugin(self, option: str) -> Plugin:
        """The plug-in that the option `option` (termination, advantage, policy_loss, rollout_engine) names."""
        return PLUGINS[option].get(getattr(self, option))

    def plugin_options(self, option: str) -> Any:
        """The named plug-in's options: PPO's own options of the same names, and the rest from its block."""
        plugin = self.plugin(option)
        own = {name: getattr(self, name) for name in plugin.option_names if name in self._field_set()}
        return plugin.make_options({**own, **(getattr(self, f"{option}_options") or {})})

    @classmethod
    def _field_set(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    def _check_plugins(self) -> None:
        """Each plug-in resolves and takes its options, and a block holds no PPO option. The hf engine's options
        set away from their defaults need the hf engine (another engine samples its own way); the other kinds'
        options may stay set for a plug-in not chosen (configs keep parsing_language for `--termination
        parsing`)."""
        for kind in PLUGINS:
            self.plugin(kind)  # an unknown name or a path that does not import stops here
            block = getattr(self, f"{kind}_options") or {}
            flat = sorted(set(block) & self._field_set())
            if flat:
                raise ValueError(f"{kind}_options: {flat[0]!r} is a PPO option: set it as {flat[0]} (or in a "
                                 f"'{kind}: {{name: ..., {flat[0]}: ...}}' block of a YAML config)")
            self.plugin_options(kind)  # unknown keys and wrong types stop here
        engine, hf = self.plugin("rollout_engine"), PLUGINS["rollout_engine"].get("hf")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in set(hf.option_names) - set(engine.option_names):
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} is the hf engine's option; rollout_engine="
                                 f"{self.rollout_engine!r} samples its own way")

    @classmethod
    def expand_values(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A plug-in given as a block, `termination: {name: fixed, ngram: 3}` (a YAML mapping, or its text from
        the command line), becomes the option naming it, PPO's own options in the block, and its
        `<option>_options` with the rest."""
        fields = cls._field_set()
        for kind in PLUGINS:
            block = values.get(kind)
            if isinstance(block, str) and block.lstrip().startswith("{"):
                block = coerce_option(kind, block, dict[str, Any])
            if not isinstance(block, dict):
                continue
            block = dict(block)
            if "name" not in block:
                raise ValueError(f"{kind}: a block needs the plug-in's name, e.g. '{kind}: {{name: ..., ...}}'")
            values[kind] = block.pop("name")
            extra = dict(values.get(f"{kind}_options") or {})
            for key, value in block.items():
                if key not in fields:
                    extra[key] = value
                elif key in values and values[key] != value:
                    raise ValueError(f"{key} is given twice: {values[key]!r} and {value!r} in the {kind} block")
                else:
                    values[key] = value
            if extra:
                values[f"{kind}_options"] = extra
        return values

    @classmethod
    def add_arguments(cls, parser) -> None:
        """The options, then the registered plug-ins of each kind with the options each takes (a plug-in named by
        dotted path on the command line is imported first, so it is listed too: import_named_plugins)."""
        super().add_arguments(parser)
        for kind, registry in PLUGINS.items():
            parser.add_argument_group(f"{kind} plug-ins (name (option=default, ...))",
                                      "; ".join(registry.get(name).describe() for name in registry.names()))

