"""What `train_ppo` sets up before its first step: the plug-ins (`Plugins`), the reward source, the models, the
tokenized prompts, the optimisers and schedulers prepared by Accelerate (`Updater`), and the `PPORun` that every
stage of a step reads."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Literal

import numpy as np
import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from marlhf.data.encoding import prompt_token_ids
from marlhf.engines import EngineContext, RolloutEngine
from marlhf.kl_control import AdaptiveKLController
from marlhf.modeling import AdaptersDisabled, ScalarHeadModel, apply_lora, load_causal_lm
from marlhf.multiturn import EpisodeSpec
from marlhf.plugins import Plugin
from marlhf.rewards import code_reward_fn
from marlhf.rewards.functions import RewardFunctions, takes_record_fields
from marlhf.rollout import RewardFn
from marlhf.logging_utils import MetricsLogger
from marlhf.trainers.common import (BatchPlan, FiniteUpdates, configure_deepspeed, make_optimizer, make_scheduler,
                                    start_run)
from marlhf.trainers.ppo_config import PPOConfig
from marlhf.trainers.staleness import StaleRollouts
from marlhf.trainers.token_budget import GeneratedTokens

__all__ = ["Chosen", "Plugins", "Updater", "PPOModels", "PPORun", "reward_source", "build_models",
           "tokenize_prompts", "prepare_training", "checkpointed", "start_ppo_run", "eos_token_id", "mixed_seed"]


@dataclasses.dataclass(frozen=True)
class Chosen:
    """A plug-in as the run chose it: the registered plug-in and its options (None: it declares none). Every kind
    is called the same way, on the one argument its seam defines (a batch that carries `options`, or an engine's
    context): `chosen(batch)`. Its traits read through (`chosen.needs_critic`)."""

    plugin: Plugin
    options: Any

    def __call__(self, argument: Any) -> Any:
        return self.plugin.obj(argument)

    def __getattr__(self, name: str) -> Any:
        if name == "plugin":  # not set yet (copying): no trait lookup
            raise AttributeError(name)
        return getattr(self.plugin, name)


@dataclasses.dataclass(frozen=True)
class Plugins:
    """The run's plug-ins (marlhf.plugins), resolved once from the config: the termination rule, the advantage
    estimator, the policy loss and the rollout engine's factory, each with its options. The trainer reads plug-in
    options here, never off the config."""

    termination: Chosen
    estimator: Chosen
    policy_loss: Chosen
    engine: Chosen

    @classmethod
    def from_config(cls, config: PPOConfig) -> Plugins:
        return cls(*(Chosen(config.plugin(option), config.plugin_options(option))
                     for option in ("termination", "advantage", "policy_loss", "rollout_engine")))

    def make_engine(self, accelerator, max_length: int) -> RolloutEngine:
        """A new rollout engine, from its factory."""
        return self.engine(EngineContext(accelerator, self.engine.options, max_length=max_length))

    def loss_units(self, mask: torch.Tensor, segment_ids: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
        """What the policy loss is a mean over in these rows (its `units` trait, with its options)."""
        return self.policy_loss.units(mask, segment_ids, self.policy_loss.options, loss_agg_mode)


@dataclasses.dataclass
class Updater:
    """One trained model and what steps it, prepared by Accelerate: its optimizer, learning-rate scheduler and
    finite-update guard (a NaN or inf gradient norm skips the step)."""

    role: Literal["policy", "critic"]
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    guard: FiniteUpdates


@dataclasses.dataclass
class PPOModels:
    """The models of a PPO run before Accelerate prepares them (`ref`, `critic`, `reward_model` may be None)."""

    policy: torch.nn.Module
    ref: Any
    critic: ScalarHeadModel | None
    reward_model: ScalarHeadModel | None
    reward_fn: RewardFn | None


@dataclasses.dataclass
class PPORun:
    """What every stage of a PPO step uses: the config, the plug-ins, the rollout engine, the models (the trained
    ones in their updaters, prepared by Accelerate), the reward source, the tokenized prompts and the batch plan."""

    config: PPOConfig
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    plugins: Plugins
    engine: RolloutEngine
    updaters: list[Updater]  # the policy's and, with a critic, the critic's
    ref: torch.nn.Module | AdaptersDisabled | None  # None: nothing reads the reference
    reward_model: ScalarHeadModel | None
    reward_fn: RewardFn | None
    prompt_records: list[dict[str, Any]]
    prompt_tokens: list[list[int]]
    plan: BatchPlan
    piece_size: int  # rows per forward pass in the update
    eos_token_id: int | list[int]
    kl_control: AdaptiveKLController | None = None  # None: config.kl_coef throughout
    generated_tokens: GeneratedTokens | None = None  # None: no token budget, nothing counted
    rollouts: StaleRollouts | None = None  # rollout worker processes (rollout_workers); None: the engine here

    @property
    def policy(self) -> torch.nn.Module:
        return self._model("policy")

    @property
    def critic(self) -> torch.nn.Module | None:
        return self._model("critic")

    @property
    def kl_coef(self) -> float:
        """The KL coefficient of the current step."""
        return self.config.kl_coef if self.kl_control is None else self.kl_control.value

    @property
    def sampling(self) -> dict[str, Any]:
        """The engine's sampling settings, the same for the rollout and the Monte-Carlo continuations."""
        config = self.config
        return dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                    eos_token_id=self.eos_token_id, pad_token_id=self.tokenizer.pad_token_id)

    @property
    def episodes(self) -> EpisodeSpec | None:
        """What runs a step's episodes besides the engine (here or in a rollout worker); None without config.env."""
        config = self.config
        if config.env is None:
            return None
        return EpisodeSpec(config.env, config.env_options, self.tokenizer, config.multi_turn, config.max_length,
                           self.sampling)

    def train(self, mode: bool = True) -> None:
        for updater in self.updaters:
            updater.model.train(mode)

    def record_fields(self, rows: list[int]) -> dict[str, list] | None:
        """The rows' record fields other than the prompt, a list each, for a reward function in TRL's convention."""
        if self.reward_fn is None or not takes_record_fields(self.reward_fn):
            return None
        names = sorted({name for i in rows for name in self.prompt_records[i]} - {"prompt"})
        return {name: [self.prompt_records[i].get(name) for i in rows] for name in names}

    def clipped(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores clipped to rm_score_clip if set: what the rewards and the Monte-Carlo values use."""
        clip = self.config.rm_score_clip
        return scores if clip is None else scores.clamp(-clip, clip)

    def _model(self, role: str) -> torch.nn.Module | None:
        return next((updater.model for updater in self.updaters if updater.role == role), None)


def reward_source(config: PPOConfig, records: list[dict[str, Any]], reward_fn: RewardFn | list[RewardFn] | None,
                  reward_model: ScalarHeadModel | None) -> tuple[RewardFn | None, ScalarHeadModel | None]:
    """Where scores come from, in this order: a reward function passed in (several are summed with
    reward_weights), `reward_fns` by dotted path, the unit tests of each record (reward="code"), else the reward
    model (passed in, or loaded from reward_model_name_or_path). Returns (reward_fn, reward_model), one of them
    None."""
    if config.env is not None:  # the environment's rewards score its episodes (marlhf.trainers.episodes)
        if reward_fn is not None or reward_model is not None:
            raise ValueError(f"env={config.env!r} scores episodes with the environment's rewards: pass no reward_fn "
                             "or reward_model (not yet combined)")
        return None, None
    if reward_fn is None and config.reward_fns:
        reward_fn = RewardFunctions.from_paths(config.reward_fns, config.reward_weights)
    elif isinstance(reward_fn, (list, tuple)):  # several functions from Python
        reward_fn = RewardFunctions(reward_fn, config.reward_weights)
    if reward_fn is None and config.reward == "code":
        reward_fn = code_reward_fn(records)
    if reward_fn is not None:
        return reward_fn, None
    if reward_model is None:
        if config.reward_model_name_or_path is None:
            raise ValueError("reward_model_name_or_path is required when no reward model or reward_fn is given")
        reward_model = ScalarHeadModel.from_pretrained(config.reward_model_name_or_path, config.dtype)
    return None, reward_model


def build_models(config: PPOConfig, records: list[dict[str, Any]], device: torch.device, *, policy=None, ref=None,
                 critic: ScalarHeadModel | None = None, reward_model: ScalarHeadModel | None = None,
                 reward_fn: RewardFn | list[RewardFn] | None = None) -> PPOModels:
    """The policy and the reference from the SFT model, the critic (from critic_model_name_or_path, else the reward
    model, else the SFT model's transformer with a fresh value head), the frozen reward source; models passed in
    are used as they are. LoRA adapters on policy and critic when asked; dropout off."""
    if policy is None:
        policy = load_causal_lm(config.model_name_or_path, config.dtype, config.gradient_checkpointing)
    reward_fn, reward_model = reward_source(config, records, reward_fn, reward_model)
    if reward_model is not None:
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
    return PPOModels(policy, ref, critic, reward_model, reward_fn)


def tokenize_prompts(records: list[dict[str, Any]], tokenizer, config: PPOConfig,
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


def prepare_training(config: PPOConfig, accelerator, models: PPOModels, plan: BatchPlan,
                     piece_size: int) -> list[Updater]:
    """Optimisers and schedulers of the policy (and critic), all prepared by Accelerate: the policy's updater, then
    the critic's."""
    updates_per_step = config.ppo_epochs * (config.rollout_size // config.mini_batch_size)
    policy_optimizer = make_optimizer(models.policy, config)
    policy_scheduler = make_scheduler(policy_optimizer, config, plan.total_steps * updates_per_step)
    # Under DeepSpeed policy and critic get an engine each (the critic's prepare logs that Accelerate's own
    # backward stays tied to the policy's engine: ppo_update calls each engine's backward itself).
    configure_deepspeed(accelerator, config, piece_size)
    policy, policy_optimizer = accelerator.prepare(models.policy, policy_optimizer)
    updaters = [Updater("policy", policy, policy_optimizer, policy_scheduler,
                        FiniteUpdates(config.nonfinite_skip_limit))]
    if models.critic is not None:
        critic_optimizer = make_optimizer(models.critic, config, learning_rate=config.critic_learning_rate)
        critic_scheduler = make_scheduler(critic_optimizer, config, plan.total_steps * updates_per_step)
        critic, critic_optimizer = accelerator.prepare(models.critic, critic_optimizer)
        updaters.append(Updater("critic", critic, critic_optimizer, critic_scheduler,
                                FiniteUpdates(config.nonfinite_skip_limit)))
    return updaters


def checkpointed(updaters: list[Updater], **more_schedulers: Any) -> tuple[dict, dict, dict]:
    """What a checkpoint holds, by role: (models, optimizers, schedulers), with `more_schedulers` (a KL controller)
    beside the learning-rate schedulers."""
    return ({u.role: u.model for u in updaters}, {u.role: u.optimizer for u in updaters},
            {**{u.role: u.scheduler for u in updaters}, **more_schedulers})


def start_ppo_run(config: PPOConfig, accelerator: Accelerator, plugins: Plugins, engine: RolloutEngine,
                  models: PPOModels, records: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase
                  ) -> tuple[PPORun, int, MetricsLogger, tuple[dict, dict, dict]]:
    """The run every stage reads, the step it starts at (a resumed run's: its checkpoint's), its metrics logger and
    what its checkpoints hold (models, optimizers, schedulers, by name): the prompts tokenized, the trained models
    prepared with their optimizers and schedulers, and the adaptive KL controller and the token count, both kept
    beside the learning-rate schedulers."""
    kept_records, prompt_tokens = tokenize_prompts(records, tokenizer, config, accelerator)
    # A step takes per_device_batch_size prompts; gradient accumulation splits the PPO mini-batches instead.
    plan = BatchPlan(len(prompt_tokens), config, accelerator, accumulation=1)
    piece_size = config.mini_batch_size // config.gradient_accumulation_steps  # rows per forward in the update
    updaters = prepare_training(config, accelerator, models, plan, piece_size)
    kl_control, kl_options = None, config.kl_control
    if kl_options.kl_target is not None:
        kl_control = AdaptiveKLController(config.kl_coef, kl_options.kl_target, kl_options.kl_horizon,
                                          config.rollout_size * accelerator.num_processes, kl_options.kl_coef_max)
    generated_tokens = GeneratedTokens() if config.counts_generated_tokens else None
    more = {"kl_coef": kl_control, "generated_tokens": generated_tokens}
    trained_models, optimizers, schedulers = checkpointed(
        updaters, **{name: state for name, state in more.items() if state is not None})
    start_step, logger = start_run(config, accelerator, trained_models, optimizers, schedulers)
    run = PPORun(config, accelerator, tokenizer, plugins, engine, updaters, models.ref, models.reward_model,
                 models.reward_fn, kept_records, prompt_tokens, plan, piece_size,
                 eos_token_id(accelerator, trained_models["policy"], tokenizer), kl_control, generated_tokens)
    return run, start_step, logger, (trained_models, optimizers, schedulers)


def eos_token_id(accelerator: Accelerator, policy: torch.nn.Module,
                 tokenizer: PreTrainedTokenizerBase) -> int | list[int]:
    """Where a response ends: the policy's generation config's EOS id(s), else the tokenizer's."""
    eos = accelerator.unwrap_model(policy).generation_config.eos_token_id
    return eos if eos is not None else tokenizer.eos_token_id


def mixed_seed(*numbers: int) -> int:
    """A well-mixed 32-bit seed from several integers (run seed, step, row)."""
    return int(np.random.SeedSequence(list(numbers)).generate_state(1)[0])


def _disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """PPO's ratio compares the rollout's log-probs with the update's forward of the same weights; dropout
    would make them differ (the update runs in train mode, which gradient checkpointing needs)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _frozen(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    return model.requires_grad_(False).eval().to(device)
