"""MA-PPO: PPO whose actions are macro actions (segments of response tokens), and its baselines.

    policy = train_ppo(PPOConfig(model_name_or_path=SFT_DIR, reward_model_name_or_path=RM_DIR), records)

Models: the policy and a frozen reference both start from the SFT model (no reference when nothing reads
it: `kl_coef=0` and a reference-free termination rule); the critic starts from the
reward model (a ScalarHeadModel); the reward model is frozen. A reward function
`reward_fn(prompts, responses) -> scores` (a gold reward, unit tests), or a list of them, or `reward_fns` by
dotted path in TRL's convention `fn(prompts, completions, **record_fields)` (marlhf.rewards.functions), can
replace the reward model;
the critic then starts from the reward model if one is named, else from the SFT model with a fresh
value head.

Each step, top to bottom (the stages are the functions `make_experience`, `macro_actions`,
`estimate_advantages`, `ppo_update`, `step_metrics` over one `PPORun`):
  1. rollout: sample `num_samples_per_prompt` responses per prompt with the rollout engine
     (marlhf.engines), score them (log-probs of policy and reference, critic values, one score per
     response);
  2. per-token rewards: -kl_coef * (log pi - log pi_ref) on every token, score on the last token;
  3. macro actions: segment the responses with the termination rule (marlhf.termination: fixed /
     randomized n-grams, perplexity, parsing, word, or one of yours);
  4. advantages with the estimator (marlhf.estimators): GAE over segments (`advantage="gae"`;
     `termination="fixed", ngram=1` is token-level PPO), or a critic-free sequence estimator ("rloo",
     "grpo", "reinforce") on the summed reward;
  5. PPO epochs over shuffled mini-batches: clipped policy loss with one ratio per segment (also for
     the critic-free estimators: `ngram=None` gives a sequence-level ratio, `ngram=1` token-level
     ratios as in TRL's GRPO), clipped value loss on segment values;
  6. metrics, checkpoint.

Defaults follow the paper (SPEC.md) but one: a macro action's value is the value of the state where it
starts (`value_weighting="first"`), as the credit-assignment study's pre-registered rule decided (README);
`value_weighting="equal"` is the paper's. `ratio_granularity`, `segment_reward`, `last_token_own_segment`
and `rm_score_clip` reproduce the released code's choices instead; `segment_weighting` offers the study's
alternatives of the policy loss.

Data parallel (Accelerate): each process samples responses to its own prompts, every response from its own
random stream keyed by (seed, step, row among all processes' rows); baselines, whitening and the loss's
token normalisation span all processes. So N processes with P prompts each train like one process with
N x P prompts (exactly so when a step makes one update), and a resumed run samples what the uninterrupted
one sampled. Under DeepSpeed (ZeRO-2/3) policy and critic get an engine each, and each engine runs its own
backward and steps once per mini-batch (marlhf.trainers.common.backward, optimizer_step).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from marlhf._checks import check_like, check_mask, check_segment_ids, trusted_inputs
from marlhf.advantages import kl_penalized_rewards, whiten
from marlhf.config import TrainingConfig, option
from marlhf.data.encoding import prompt_token_ids
from marlhf.data.records import require_fields
from marlhf.engines import HFEngine, engine_class, get_engine
from marlhf.estimators import AdvantageBatch, get_estimator
from marlhf.imports import import_function
from marlhf.kl_control import AdaptiveKLController
from marlhf.logging_utils import reduce_metrics
from marlhf.losses import policy_loss, policy_loss_units, value_loss
from marlhf.metrics import row_l2, token_repetition
from marlhf.modeling import (AdaptersDisabled, ScalarHeadModel, apply_lora, load_causal_lm, load_tokenizer, merge_lora,
                             pad_sequences)
from marlhf.rewards import code_reward_fn
from marlhf.rewards.functions import RewardFunctions, takes_record_fields
from marlhf.rollout import (RewardFn, Rollout, length_sorted_chunks, response_logprobs, response_values,
                            score_responses, trim_padding)
from marlhf.segments import num_segments, split_last_token
from marlhf.termination import SegmentationBatch, get_termination, reads_reference, segment
from marlhf.trainers.common import (BatchPlan, FiniteUpdates, accumulation_context, backward, configure_deepspeed,
                                    make_accelerator, make_optimizer, make_scheduler, maybe_save_checkpoint,
                                    optimizer_step, records_from_config, save_final_model, start_run)


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
                                       "the policy, or an engine registered with register_engine")
    rollout_logprobs: Literal["recompute", "sampling"] = option(
        "recompute", "the rollout's policy log-probs: a forward pass over prompt + response (exact), or kept from "
                     "the sampling pass (one forward fewer per step, as TRL's PPO does; a KV-cached pass can differ "
                     "from a full forward, more so in bf16). One update per step takes them from the update's "
                     "forward either way")
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
    sampling_noise: Literal["row_generators", "counter_hash"] = option(
        "row_generators", "the hf engine's per-row Gumbel noise: one torch generator per row (B draws per token), "
                          "or a hash of (row seed, position, token) for all rows at once (for large GPU batches)")
    kv_cache: Literal["dynamic", "static", "static_compiled"] = option(
        "dynamic", "the hf engine's KV cache: grown each token (dynamic), allocated once (static), or static with "
                   "the decode step compiled by torch.compile (static_compiled); the same samples; static needs "
                   "mixed_precision no")

    # Macro actions.
    termination: str = option(
        "fixed", "macro-action termination rule: fixed, randomized, perplexity, parsing, word (one macro action per "
                 "word, read off the tokenizer's vocabulary), another rule registered with "
                 "marlhf.termination.register_termination, or a dotted path package.module:function")
    ngram: int | None = option(
        5, "fixed: tokens per macro action (1: token-level PPO; none: the whole response is one action)", ge=1)
    randomized_lengths: tuple[int, ...] = option((2, 3, 5, 10), "randomized: segment lengths to draw from", ge=1)
    repeat_times: int = option(3, "randomized: how often the list of lengths is repeated before shuffling", ge=1)
    parsing_cutoff: int = option(5, "parsing: a subtree with at most this many parser leaves is one action", ge=1)
    parsing_language: Literal["auto", "python", "text"] = option(
        "auto", "parsing: parser to use (auto: Python if the response parses as code)")
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
        "gae", "gae: critic + GAE over macro actions; rloo/grpo/reinforce: critic-free sequence advantages; or an "
               "estimator registered with marlhf.estimators.register_estimator")
    num_samples_per_prompt: int = option(1, "responses sampled per prompt (rloo and grpo need >= 2)", ge=1)
    grpo_normalize_std: bool = option(True, "grpo: divide by the group's standard deviation")
    kl_coef: float = option(0.05, "KL penalty coefficient (k1 estimator, on every token); 0 with a termination "
                                   "rule that does not read the reference drops the reference model (no "
                                   "forward, no copy; objective/kl is then not logged)", ge=0)
    rm_score_clip: float | None = option(
        None, "clip reward scores to [-c, c] before use (the released code uses 2.5; none: no clipping)", gt=0)
    gamma: float = option(1.0, "discount over macro actions", ge=0, le=1)
    lam: float = option(0.95, "GAE lambda over macro actions", ge=0, le=1)
    lam_critic: float | None = option(
        None, "GAE lambda of the critic's targets, apart from the actor's advantages (VC-PPO's decoupled GAE uses 1); "
              "over macro actions like lam: the segment values' regression targets (none: lam)", ge=0, le=1)
    lam_schedule: Literal["constant", "length_adaptive"] = option(
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
    kl_horizon: int = option(10000, "kl_target: the controller's horizon in responses (smaller reacts faster; "
                                    "must exceed 0.2 x the responses per step)", ge=1)
    value_weighting: Literal["equal", "unit", "position", "first"] = option(
        "first", "a macro action's value from its token values: the first token's, the value of the state where "
                 "the macro action starts (first; not in the paper, the default since the README's credit-"
                 "assignment study), or the paper's: equal weights (equal), the last token only (unit), weights "
                 "growing towards the last token (position)")
    segment_reward: Literal["sum", "mean", "weighted"] = option(
        "sum", "reward of a macro action: sum of its token rewards (paper), their mean (released code with equal "
               "values), or weighted like its value (released code: value_weighting's weights)")
    whiten_advantages: bool = option(False, "normalise advantages over the batch (the released runs do not)")

    # Losses.
    clip_range: float = option(0.2, "PPO clip range of the policy ratio", gt=0)
    ratio_granularity: Literal["macro", "token"] = option(
        "macro", "clip one joint ratio per macro action (paper) or per-token ratios (released code)")
    segment_weighting: Literal["tokens", "uniform", "geometric"] = option(
        "tokens", "policy loss over macro actions: each weighted by its token count (tokens), a plain mean over "
                  "macro actions (uniform, the paper's expectation), or token-count weights on the geometric mean "
                  "of the token ratios (geometric, GSPO's length-normalised ratio)")
    value_clip_range: float | None = option(
        0.2, "clip range of the critic around its rollout values, as in the released code (none: off)", gt=0)
    value_loss_granularity: Literal["segment", "token"] = option(
        "segment", "critic loss: each macro action's weighted value regressed to its return (paper), or each "
                   "token's value regressed to its macro action's return (released code)")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = option(
        "token-mean", "how policy and value losses are averaged (verl's names): one mean over the mini-batch's "
                      "tokens, or over responses of each response's token mean (the released runs: batch size 1 "
                      "with accumulation) or token sum")
    logprob_temperature: Literal["sampling", "raw"] = option(
        "sampling", "log-probs for the ratio, the KL penalty and the perplexity rule from logits / temperature "
                    "(the distribution sampled from) or from raw logits (the released code)")

    # LoRA (lora_r, lora_alpha, lora_target_modules: TrainingConfig).
    use_lora: bool = option(
        False, "train LoRA adapters on policy and critic; the reference is the policy with its adapters off "
               "(no second copy); the final policy is saved merged")

    HELP_SECTIONS = {
        "sampling": ("rollout_engine", "rollout_logprobs", "logprob_temperature", "forward_batch_size",
                     "max_prompt_length", "long_prompts", "max_response_length", "max_length", "temperature", "top_k",
                     "top_p", "sampling_noise", "kv_cache"),
        "macro actions": ("termination", "ngram", "randomized_lengths", "repeat_times", "parsing_cutoff",
                          "parsing_language", "last_token_own_segment"),
        "rewards and advantages": ("reward", "reward_fns", "reward_weights", "advantage", "num_samples_per_prompt",
                                   "grpo_normalize_std", "kl_coef", "kl_target", "kl_horizon", "rm_score_clip",
                                   "gamma", "lam", "lam_critic", "lam_schedule", "lam_alpha", "critic_warmup_steps",
                                   "value_weighting", "segment_reward", "whiten_advantages"),
        "losses": ("clip_range", "ratio_granularity", "segment_weighting", "loss_agg_mode", "value_clip_range",
                   "value_loss_granularity"),
        "LoRA": ("use_lora", "lora_r", "lora_alpha", "lora_target_modules"),
    }

    def validate(self) -> None:
        super().validate()
        if self.max_prompt_length + self.max_response_length > self.max_length:
            raise ValueError(f"max_prompt_length + max_response_length ({self.max_prompt_length} + "
                             f"{self.max_response_length}) must be <= max_length ({self.max_length})")
        minimum = get_estimator(self.advantage).min_samples_per_prompt
        if self.num_samples_per_prompt < minimum:
            raise ValueError(f"advantage={self.advantage!r} needs num_samples_per_prompt >= {minimum}, "
                             f"got {self.num_samples_per_prompt}")
        if self.rollout_size % self.mini_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must divide the responses per step "
                             f"(per_device_batch_size x num_samples_per_prompt = {self.rollout_size})")
        get_termination(self.termination)  # an unknown name or a path that does not import stops here
        engine_class(self.rollout_engine)  # an unknown name stops here
        if self.kv_cache != "dynamic" and self.mixed_precision != "no":
            # transformers allocates a static cache in the model's dtype, and autocast hands it bf16/fp16 keys
            raise ValueError(f"kv_cache={self.kv_cache!r} needs mixed_precision='no' (got {self.mixed_precision!r}): "
                             "the static cache is allocated in the weights' dtype; use kv_cache='dynamic'")
        hf_options = {f.name: f.default for f in dataclasses.fields(self) if f.name in ("sampling_noise", "kv_cache")}
        for name, default in hf_options.items():
            if getattr(self, name) != default and not issubclass(engine_class(self.rollout_engine), HFEngine):
                raise ValueError(f"{name}={getattr(self, name)!r} is the hf engine's option; rollout_engine="
                                 f"{self.rollout_engine!r} samples its own way")
        if self.segment_weighting != "tokens" and self.ratio_granularity == "token":
            raise ValueError(f"segment_weighting={self.segment_weighting!r} needs ratio_granularity='macro'")
        if self.loss_agg_mode != "token-mean" and self.segment_weighting != "tokens":
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} needs segment_weighting='tokens'")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_fns):
            raise ValueError(f"reward_weights ({len(self.reward_weights)}) must give one weight per reward_fns entry "
                             f"({len(self.reward_fns)})")
        for path in self.reward_fns:
            import_function(path, "reward_fns")  # a path that does not import stops here
        if self.logprob_temperature == "raw" and self.rollout_logprobs == "sampling":
            raise ValueError("logprob_temperature='raw' needs rollout_logprobs='recompute' (the sampling pass's "
                             "log-probs are under logits / temperature)")
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ValueError(f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide "
                             f"mini_batch_size ({self.mini_batch_size})")
        critic_options = {"lam_critic": self.lam_critic is not None, "lam_schedule": self.lam_schedule != "constant",
                          "critic_warmup_steps": self.critic_warmup_steps > 0}
        for name in (name for name, is_set in critic_options.items() if is_set):
            if not self.uses_critic:
                raise ValueError(f"{name}={getattr(self, name)!r} needs a critic; advantage={self.advantage!r} has "
                                 "none (use advantage='gae')")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef from its start value, which must be > 0 (got kl_coef=0)")
        if self.kl_target is not None:
            AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon, self.rollout_size)  # checks horizon

    @property
    def rollout_size(self) -> int:
        """Responses sampled per PPO step on each process."""
        return self.per_device_batch_size * self.num_samples_per_prompt

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probs are taken at (ratio, KL penalty, perplexity rule)."""
        return self.temperature if self.logprob_temperature == "sampling" else 1.0

    @property
    def uses_critic(self) -> bool:
        return get_estimator(self.advantage).needs_critic

    @property
    def uses_reference(self) -> bool:
        """Whether anything reads the frozen reference: the KL penalty, or a termination rule that reads its
        log-probs (perplexity, or any rule not registered as reference-free). Without one, PPO neither keeps
        nor runs it (TRL's GRPO does the same at beta 0)."""
        return self.kl_coef > 0 or reads_reference(self.termination)

    @property
    def reuses_rollout_forward(self) -> bool:
        """One update per step, of the whole rollout in one piece: the rollout's policy and critic forwards
        then run with gradients and the update backpropagates through them instead of running them again
        (the weights do not change in between, so this is exact). Both graphs are held at once."""
        return (self.ppo_epochs == 1 and self.mini_batch_size == self.rollout_size
                and self.gradient_accumulation_steps == 1)


