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

Each step, top to bottom, is six stages over one `PPORun`, each `stage(run, experience)`; the first five fill the
step's `Experience` (marlhf.rollout) and return it, the sixth reads it:
  1. `make_experience`: sample `num_samples_per_prompt` responses per prompt with the rollout engine
     (marlhf.engines), score them (log-probs of policy and reference, critic values, one score per
     response; the policy's entropy at each token when the estimator reads it);
  2. `per_token_rewards`: -kl_coef * (log pi - log pi_ref) on every token, score on the last token;
  3. `macro_actions`: segment the responses with the termination rule (marlhf.termination: fixed /
     randomized n-grams, perplexity, parsing, word, low_prob, or one of yours);
  4. `estimate_advantages` with the estimator (marlhf.estimators): GAE over segments (`advantage="gae"`;
     `termination="fixed", ngram=1` is token-level PPO), or a critic-free estimator on the summed reward
     ("rloo", "grpo", "reinforce"; per token "prefix_tree", "entropy_weighted", "mc_segment"), optionally kept only on
     low-probability tokens (`advantage_mask_threshold`, SPO's mask);
  5. `ppo_update`: PPO epochs over shuffled mini-batches, the policy loss (marlhf.policy_losses; by default
     the clipped surrogate with one ratio per segment, also for the critic-free estimators: `ngram=None`
     gives a sequence-level ratio, `ngram=1` token-level ratios as in TRL's GRPO), clipped value loss on
     segment values;
  6. `step_metrics`, checkpoint.

Termination rules, estimators, policy losses and engines are plug-ins (marlhf.plugins), chosen by name or
dotted path, each with its own options, resolved once into the run's `Plugins`; `PPOConfig` lives in
marlhf.trainers.ppo_config and what is set up before the first step (plug-ins, models, reward source, each trained
model's `Updater`) in marlhf.trainers.ppo_setup.

Defaults follow the paper (docs/algorithm.md) but two: a macro action's value is the value of the state where it
starts (`value_weighting="first"`), as the credit-assignment study's pre-registered rule decided (Study I,
benchmarks/results/credit_assignment/README.md; `value_weighting="equal"` is the paper's), and `lam=1`, Study
II's tuned lambda for token-level PPO and MA-PPO alike (benchmarks/results/credit_assignment_lambda/README.md; the
paper's is 0.95). `ratio_granularity`, `segment_reward`, `last_token_own_segment`
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

import contextlib
import dataclasses
from typing import Any, Callable

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from marlhf._checks import check_like, check_mask, check_segment_ids, trusted_inputs
from marlhf.advantages import kl_penalized_rewards, low_prob_advantage_mask, whiten
from marlhf.data.records import prompt_records, require_fields
from marlhf.engines import RolloutEngine, model_positions
from marlhf.estimators import AdvantageBatch
from marlhf.kl_control import AdaptiveKLController
from marlhf.logging_utils import MetricsLogger, reduce_metrics
from marlhf.losses import loss_units, value_loss
from marlhf.policy_losses import PolicyLossBatch
from marlhf.metrics import row_l2, token_repetition
from marlhf.data.encoding import pad_sequences
from marlhf.modeling import AdaptersDisabled, ScalarHeadModel, load_tokenizer, merge_lora
from marlhf.rewards.functions import takes_record_fields
from marlhf.continuations import PrefixContinuations
from marlhf.rollout import (Experience, RewardFn, response_logprobs, response_logprobs_and_entropy,
                            response_scores, response_values, score_responses)
from marlhf.segments import num_segments, split_last_token
from marlhf.staleness import RolloutRequest, StaleRollouts
from marlhf.termination import SegmentationBatch, segment
from marlhf.trainers.common import (BatchPlan, accumulation_context, backward, device_clock, gather_rows,
                                    make_accelerator, maybe_save_checkpoint, optimizer_step, own_rows,
                                    records_from_config, save_final_model, start_run)
from marlhf.trainers.ppo_config import PPOConfig
from marlhf.trainers.ppo_setup import (Plugins, Updater, build_models, checkpointed, prepare_training,
                                       tokenize_prompts)

__all__ = ["PPOConfig", "train_ppo", "Experience"]

# after_step(steps_done, unwrapped policy, tokens generated so far or None): see train_ppo
StepCallback = Callable[[int, torch.nn.Module, "int | None"], None]


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
    rollouts: StaleRollouts | None = None  # rollout worker processes (config.rollout_workers); None: the engine here

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

    def train(self, mode: bool = True) -> None:
        for updater in self.updaters:
            updater.model.train(mode)

    def _model(self, role: str) -> torch.nn.Module | None:
        return next((updater.model for updater in self.updaters if updater.role == role), None)


# ---------------------------------------------------------------------------------------------- the stages
def make_experience(run: PPORun, step: int) -> Experience:
    """Stage 1: sample the step's responses (the samples of one prompt are consecutive rows) and score them.

    When one update reuses the rollout's forwards (`reuses_rollout_forward`), the policy log-probs and critic
    values are computed with gradients and kept in the experience. Its clock holds the step's start and the end
    times of `generation` and `scoring`."""
    config, accelerator, tokenizer = run.config, run.accelerator, run.tokenizer
    device = accelerator.device
    clock = {"start": device_clock(device)}
    rows, request = _rollout_request(run, step)
    prompt_ids, prompt_mask, row_seeds = request.prompt_ids, request.prompt_mask, request.row_seeds
    run.train(False)  # generate with the KV cache (train mode with gradient checkpointing turns it off)
    run.engine.sync_weights(accelerator.unwrap_model(run.policy))
    attached_logprobs = attached_values = None
    keeps_sampling_logprobs = config.old_logprobs_from == "sampling" and not config.reuses_rollout_forward
    with_entropy = run.plugins.estimator.reads_entropy  # from the policy's forward (PPOConfig.validate)
    wants_sampling_logprobs = keeps_sampling_logprobs or config.compares_rollout_logprobs
    with accelerator.autocast():
        if run.rollouts is None:  # the engine here, now, with this step's policy
            generation = run.engine.generate(prompt_ids, prompt_mask, row_seeds=row_seeds,
                                             max_new_tokens=config.max_response_length,
                                             return_logprobs=wants_sampling_logprobs, **_sampling(run))
        else:  # from the rollout workers, sampled by policy version max(start, step - max_staleness)
            generation = run.rollouts.generation(step, accelerator.unwrap_model(run.policy))
        if wants_sampling_logprobs and generation.logprobs is None:
            raise ValueError(f"rollout engine {config.rollout_engine!r} returned no sampling log-probs, which "
                             "old_logprobs_from='sampling' and log_rollout_logprob_diff need")
        clock["generation"] = device_clock(device)
        batch = (prompt_ids, prompt_mask, generation.response_ids, generation.response_mask)
        if config.reuses_rollout_forward:  # with gradients: these are the update's forwards too
            run.train()
            temperature = config.scoring_temperature
            attached_logprobs, entropy = (
                response_logprobs_and_entropy(run.policy, *batch, temperature=temperature) if with_entropy
                else (response_logprobs(run.policy, *batch, temperature=temperature), None))
            attached_values = response_values(run.critic, *batch) if run.critic is not None else None
            model_outputs = dict(logprobs=attached_logprobs, values=attached_values, entropy=entropy)
        elif keeps_sampling_logprobs:
            model_outputs = dict(logprobs=generation.logprobs, critic=run.critic)
        else:
            model_outputs = dict(policy=run.policy, critic=run.critic)
        scored = score_responses(
            *batch, ref=run.ref, temperature=config.scoring_temperature, reward_model=run.reward_model,
            reward_fn=run.reward_fn, prompts=[run.prompt_records[i]["prompt"] for i in rows], tokenizer=tokenizer,
            reward_kwargs=_record_fields(run, rows), with_entropy=with_entropy,
            piece_size=config.forward_batch_size or run.piece_size, **model_outputs)
    clock["scoring"] = device_clock(device)
    experience = dataclasses.replace(scored, step=step, clock=clock, prompt_rows=rows,
                                     attached_logprobs=attached_logprobs, attached_values=attached_values)
    if config.compares_rollout_logprobs:  # beside the trainer's, not instead of them
        experience.rollout_logprobs = generation.logprobs.detach()
    return experience


def per_token_rewards(run: PPORun, experience: Experience) -> Experience:
    """Stage 2: the KL-penalised per-token rewards (without a reference the penalty is 0: kl_coef is 0), from
    the scores clipped to rm_score_clip if set."""
    scores = _clipped(run, experience.scores)
    logprobs, ref_logprobs = experience.logprobs, experience.ref_logprobs
    rewards = kl_penalized_rewards(scores, logprobs, ref_logprobs if ref_logprobs is not None else logprobs,
                                   experience.response_mask, run.kl_coef)
    return dataclasses.replace(experience, rewards=rewards, kl_coef=run.kl_coef)


def macro_actions(run: PPORun, experience: Experience) -> Experience:
    """Stage 3: segment ids of the responses under the termination rule (marlhf.termination), and the rule's
    stats (the parsing rule: how many rows fell back to one token per segment)."""
    config, accelerator, mask = run.config, run.accelerator, experience.response_mask
    rule = run.plugins.termination
    batch = SegmentationBatch(experience.response_ids, mask, experience.ref_logprobs, run.tokenizer, rule.options,
                              seed=_seed(config.seed, experience.step),
                              gather_rows=lambda x: gather_rows(accelerator, x),
                              own_rows=lambda x: own_rows(accelerator, x, like=mask), logprobs=experience.logprobs)
    segment_ids, stats = segment(rule.plugin, batch)
    if config.last_token_own_segment:
        segment_ids = split_last_token(segment_ids, mask)
    return dataclasses.replace(experience, segment_ids=segment_ids, segmentation_stats=stats)


def estimate_advantages(run: PPORun, experience: Experience) -> Experience:
    """Stage 4: the estimator's advantages (and returns, with a critic), whitened if asked, then kept only on
    the tokens sampled with probability below `advantage_mask_threshold` if set (SPO's mask; after whitening, which
    would move the zeros). Batch statistics (baselines, whitening) are taken over the rows of all processes. An
    estimator that continues prefixes (`continue_and_score`) does so here, with the rollout's weights; its
    continuation tokens are kept for the metrics."""
    config, accelerator, mask = run.config, run.accelerator, experience.response_mask
    estimator = run.plugins.estimator
    continuations = _prefix_continuations(run, experience)
    advantages, returns = estimator(AdvantageBatch(
        experience.rewards, experience.values, mask, experience.segment_ids, estimator.options,
        num_samples_per_prompt=config.num_samples_per_prompt, value_weighting=config.value_weighting,
        gather_rows=lambda x: gather_rows(accelerator, x), own_rows=lambda x: own_rows(accelerator, x, like=mask),
        response_ids=experience.response_ids, entropy=experience.entropy, continue_and_score=continuations))
    if config.whiten_advantages:
        all_advantages = whiten(gather_rows(accelerator, advantages), gather_rows(accelerator, mask))
        advantages = own_rows(accelerator, all_advantages, like=mask)
    if config.advantage_mask_threshold is not None:
        advantages = low_prob_advantage_mask(advantages, experience.logprobs, mask, config.advantage_mask_threshold)
    return dataclasses.replace(experience, advantages=advantages, returns=returns,
                               continuation_tokens=continuations.tokens if continuations.calls else None)


def ppo_update(run: PPORun, experience: Experience) -> Experience:
    """Stage 5: PPO epochs over shuffled mini-batches, each split into length-sorted pieces; one optimizer
    step of policy (and critic) per mini-batch; during the critic warm-up (`critic_warmup_steps`) the critic alone.
    Keeps each loss statistic per piece (`update_stats`).

    No device read inside the pieces: the inputs are checked once here and the pieces' sizes come from host
    lengths; each optimizer step reads one number, the finite-update guard's gradient norm (a NaN or inf one
    skips the step)."""
    config = run.config
    train_policy = experience.step >= config.critic_warmup_steps
    _check_update_inputs(experience)
    segment_counts = num_segments(experience.segment_ids).tolist()  # per row, on the host: each piece's slots
    updaters = [updater for updater in run.updaters if train_policy or updater.role != "policy"]
    run.train()
    update_stats: dict[str, list[torch.Tensor]] = {}
    with trusted_inputs():
        for _ in range(config.ppo_epochs):
            order = torch.randperm(config.rollout_size).tolist()  # a CPU tensor: no device read
            for start in range(0, config.rollout_size, config.mini_batch_size):
                mini_batch_rows = order[start : start + config.mini_batch_size]
                totals = _mini_batch_loss_units(run, experience, mini_batch_rows)
                # Rows of similar length share a piece and the columns all its rows pad are cut: the update is
                # a token sum, which does not depend on how the mini-batch is split.
                for is_last, piece_rows, piece in experience.pieces(mini_batch_rows, run.piece_size):
                    num_slots = max(segment_counts[row] for row in piece_rows)
                    stats = _update_piece(run, piece, totals, num_slots, is_last, train_policy)
                    for name, value in stats.items():
                        update_stats.setdefault(name, []).append(value)
                for u in updaters:
                    optimizer_step(run.accelerator, u.model, u.optimizer, u.scheduler, config.max_grad_norm, u.guard)
    return dataclasses.replace(experience, update_stats=update_stats)


def _mini_batch_loss_units(run: PPORun, experience: Experience, rows: list[int]) -> dict[str, torch.Tensor]:
    """What the losses average over in the mini-batch `rows` on all processes (tokens, or segments or responses:
    the policy loss's `units`). Weighting each piece's mean loss by its share of them makes the update one mean
    over the whole mini-batch (DDP averages the processes' gradients, hence num_processes in `_update_piece`).
    Only the mask and segment ids are indexed: the other fields are not needed here."""
    config, accelerator = run.config, run.accelerator
    index = torch.tensor(rows, device=experience.response_mask.device)
    mask, segment_ids = experience.response_mask[index], experience.segment_ids[index]
    totals = {}
    if run.critic is not None:
        totals["value"] = accelerator.reduce(loss_units(mask, None, "tokens", config.loss_agg_mode), reduction="sum")
    totals["policy"] = accelerator.reduce(run.plugins.loss_units(mask, segment_ids, config.loss_agg_mode),
                                          reduction="sum")
    return totals


def _update_piece(run: PPORun, piece: Experience, totals: dict[str, torch.Tensor], num_slots: int,
                  is_last: bool, train_policy: bool) -> dict[str, torch.Tensor]:
    """Backward of one piece's policy loss (unless in the critic warm-up) and value loss, each weighted by the
    piece's share of the mini-batch's loss units. The piece's forwards are the rollout's own when they were
    kept with gradients (one update per step), else run now."""
    config, accelerator, policy, critic = run.config, run.accelerator, run.policy, run.critic
    mask, processes = piece.response_mask, accelerator.num_processes
    stats = {}
    if train_policy:
        policy_loss = run.plugins.policy_loss
        weight = run.plugins.loss_units(mask, piece.segment_ids, config.loss_agg_mode) * processes / totals["policy"]
        with accumulation_context(accelerator, policy, is_last):
            logprobs = piece.attached_logprobs if piece.attached_logprobs is not None else response_logprobs(
                policy, *piece.model_inputs(), temperature=config.scoring_temperature)
            # with a stale rollout the engine's log-probs are the behaviour policy's, piece.logprobs the proximal's
            behaviour = piece.rollout_logprobs if config.max_staleness else None
            loss, loss_stats = policy_loss(PolicyLossBatch(logprobs, piece.logprobs, piece.advantages, mask,
                                                           piece.segment_ids, config.loss_agg_mode, num_slots,
                                                           policy_loss.options, piece.rollout_logprobs, behaviour))
            backward(accelerator, policy, loss * weight, is_last)
        stats = {"loss/policy": loss.detach(),
                 **{f"policy/{name}": loss_stats[name] for name in ("clipfrac", "approxkl", "tis_weight_mean",
                                                                    "behaviour_weight_mean", "behaviour_dropped")
                    if name in loss_stats}}
    if critic is not None:
        weight = loss_units(mask, None, "tokens", config.loss_agg_mode) * processes / totals["value"]
        with accumulation_context(accelerator, critic, is_last):
            values = piece.attached_values if piece.attached_values is not None else response_values(
                critic, *piece.model_inputs())
            value_segments = piece.segment_ids if config.value_loss_granularity == "segment" else None
            loss, loss_stats = value_loss(values, piece.values, piece.returns, mask, value_segments,
                                          config.value_clip_range, config.value_weighting, config.loss_agg_mode,
                                          num_slots)
            backward(accelerator, critic, loss * weight, is_last)
        stats.update({"loss/value": loss.detach(), "val/clipfrac": loss_stats["vf_clipfrac"]})
    return stats


def adapt_kl_coef(run: PPORun, experience: Experience) -> None:
    """After a step under `kl_target`: move the KL coefficient with the step's KL over all processes' responses
    (one read to the host per step)."""
    row_kl = torch.where(experience.response_mask, experience.logprobs - experience.ref_logprobs, 0.0).sum(1)
    policy_lr = next(u for u in run.updaters if u.role == "policy").optimizer.param_groups[0]["lr"]
    run.kl_control.update(run.accelerator.gather(row_kl).float().mean().item(), policy_lr)


def step_metrics(run: PPORun, experience: Experience) -> dict[str, float]:
    """Stage 6: the step's metrics, reduced over processes (the one place a step reads values to the host)."""
    e, mask, clock = experience, experience.response_mask, experience.clock
    # KL (with a reference) and entropy: sample estimates summed over each response's tokens, averaged over
    # responses.
    metrics = {} if e.ref_logprobs is None else {
        "objective/kl": torch.where(mask, e.logprobs - e.ref_logprobs, 0.0).sum(1).mean()}
    metrics |= {
        "objective/entropy": torch.where(mask, -e.logprobs, 0.0).sum(1).mean(),
        "objective/rm_score": e.scores.mean(),
        "objective/response_length": mask.sum(1).float().mean(),
        "objective/repetition": token_repetition(e.response_ids, mask).mean(),
        **{name: torch.stack(values).mean() for name, values in e.update_stats.items()},
        "val/advantage_l2": row_l2(e.advantages, mask),
        "macro/mean_segment_length": mask.sum() / num_segments(e.segment_ids).sum(),
        "time/generation": clock["generation"] - clock["start"],
        "time/scoring": clock["scoring"] - clock["generation"],
        "time/advantages": clock["advantages"] - clock["scoring"],  # Monte-Carlo continuations included
        "time/update": clock["update"] - clock["scoring"],  # stage 4 (time/advantages) and 5
        "time/step_seconds": device_clock(run.accelerator.device) - clock["start"],
        "train/skipped_steps": sum(updater.guard.skipped for updater in run.updaters),
    }
    if e.returns is not None:
        metrics["val/return_l2"] = row_l2(e.returns, mask)
    if (run.config.log_rollout_logprob_diff or run.config.max_staleness) and e.rollout_logprobs is not None:
        diff = torch.where(mask, (e.rollout_logprobs - e.logprobs).abs(), 0.0)
        metrics["rollout/logprob_diff_mean"] = diff.sum() / mask.sum().clamp(min=1)
        metrics["rollout/logprob_diff_max"] = run.accelerator.gather(diff.max()[None]).max()  # over processes
    # generated tokens: totals over all processes (the reduction below is a mean)
    metrics["rollout/tokens"] = mask.sum() * run.accelerator.num_processes
    if e.continuation_tokens is not None:
        metrics["rollout/mc_tokens"] = e.continuation_tokens * run.accelerator.num_processes
    if run.rollouts is not None:  # the worker's throughput, the trainer's wait, how stale the batch was
        metrics.update(run.rollouts.metrics)
    metrics.update({f"macro/{name}": value for name, value in e.segmentation_stats.items()})
    metrics.update({f"rewards/{name}": value for name, value in getattr(run.reward_fn, "last_means", {}).items()})
    metrics = reduce_metrics(metrics, run.accelerator)
    if run.kl_control is not None:
        metrics["objective/kl_coef"] = e.kl_coef
    if run.generated_tokens is not None:
        metrics["rollout/generated_tokens"] = run.generated_tokens.total
    return metrics


class GeneratedTokens:
    """The tokens a run has generated so far (every sampled response token and every Monte-Carlo continuation
    token, over all processes), for the token budget (`max_generated_tokens`, `min_generated_tokens`); kept in
    checkpoints beside the learning-rate schedulers, so a resumed run stops where the uninterrupted one does."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, run: PPORun, experience: Experience) -> int:
        """Count a step's tokens (one read to the host) and return the total so far."""
        step = run.accelerator.reduce(experience.response_mask.sum(), reduction="sum").item()
        self.total += int(step) + (experience.continuation_tokens or 0) * run.accelerator.num_processes
        return self.total

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total = int(state["total"])


# ---------------------------------------------------------------------------------------------- the loop
def train_ppo(config: PPOConfig, prompts: list[str] | list[dict[str, Any]] | None = None, policy=None, ref=None,
              critic: ScalarHeadModel | None = None, reward_model: ScalarHeadModel | None = None, tokenizer=None,
              reward_fn: RewardFn | list[RewardFn] | None = None, after_step: StepCallback | None = None):
    """Train the policy with (MA-)PPO on `prompts` (strings, or {"prompt": ...} records whose other fields go to
    reward functions; default: config.dataset) and
    return it unwrapped. Models not passed in are loaded from the config's paths (`ref` is not used when
    `config.uses_reference` is False); `reward_fn` replaces the reward model as the source of scores.
    `after_step(steps_done, policy, generated_tokens)`, if given, is called on every process after each step with
    the unwrapped policy and the tokens generated so far (None without a token budget), e.g. to evaluate the policy
    during training; the random states are restored after it, so it does not change the run.
    Metrics go to OUTPUT_DIR/metrics.jsonl (see logging_utils)."""
    accelerator = make_accelerator(config)
    # The engine first: one that cannot run here (vLLM missing, engine arguments vLLM lacks) stops the run before
    # the models load and before anything is written to output_dir.
    plugins = Plugins.from_config(config)
    engine = plugins.make_engine(accelerator, config.max_length)
    with contextlib.closing(engine):  # when training ends, also on an error: an engine may hold a model and memory
        records = prompt_records(prompts) if prompts is not None else records_from_config(config, "rl")
        require_fields(records, ("prompt",), "rl")
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path, "left")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (marlhf.modeling.load_tokenizer sets pad := eos)")
        models = build_models(config, records, accelerator.device, policy=policy, ref=ref, critic=critic,
                              reward_model=reward_model, reward_fn=reward_fn)
        kept_records, prompt_tokens = tokenize_prompts(records, tokenizer, config, accelerator)
        # A step takes per_device_batch_size prompts; gradient accumulation splits the PPO mini-batches instead.
        plan = BatchPlan(len(prompt_tokens), config, accelerator, accumulation=1)
        piece_size = config.mini_batch_size // config.gradient_accumulation_steps  # rows per forward in the update
        updaters = prepare_training(config, accelerator, models, plan, piece_size)
        kl_control = None
        if config.kl_target is not None:  # checkpointed beside the learning-rate schedulers
            kl_control = AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon,
                                              config.rollout_size * accelerator.num_processes, config.kl_coef_max)
        generated_tokens = GeneratedTokens() if config.counts_generated_tokens else None
        more = {"kl_coef": kl_control, "generated_tokens": generated_tokens}
        trained_models, optimizers, schedulers = checkpointed(  # beside the learning-rate schedulers
            updaters, **{name: state for name, state in more.items() if state is not None})
        start_step, logger = start_run(config, accelerator, trained_models, optimizers, schedulers)
        run = PPORun(config, accelerator, tokenizer, plugins, engine, updaters, models.ref, models.reward_model,
                     models.reward_fn, kept_records, prompt_tokens, plan, piece_size, kl_control=kl_control,
                     eos_token_id=_eos_token_id(accelerator, trained_models["policy"], tokenizer),
                     generated_tokens=generated_tokens)

        train_steps(run, start_step, logger, (trained_models, optimizers, schedulers), after_step)
        logger.close()
        trained = policy = run.policy  # as prepared: under ZeRO-3 the final weights are gathered through its engine
        policy = accelerator.unwrap_model(policy)
        if config.use_lora:  # a plain model with the adapters merged in; the trained adapters stay as they are
            trained = policy = merge_lora(policy)
        # saved before the engine closes: vLLM's shutdown tears down the default process group that saving
        # across processes waits on
        save_final_model(trained, tokenizer, config.output_dir, accelerator)
    return policy


def train_steps(run: PPORun, start_step: int, logger: MetricsLogger, checkpointed: tuple[dict, dict, dict],
                after_step: StepCallback | None = None) -> None:
    """The steps of the plan from `start_step` on, each the six stages; metrics to `logger`, checkpoints of the
    `checkpointed` (models, optimizers, schedulers) by name. With a token budget the run ends at the first step
    whose generated tokens reach max_generated_tokens, and goes on past the plan's last step until they reach
    min_generated_tokens."""
    config, accelerator, plan, kl_control = run.config, run.accelerator, run.plan, run.kl_control
    # rollout workers: started here, stopped when the steps end, also on an error (no orphan process)
    run.rollouts = _start_rollout_workers(run, start_step) if config.rollout_workers else None
    # closed on any exception too (Ctrl-C), so that the error's line starts on a line of its own
    with contextlib.closing(run.rollouts) if run.rollouts else contextlib.nullcontext(), \
            tqdm(initial=start_step, total=plan.total_steps, desc="ppo",
                 disable=not accelerator.is_local_main_process) as progress:
        step = start_step
        while _goes_on(run, step):
            experience = make_experience(run, step)  # 1. sample and score
            experience = per_token_rewards(run, experience)  # 2.
            experience = macro_actions(run, experience)  # 3.
            experience = estimate_advantages(run, experience)  # 4.
            experience.clock["advantages"] = device_clock(accelerator.device)
            experience = ppo_update(run, experience)  # 5.
            if kl_control is not None:
                adapt_kl_coef(run, experience)
            if run.generated_tokens is not None:
                run.generated_tokens.add(run, experience)
            experience.clock["update"] = device_clock(accelerator.device)

            done = step = step + 1  # 6. metrics and checkpoint
            last = not _goes_on(run, done)
            if done % config.logging_steps == 0 or last:
                metrics = step_metrics(run, experience)
                logger.log(metrics, done)
                postfix = {"reward": f"{metrics['objective/rm_score']:.3f}"}
                if "objective/kl" in metrics:
                    postfix["kl"] = f"{metrics['objective/kl']:.3f}"
                progress.set_postfix(**postfix)
            progress.update()
            maybe_save_checkpoint(config, done, accelerator, *checkpointed, run.tokenizer)
            if after_step is not None:
                with _random_states_kept(accelerator.device):
                    after_step(done, accelerator.unwrap_model(run.policy),
                               None if run.generated_tokens is None else run.generated_tokens.total)


def _goes_on(run: PPORun, steps_done: int) -> bool:
    """Whether the run takes another step after `steps_done`: until the plan's last step, ended earlier by
    max_generated_tokens and drawn out by min_generated_tokens (the token budget)."""
    config, tokens = run.config, run.generated_tokens
    if tokens is not None and config.max_generated_tokens is not None and tokens.total >= config.max_generated_tokens:
        return False
    if tokens is not None and config.min_generated_tokens is not None and tokens.total < config.min_generated_tokens:
        return True
    return steps_done < run.plan.total_steps


@contextlib.contextmanager
def _random_states_kept(device: torch.device):
    """Python's, NumPy's and torch's random states (the device's too) as they were before the block."""
    import random

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


# ---------------------------------------------------------------------------------------------- helpers
def _rollout_request(run: PPORun, step: int) -> tuple[list[int], RolloutRequest]:
    """Step `step`'s rows (each a prompt index, the samples of one prompt consecutive), their left-padded prompts
    on the device and their seeds."""
    config, accelerator = run.config, run.accelerator
    prompts = run.plan.pieces(step)[0]  # the step's prompts on this process (the plan has one piece a step)
    rows = [i for i in prompts for _ in range(config.num_samples_per_prompt)]
    prompt_ids, prompt_mask = pad_sequences([run.prompt_tokens[i] for i in rows], run.tokenizer.pad_token_id, "left")
    # One random stream per response, keyed by its row among all processes' rows: the samples do not
    # depend on the number of processes, and a resumed run draws what the uninterrupted one drew.
    first_row = accelerator.process_index * config.rollout_size
    row_seeds = [_seed(config.seed, step, first_row + row) for row in range(config.rollout_size)]
    return rows, RolloutRequest(prompt_ids.to(accelerator.device), prompt_mask.bool().to(accelerator.device),
                                row_seeds)


def _start_rollout_workers(run: PPORun, start_step: int) -> StaleRollouts:
    """config.rollout_workers engine processes for this training process, max_staleness steps ahead. A run that
    min_generated_tokens may draw out past the plan's last step has no last step for the workers (None)."""
    config = run.config
    last = None if config.min_generated_tokens is not None else run.plan.total_steps
    return StaleRollouts.start(
        engine=config.rollout_engine, engine_options=run.plugins.engine.options, max_length=config.max_length,
        workers=config.rollout_workers, threads=config.rollout_worker_threads, timeout=config.rollout_worker_timeout,
        output_dir=config.output_dir, first_index=run.accelerator.process_index * config.rollout_workers,
        max_staleness=config.max_staleness, start_step=start_step, total_steps=last,
        request=lambda step: _rollout_request(run, step)[1],
        sampling=dict(max_new_tokens=config.max_response_length, return_logprobs=True, **_sampling(run)))


def _record_fields(run: PPORun, rows: list[int]) -> dict[str, list] | None:
    """The rows' record fields other than the prompt, a list each, for a reward function in TRL's convention."""
    if run.reward_fn is None or not takes_record_fields(run.reward_fn):
        return None
    names = sorted({name for i in rows for name in run.prompt_records[i]} - {"prompt"})
    return {name: [run.prompt_records[i].get(name) for i in rows] for name in names}


def _eos_token_id(accelerator: Accelerator, policy: torch.nn.Module,
                  tokenizer: PreTrainedTokenizerBase) -> int | list[int]:
    """Where a response ends: the policy's generation config's EOS id(s), else the tokenizer's."""
    eos_token_id = accelerator.unwrap_model(policy).generation_config.eos_token_id
    return eos_token_id if eos_token_id is not None else tokenizer.eos_token_id


def _sampling(run: PPORun) -> dict[str, Any]:
    """The engine's sampling settings, the same for the rollout and the Monte-Carlo continuations."""
    config = run.config
    return dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, eos_token_id=run.eos_token_id,
                pad_token_id=run.tokenizer.pad_token_id)


def _context_length(run: PPORun) -> int:
    """The longest prompt + response an engine call may reach: max_length, or fewer if the policy has fewer
    positions."""
    positions = model_positions(run.accelerator.unwrap_model(run.policy))
    return run.config.max_length if positions is None else min(run.config.max_length, positions)


def _clipped(run: PPORun, scores: torch.Tensor) -> torch.Tensor:
    """Scores clipped to rm_score_clip if set: what the rewards and the Monte-Carlo values use."""
    clip = run.config.rm_score_clip
    return scores if clip is None else scores.clamp(-clip, clip)


def _prefix_continuations(run: PPORun, experience: Experience) -> PrefixContinuations:
    """`continue_and_score` over the step's rows (marlhf.continuations): sampled by the run's engine with the
    rollout's settings, continuation j of the prefix of length t of row r (among all processes' rows) seeded by
    (seed, step, r, t + 1, j), which no rollout seed (seed, step, r) equals; scored as the rollout is, clipped."""
    config, accelerator, step = run.config, run.accelerator, experience.step
    first_row = accelerator.process_index * config.rollout_size

    def generate(ids: torch.Tensor, mask: torch.Tensor, seeds: list[int], max_new_tokens: int):
        run.train(False)  # the rollout's mode: dropout off, KV cache on
        with accelerator.autocast():
            return run.engine.generate(ids, mask, row_seeds=seeds, max_new_tokens=max_new_tokens, **_sampling(run))

    def score(rows: list[int], *batch: torch.Tensor) -> torch.Tensor:
        prompt_rows = [experience.prompt_rows[row] for row in rows]
        logged = getattr(run.reward_fn, "last_means", None)  # the step logs the rollout's reward means
        with accelerator.autocast():
            scores = response_scores(*batch, reward_model=run.reward_model, reward_fn=run.reward_fn,
                                     prompts=[run.prompt_records[i]["prompt"] for i in prompt_rows],
                                     tokenizer=run.tokenizer, reward_kwargs=_record_fields(run, prompt_rows),
                                     piece_size=config.forward_batch_size or run.piece_size)
        if logged is not None:
            run.reward_fn.last_means = logged
        return _clipped(run, scores)

    return PrefixContinuations(experience.prompt_ids, experience.prompt_mask, experience.response_ids, generate, score,
                               lambda row, length, sample: _seed(config.seed, step, first_row + row, length + 1,
                                                                 sample),
                               config.max_response_length, run.tokenizer.pad_token_id, _context_length(run))


def _check_update_inputs(experience: Experience) -> None:
    """What the update's pieces slice, checked once per step: the pieces then skip the value checks."""
    mask = experience.response_mask
    check_mask(mask, "response_mask")
    check_segment_ids(experience.segment_ids, mask)
    for name in ("logprobs", "values", "advantages", "returns"):
        if getattr(experience, name) is not None:
            check_like(getattr(experience, name), mask, name)


def _seed(*numbers: int) -> int:
    """A well-mixed 32-bit seed from several integers (run seed, step, row)."""
    return int(np.random.SeedSequence(list(numbers)).generate_state(1)[0])