def macro_actions(config: PPOConfig, rollout: Rollout, tokenizer, accelerator,
                  step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Segment ids of the responses under the termination rule (marlhf.termination), and the rule's stats
    (the parsing rule: how many rows fell back to one token per segment)."""
    mask = rollout.response_mask
    batch = SegmentationBatch(rollout.response_ids, mask, rollout.ref_logprobs, tokenizer, config,
                              seed=_seed(config.seed, step), gather_rows=lambda x: _gather_rows(accelerator, x),
                              own_rows=lambda x: _own_rows(accelerator, x, like=mask))
    segment_ids, stats = segment(config.termination, batch)
    if config.last_token_own_segment:
        segment_ids = split_last_token(segment_ids, mask)
    return segment_ids, stats


def _seed(*numbers: int) -> int:
    """A well-mixed 32-bit seed from several integers (run seed, step, row)."""
    return int(np.random.SeedSequence(list(numbers)).generate_state(1)[0])


def _gather_rows(accelerator, x: torch.Tensor) -> torch.Tensor:
    """The rows of every process stacked in process order ([B, T] rows right-padded to one width)."""
    if x.dim() == 2:
        x = accelerator.pad_across_processes(x, dim=1)
    return accelerator.gather(x)


def _own_rows(accelerator, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's rows of a `_gather_rows` result, cut to the width of `like`."""
    start = accelerator.process_index * like.shape[0]
    x = x[start : start + like.shape[0]]
    return x[:, : like.shape[1]] if x.dim() == 2 else x


def _tokenize_prompts(records: list[dict[str, Any]], tokenizer, config: PPOConfig,
                      accelerator) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The records kept and their prompts' token ids; a prompt over max_prompt_length tokens is dropped or cut
    (long_prompts), and counted."""
    kept, token_ids, long = [], [], 0
    limit = config.max_prompt_length
    for record in records:
        ids = tokenizer(record["prompt"])["input_ids"]
        if len(ids) > limit:
            long += 1
            if config.long_prompts == "drop":
                continue
            ids = prompt_token_ids(tokenizer, record["prompt"], limit)
        kept.append(record)
        token_ids.append(ids)
    if long:
        action = "dropped" if config.long_prompts == "drop" else "truncated"
        accelerator.print(f"ppo: {action} {long} of {len(records)} prompts longer than {limit} tokens")
    if not kept:
        raise ValueError(f"every prompt is longer than max_prompt_length={limit} tokens (long_prompts='drop'; "
                         "'truncate' keeps their last tokens)")
    return kept, token_ids


def _disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """PPO's ratio compares the rollout's log-probs with the update's forward of the same weights; dropout
    would make them differ (the update runs in train mode, which gradient checkpointing needs)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _frozen(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    return model.requires_grad_(False).eval().to(device)


@dataclasses.dataclass
class PPORun:
    """What every stage of a PPO step uses: the config, the models (prepared by Accelerate), the rollout
    engine, the tokenized prompts and the batch plan."""

    config: PPOConfig
    accelerator: Any
    tokenizer: Any
    policy: torch.nn.Module
    critic: torch.nn.Module | None
    ref: Any
    reward_model: ScalarHeadModel | None
    reward_fn: RewardFn | None
    engine: Any
    updaters: list  # (model, optimizer, scheduler, finite-update guard) of the policy, then the critic
    prompt_records: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    plan: BatchPlan
    piece_size: int  # rows per forward pass in the update
    eos_token_id: Any
    kl_control: AdaptiveKLController | None = None  # None: config.kl_coef throughout

    @property
    def kl_coef(self) -> float:
        """The KL coefficient of the current step."""
        return self.config.kl_coef if self.kl_control is None else self.kl_control.value

    def train(self, mode: bool = True) -> None:
        for model, *_ in self.updaters:
            model.train(mode)


def make_experience(run: PPORun, step: int, clock: dict[str, float]) -> tuple[Rollout, tuple | None]:
    """Stage 1: sample the step's responses (the samples of one prompt are consecutive rows) and score them.

    Returns the rollout and, when one update reuses the rollout's forwards (`reuses_rollout_forward`), the
    policy log-probs and critic values computed with gradients (else None). Records `generation` and
    `scoring` end times in `clock`."""
    config, accelerator, tokenizer = run.config, run.accelerator, run.tokenizer
    device = accelerator.device
    rows = [i for i in run.plan.micro_batches(step)[0] for _ in range(config.num_samples_per_prompt)]
    query_ids, query_mask = pad_sequences([run.prompt_ids[i] for i in rows], tokenizer.pad_token_id, "left")
    query_ids, query_mask = query_ids.to(device), query_mask.bool().to(device)
    # One random stream per response, keyed by its row among all processes' rows: the samples do not
    # depend on the number of processes, and a resumed run draws what the uninterrupted one drew.
    first_row = accelerator.process_index * config.rollout_size
    row_seeds = [_seed(config.seed, step, first_row + row) for row in range(config.rollout_size)]
    run.train(False)  # generate with the KV cache (train mode with gradient checkpointing turns it off)
    run.engine.sync_weights(accelerator.unwrap_model(run.policy))
    kept = None
    hf_options = (dict(sampling_noise=config.sampling_noise, kv_cache=config.kv_cache)
                  if isinstance(run.engine, HFEngine) else {})
    with accelerator.autocast():
        response_ids, response_mask, *sampled_logprobs = run.engine.generate(
            query_ids, query_mask, row_seeds=row_seeds,
            max_new_tokens=config.max_response_length,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            eos_token_id=run.eos_token_id, pad_token_id=tokenizer.pad_token_id, **hf_options,
            return_logprobs=config.rollout_logprobs == "sampling" and not config.reuses_rollout_forward)
        clock["generation"] = _clock(device)
        batch = (query_ids, query_mask, response_ids, response_mask)
        if config.reuses_rollout_forward:  # with gradients: these are the update's forwards too
            run.train()
            kept = (response_logprobs(run.policy, *batch, temperature=config.scoring_temperature),
                    response_values(run.critic, *batch) if run.critic is not None else None)
            trained_outputs = dict(logprobs=kept[0], values=kept[1])
        elif sampled_logprobs:
            trained_outputs = dict(logprobs=sampled_logprobs[0], critic=run.critic)
        else:
            trained_outputs = dict(policy=run.policy, critic=run.critic)
        rollout = score_responses(
            *batch, ref=run.ref, temperature=config.scoring_temperature, reward_model=run.reward_model,
            reward_fn=run.reward_fn, prompts=[run.prompt_records[i]["prompt"] for i in rows], tokenizer=tokenizer,
            reward_kwargs=_record_fields(run, rows),
            chunk_size=config.forward_batch_size or run.piece_size, **trained_outputs)
    clock["scoring"] = _clock(device)
    return rollout, kept


def _record_fields(run: PPORun, rows: list[int]) -> dict[str, list] | None:
    """The rows' record fields other than the prompt, a list each, for a reward function in TRL's convention."""
    if run.reward_fn is None or not takes_record_fields(run.reward_fn):
        return None
    names = sorted({name for i in rows for name in run.prompt_records[i]} - {"prompt"})
    return {name: [run.prompt_records[i].get(name) for i in rows] for name in names}


def estimate_advantages(run: PPORun, rollout: Rollout, rewards: torch.Tensor,
                        segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 4: the estimator's advantages (and returns, with a critic), whitened if asked. Batch statistics
    (baselines, whitening) are taken over the rows of all processes."""
    accelerator, mask = run.accelerator, rollout.response_mask
    advantages, returns = get_estimator(run.config.advantage).fn(AdvantageBatch(
        rewards, rollout.values, mask, segment_ids, run.config, gather_rows=lambda x: _gather_rows(accelerator, x),
        own_rows=lambda x: _own_rows(accelerator, x, like=mask)))
    if run.config.whiten_advantages:
        all_advantages = whiten(_gather_rows(accelerator, advantages), _gather_rows(accelerator, mask))
        advantages = _own_rows(accelerator, all_advantages, like=mask)
    return advantages, returns


def ppo_update(run: PPORun, rollout: Rollout, segment_ids: torch.Tensor, advantages: torch.Tensor,
               returns: torch.Tensor | None, kept: tuple | None, train_policy: bool = True) -> dict[str, list[torch.Tensor]]:
    """Stage 5: PPO epochs over shuffled mini-batches, each split into length-sorted pieces; one optimizer
    step of policy (and critic) per mini-batch. `kept`: the rollout's forwards with gradients, used instead of
    new ones (one update per step). `train_policy=False` (critic warm-up) updates the critic alone. Returns each
    loss statistic per piece.

    No device read inside the pieces: the inputs are checked once here and the pieces' sizes come from host
    lengths; each optimizer step reads one number, the finite-update guard's gradient norm (a NaN or inf one
    skips the step)."""
    config, accelerator, policy, critic = run.config, run.accelerator, run.policy, run.critic
    device, mask = accelerator.device, rollout.response_mask
    _check_update_inputs(rollout, segment_ids, advantages, returns)
    segment_counts = num_segments(segment_ids).tolist()  # per row, on the host: each piece's segment slots
    run.train()
    update_stats: dict[str, list[torch.Tensor]] = {}
    with trusted_inputs():
        for _ in range(config.ppo_epochs):
            order = torch.randperm(config.rollout_size).tolist()  # a CPU tensor: no device read
            for start in range(0, config.rollout_size, config.mini_batch_size):
                mini_batch_rows = order[start : start + config.mini_batch_size]
                mini_batch = torch.tensor(mini_batch_rows, device=device)
                # The losses are means per piece (over tokens, or segments or responses: policy_loss_units);
                # weighting each by its share of the mini-batch's units on all processes makes the update one
                # mean over the whole mini-batch (DDP averages the processes' gradients, hence num_processes).
                if critic is not None:
                    num_value_units = accelerator.reduce(policy_loss_units(
                        mask[mini_batch], None, "tokens", config.loss_agg_mode), reduction="sum")
                num_policy_units = accelerator.reduce(policy_loss_units(
                    mask[mini_batch], segment_ids[mini_batch], config.segment_weighting, config.loss_agg_mode),
                    reduction="sum")
                # Rows of similar length share a piece and the columns all its rows pad are cut: the update is
                # a token sum, which does not depend on how the mini-batch is split.
                chunks = length_sorted_chunks([rollout.query_lengths[row] for row in mini_batch_rows],
                                              [rollout.response_lengths[row] for row in mini_batch_rows],
                                              run.piece_size)
                for piece_index, chunk in enumerate(chunks):
                    is_last_piece = piece_index == len(chunks) - 1
                    piece_rows = [mini_batch_rows[i] for i in chunk]
                    piece = torch.tensor(piece_rows, device=device)
                    num_slots = max(segment_counts[row] for row in piece_rows)
                    policy_weight = policy_loss_units(mask[piece], segment_ids[piece], config.segment_weighting,
                                                      config.loss_agg_mode) * accelerator.num_processes / num_policy_units
                    inputs = trim_padding(rollout.query_ids[piece], rollout.query_mask[piece],
                                          rollout.response_ids[piece], mask[piece],
                                          [rollout.query_lengths[row] for row in piece_rows],
                                          [rollout.response_lengths[row] for row in piece_rows])
                    piece_mask = inputs[3]
                    cols = slice(0, piece_mask.shape[1])  # the piece's per-token tensors lose the cut columns too
                    stats = {}
                    if train_policy:
                        with accumulation_context(accelerator, policy, is_last_piece):
                            logprobs = kept[0][piece, cols] if kept is not None else response_logprobs(
                                policy, *inputs, temperature=config.scoring_temperature)
                            pg_loss, pg_stats = policy_loss(logprobs, rollout.logprobs[piece, cols],
                                                            advantages[piece, cols], piece_mask,
                                                            segment_ids[piece, cols], config.clip_range,
                                                            config.ratio_granularity, config.segment_weighting,
                                                            config.loss_agg_mode, num_slots)
                            backward(accelerator, policy, pg_loss * policy_weight, is_last_piece)
                        stats = {"loss/policy": pg_loss.detach(), "policy/clipfrac": pg_stats["clipfrac"],
                                 "policy/approxkl": pg_stats["approxkl"]}
                    if critic is not None:
                        value_weight = policy_loss_units(mask[piece], None, "tokens", config.loss_agg_mode
                                                         ) * accelerator.num_processes / num_value_units
                        with accumulation_context(accelerator, critic, is_last_piece):
                            values = kept[1][piece, cols] if kept is not None else response_values(critic, *inputs)
                            value_segments = (segment_ids[piece, cols] if config.value_loss_granularity == "segment"
                                              else None)
                            vf_loss, vf_stats = value_loss(values, rollout.values[piece, cols], returns[piece, cols],
                                                           piece_mask, value_segments, config.value_clip_range,
                                                           config.value_weighting, config.loss_agg_mode, num_slots)
                            backward(accelerator, critic, vf_loss * value_weight, is_last_piece)
                        stats.update({"loss/value": vf_loss.detach(), "val/clipfrac": vf_stats["vf_clipfrac"]})
                    for name, value in stats.items():
                        update_stats.setdefault(name, []).append(value)
                # the policy's updater comes first; in the critic warm-up neither its optimizer nor its scheduler steps
                for model, optimizer, scheduler, guard in run.updaters[0 if train_policy else 1:]:
                    optimizer_step(accelerator, model, optimizer, scheduler, config.max_grad_norm, guard)
    return update_stats


def _check_update_inputs(rollout: Rollout, segment_ids: torch.Tensor, advantages: torch.Tensor,
                         returns: torch.Tensor | None) -> None:
    """What the update's pieces slice, checked once per step: the pieces then skip the value checks."""
    mask = rollout.response_mask
    check_mask(mask, "response_mask")
    check_segment_ids(segment_ids, mask)
    for name, x in (("logprobs", rollout.logprobs), ("values", rollout.values), ("advantages", advantages),
                    ("returns", returns)):
        if x is not None:
            check_like(x, mask, name)


def per_token_rewards(rollout: Rollout, scores: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Stage 2: the KL-penalised per-token rewards (without a reference the penalty is 0: kl_coef is 0)."""
    ref_logprobs = rollout.ref_logprobs if rollout.ref_logprobs is not None else rollout.logprobs
    return kl_penalized_rewards(scores, rollout.logprobs, ref_logprobs, rollout.response_mask, kl_coef)


def adapt_kl_coef(run: PPORun, rollout: Rollout) -> None:
    """After a step under `kl_target`: move the KL coefficient with the step's KL over all processes' responses
    (one read to the host per step)."""
    mask = rollout.response_mask
    row_kl = torch.where(mask, rollout.logprobs - rollout.ref_logprobs, 0.0).sum(1)
    run.kl_control.update(run.accelerator.gather(row_kl).float().mean().item())


def step_metrics(run: PPORun, rollout: Rollout, segment_ids: torch.Tensor, segmentation_stats: dict[str, float],
                 advantages: torch.Tensor, returns: torch.Tensor | None, update_stats: dict[str, list[torch.Tensor]],
                 clock: dict[str, float]) -> dict[str, float]:
    """Stage 6: the step's metrics, reduced over processes (the one place a step reads values to the host)."""
    mask = rollout.response_mask
    # KL (with a reference) and entropy: sample estimates summed over each response's tokens, averaged over
    # responses.
    metrics = {} if rollout.ref_logprobs is None else {
        "objective/kl": torch.where(mask, rollout.logprobs - rollout.ref_logprobs, 0.0).sum(1).mean()}
    metrics |= {
        "objective/entropy": torch.where(mask, -rollout.logprobs, 0.0).sum(1).mean(),
        "objective/rm_score": rollout.scores.mean(),
        "objective/response_length": mask.sum(1).float().mean(),
        "objective/repetition": token_repetition(rollout.response_ids, mask).mean(),
        **{name: torch.stack(values).mean() for name, values in update_stats.items()},
        "val/advantage_l2": row_l2(advantages, mask),
        "macro/mean_segment_length": mask.sum() / num_segments(segment_ids).sum(),
        "time/generation": clock["generation"] - clock["start"],
        "time/scoring": clock["scoring"] - clock["generation"],
        "time/update": clock["update"] - clock["scoring"],
        "time/step_seconds": _clock(run.accelerator.device) - clock["start"],
        "train/skipped_steps": sum(guard.skipped for *_, guard in run.updaters),
    }
    if returns is not None:
        metrics["val/return_l2"] = row_l2(returns, mask)
    metrics.update({f"macro/{name}": value for name, value in segmentation_stats.items()})
    metrics.update({f"rewards/{name}": value for name, value in getattr(run.reward_fn, "last_means", {}).items()})
    return reduce_metrics(metrics, run.accelerator)


def train_ppo(config: PPOConfig, prompts: list[dict[str, Any]] | None = None, policy=None, ref=None,
              critic: ScalarHeadModel | None = None, reward_model: ScalarHeadModel | None = None, tokenizer=None,
              reward_fn: RewardFn | list[RewardFn] | None = None):
    """Train the policy with (MA-)PPO on `prompts` ({"prompt": ...} records; default: config.dataset) and
    return it unwrapped. Models not passed in are loaded from the config's paths (`ref` is not used when
    `config.uses_reference` is False); `reward_fn` replaces the reward model as the source of scores.
    Metrics go to OUTPUT_DIR/metrics.jsonl (see logging_utils)."""
    accelerator = make_accelerator(config)
    device = accelerator.device
    records = prompts if prompts is not None else records_from_config(config, "rl")
    require_fields(records, ("prompt",), "rl")

    # ---- models ------------------------------------------------------------------------------
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path, "left")
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs a pad token (marlhf.modeling.load_tokenizer sets pad := eos)")
    if policy is None:
        policy = load_causal_lm(config.model_name_or_path, config.dtype, config.gradient_checkpointing)
    if reward_fn is None and config.reward_fns:
        reward_fn = RewardFunctions.from_paths(config.reward_fns, config.reward_weights)
    elif isinstance(reward_fn, (list, tuple)):  # several functions from Python
        reward_fn = RewardFunctions(reward_fn, config.reward_weights)
    if reward_fn is None and config.reward == "code":
        reward_fn = code_reward_fn(records)
    if reward_fn is None:
        if reward_model is None:
            if config.reward_model_name_or_path is None:
                raise ValueError("reward_model_name_or_path is required when no reward model or reward_fn is given")
            reward_model = ScalarHeadModel.from_pretrained(config.reward_model_name_or_path, config.dtype)
        reward_model = _frozen(reward_model, device)
    if config.uses_critic and critic is None:
        critic_path = config.critic_model_name_or_path or config.reward_model_name_or_path
        if critic_path is not None:
            critic = ScalarHeadModel.from_pretrained(critic_path, config.dtype, config.gradient_checkpointing)
        elif reward_model is not None:
            critic = copy.deepcopy(reward_model).requires_grad_(True)
        else:  # the SFT model's transformer with a fresh value head
            critic = ScalarHeadModel(copy.deepcopy(policy.base_model))
    if config.gradient_checkpointing:  # also for models passed in, and a critic copied from the reward model
        for model in (policy, critic):
            if model is not None:
                model.activation_checkpointing_enable()
    # The reference is the SFT model, before any update (when resuming, the checkpoint is loaded later).
    if config.use_lora:
        policy = apply_lora(policy, config)
        critic = apply_lora(critic, config) if critic is not None else None
    if not config.uses_reference:
        ref = None  # nothing reads it: kl_coef is 0 and the termination rule is reference-free
    elif ref is None:
        ref = AdaptersDisabled(policy) if config.use_lora else copy.deepcopy(policy)
    if isinstance(ref, torch.nn.Module):
        ref = _frozen(ref, device)
    policy = _disable_dropout(policy)
    if critic is not None:
        critic = _disable_dropout(critic)

    # ---- data, optimisers, resume ------------------------------------------------------------
    prompt_records, prompt_ids = _tokenize_prompts(records, tokenizer, config, accelerator)
    # A step takes per_device_batch_size prompts; gradient accumulation splits the PPO mini-batches instead.
    plan = BatchPlan(len(prompt_ids), dataclasses.replace(config, gradient_accumulation_steps=1), accelerator)
    updates_per_step = config.ppo_epochs * (config.rollout_size // config.mini_batch_size)
    piece_size = config.mini_batch_size // config.gradient_accumulation_steps  # rows per forward in the update
    policy_optimizer = make_optimizer(policy, config)
    policy_scheduler = make_scheduler(policy_optimizer, config, plan.total_steps * updates_per_step)
    # Under DeepSpeed policy and critic get an engine each (the critic's prepare logs that Accelerate's own
    # backward stays tied to the policy's engine: ppo_update calls each engine's backward itself).
    configure_deepspeed(accelerator, config, piece_size)
    policy, policy_optimizer = accelerator.prepare(policy, policy_optimizer)
    models, optimizers, schedulers = {"policy": policy}, {"policy": policy_optimizer}, {"policy": policy_scheduler}
    if config.uses_critic:
        critic_config = dataclasses.replace(config, learning_rate=config.critic_learning_rate)
        critic_optimizer = make_optimizer(critic, critic_config)
        critic_scheduler = make_scheduler(critic_optimizer, config, plan.total_steps * updates_per_step)
        critic, critic_optimizer = accelerator.prepare(critic, critic_optimizer)
        models["critic"], optimizers["critic"], schedulers["critic"] = critic, critic_optimizer, critic_scheduler
    updaters = [(models[name], optimizers[name], schedulers[name], FiniteUpdates(config.nonfinite_skip_limit))
                for name in models]
    kl_control = None
    if config.kl_target is not None:  # checkpointed beside the learning-rate schedulers
        kl_control = schedulers["kl_coef"] = AdaptiveKLController(
            config.kl_coef, config.kl_target, config.kl_horizon, config.rollout_size * accelerator.num_processes)
    start_step, logger = start_run(config, accelerator, models, optimizers, schedulers)
    eos_token_id = accelerator.unwrap_model(policy).generation_config.eos_token_id
    if eos_token_id is None:
        eos_token_id = tokenizer.eos_token_id

    run = PPORun(config, accelerator, tokenizer, policy, critic, ref, reward_model, reward_fn,
                 get_engine(config.rollout_engine), updaters, prompt_records, prompt_ids, plan, piece_size, eos_token_id,
                 kl_control)
    progress = tqdm(range(start_step, plan.total_steps), initial=start_step, total=plan.total_steps, desc="ppo",
                    disable=not accelerator.is_local_main_process)
    for step in progress:
        clock = {"start": _clock(device)}
        rollout, kept = make_experience(run, step, clock)  # 1. sample and score
        mask = rollout.response_mask
        scores = rollout.scores
        if config.rm_score_clip is not None:
            scores = scores.clamp(-config.rm_score_clip, config.rm_score_clip)
        kl_coef = run.kl_coef
        rewards = per_token_rewards(rollout, scores, kl_coef)  # 2.
        segment_ids, segmentation_stats = macro_actions(config, rollout, tokenizer, accelerator, step)  # 3.
        advantages, returns = estimate_advantages(run, rollout, rewards, segment_ids)  # 4.
        update_stats = ppo_update(run, rollout, segment_ids, advantages, returns, kept,  # 5.
                                  train_policy=step >= config.critic_warmup_steps)
        if kl_control is not None:
            adapt_kl_coef(run, rollout)
        clock["update"] = _clock(device)

        done = step + 1  # 6. metrics and checkpoint
        if done % config.logging_steps == 0 or done == plan.total_steps:
            metrics = step_metrics(run, rollout, segment_ids, segmentation_stats, advantages, returns, update_stats,
                                   clock)
            if kl_control is not None:
                metrics["objective/kl_coef"] = kl_coef
            logger.log(metrics, done)
            postfix = {"reward": f"{metrics['objective/rm_score']:.3f}"}
            if "objective/kl" in metrics:
                postfix["kl"] = f"{metrics['objective/kl']:.3f}"
            progress.set_postfix(**postfix)
        maybe_save_checkpoint(config, done, accelerator, models, optimizers, schedulers, tokenizer)

    logger.close()
    trained = policy  # as prepared: under ZeRO-3 the final weights are gathered through the policy's engine
    policy = accelerator.unwrap_model(policy)
    if config.use_lora:  # a plain model with the adapters merged in; the trained adapters stay as they are
        trained = policy = merge_lora(policy)
    save_final_model(trained, tokenizer, config.output_dir, accelerator)
    return policy
