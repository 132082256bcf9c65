"""MA-PPO: PPO whose actions are macro actions (segments of response tokens), and its baselines.

    policy = train_ppo(PPOConfig(model_name_or_path=SFT_DIR, reward_model_name_or_path=RM_DIR), records)

Models: the policy and a frozen reference start from the SFT model (no reference when nothing reads it), the critic
from the reward model (a ScalarHeadModel), which is frozen. Reward functions (`reward_fn(prompts, responses)`, or
`reward_fns` by dotted path in TRL's convention; marlhf.rewards.functions) can replace the reward model; the critic
then starts from the reward model if one is named, else from the SFT model with a fresh value head.

Read top to bottom: `train_ppo` sets the run up (marlhf.trainers.ppo_setup: the plug-ins, the models, the reward
source, each trained model's `Updater`, and the `PPORun` every stage reads), `train_steps` is the loop, the one
place that stamps the step's clock, and the stages follow in the order it calls them. From `score` on, a stage
takes the step's `Experience` (marlhf.rollout) and returns a copy with what it adds:
  1. `sample`: `num_samples_per_prompt` responses per prompt from the rollout engine (marlhf.engines);
  2. `score`: log-probs of policy and reference, critic values, one score per response (and entropy if read);
     with `env`, 1. and 2. run an environment's episodes, one a row (marlhf.trainers.episodes); the later stages
     read their action tokens only (`Experience.actions`; docs/multiturn.md);
  3. `per_token_rewards`: -kl_coef * (log pi - log pi_ref) on every token, score on the last token;
  4. `macro_actions`: segment the responses with the termination rule (marlhf.termination);
  5. `estimate_advantages` with the estimator (marlhf.estimators): "gae" over segments (`termination="fixed",
     ngram=1` is token-level PPO), or a critic-free one ("rloo", "grpo", "reinforce", "prefix_tree",
     "entropy_weighted", "mc_segment", "gigpo"), optionally kept only on low-probability tokens (SPO's mask);
  6. `ppo_update`: PPO epochs over mini-batches, the policy loss (marlhf.policy_losses; by default clipped, one ratio
     per segment), clipped value loss on segment values; then `adapt_kl_coef` under `kl_target`;
  7. `step_metrics`, checkpoint.
Beside the step, in their own modules: the asynchronous rollouts (marlhf.trainers.staleness), the token budget
(marlhf.trainers.token_budget) and the Monte-Carlo continuations (marlhf.trainers.continuations).

Defaults follow the paper (docs/algorithm.md) but two: `value_weighting="first"` (a macro action's value is that of
the state where it starts; Study I's pre-registered rule, benchmarks/results/credit_assignment/README.md) and
`lam=1` (Study II's, benchmarks/results/credit_assignment_lambda/README.md). `ratio_granularity`, `segment_reward`,
`last_token_own_segment` and `rm_score_clip` reproduce the released code's choices instead.

Data parallel (Accelerate; docs/distributed.md): every response has its own random stream keyed by (seed, step, row
among all processes' rows), and baselines, whitening and the loss's normalisation span all processes, so N processes
with P prompts each train like one with N x P and a resumed run samples what the uninterrupted one sampled. Under
DeepSpeed policy and critic get an engine each (marlhf.trainers.common.backward, optimizer_step).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from marlhf._checks import check_like, check_mask, check_segment_ids, trusted_inputs
from marlhf.advantages import kl_penalized_rewards, low_prob_advantage_mask, whiten
from marlhf.data.encoding import pad_sequences
from marlhf.data.records import prompt_records, require_fields
from marlhf.engines import Generation
from marlhf.estimators import AdvantageBatch
from marlhf.logging_utils import MetricsLogger, reduce_metrics
from marlhf.losses import loss_units, value_loss
from marlhf.metrics import row_l2, token_repetition
from marlhf.modeling import ScalarHeadModel, load_tokenizer, merge_lora
from marlhf.policy_losses import PolicyLossBatch
from marlhf.rollout import (Experience, RewardFn, response_logprobs, response_logprobs_and_entropy, response_values,
                            score_responses)
from marlhf.segments import num_segments, split_last_token
from marlhf.termination import SegmentationBatch, segment
from marlhf.trainers.common import (accumulation_context, backward, device_clock, gather_rows, make_accelerator,
                                    maybe_save_checkpoint, optimizer_step, own_rows, random_states_kept,
                                    records_from_config, save_final_model)
from marlhf.trainers.continuations import run_continuations
from marlhf.trainers.episodes import sample_and_score_episodes
from marlhf.trainers.ppo_config import PPOConfig
from marlhf.trainers.ppo_setup import Plugins, PPORun, build_models, mixed_seed, start_ppo_run
from marlhf.trainers.staleness import RolloutRequest, StaleRollouts
from marlhf.trainers.token_budget import goes_on

__all__ = ["PPOConfig", "train_ppo", "Experience"]

# after_step(steps_done, unwrapped policy, tokens generated so far or None): see train_ppo
StepCallback = Callable[[int, torch.nn.Module, "int | None"], None]


# ---------------------------------------------------------------------------------------------- the loop
def train_ppo(config: PPOConfig, prompts: list[str] | list[dict[str, Any]] | None = None, policy=None, ref=None,
              critic: ScalarHeadModel | None = None, reward_model: ScalarHeadModel | None = None, tokenizer=None,
              reward_fn: RewardFn | list[RewardFn] | None = None, after_step: StepCallback | None = None):
    """Train the policy with (MA-)PPO on `prompts` (strings, or {"prompt": ...} records whose other fields go to
    reward functions; default: config.dataset) and return it unwrapped. Models not passed in are loaded from the
    config's paths (`ref` is unused when `config.uses_reference` is False); `reward_fn` replaces the reward model as
    the source of scores. `after_step(steps_done, policy, generated_tokens)`, if given, runs on every process after
    each step with the unwrapped policy and the tokens generated so far (None without a token budget), e.g. to
    evaluate during training; the random states are restored after it. Metrics: OUTPUT_DIR/metrics.jsonl."""
    accelerator = make_accelerator(config)
    # The engine first: one that cannot run here (vLLM missing, engine arguments vLLM lacks) stops the run before
    # the models load and before anything is written to output_dir.
    plugins = Plugins.from_config(config)
    engine = plugins.make_engine(accelerator, config.max_length)
    with contextlib.closing(engine):  # when training ends, also on an error: an engine may hold a model and memory
        records = prompt_records(prompts) if prompts is not None else records_from_config(config, "rl", config.env)
        require_fields(records, ("prompt",), "rl")
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_name_or_path, "left")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (marlhf.modeling.load_tokenizer sets pad := eos)")
        models = build_models(config, records, accelerator.device, policy=policy, ref=ref, critic=critic,
                              reward_model=reward_model, reward_fn=reward_fn)
        run, start_step, logger, checkpointed = start_ppo_run(config, accelerator, plugins, engine, models, records,
                                                              tokenizer)
        train_steps(run, start_step, logger, checkpointed, after_step)
        logger.close()
        trained = policy = run.policy  # as prepared: under ZeRO-3 the final weights are gathered through its engine
        policy = accelerator.unwrap_model(policy)
        if config.use_lora:  # a plain model with the adapters merged in; the trained adapters stay as they are
            trained = policy = merge_lora(policy)
        # saved before the engine closes: vLLM's shutdown tears down the process group that saving waits on
        save_final_model(trained, tokenizer, config.output_dir, accelerator)
    return policy


def train_steps(run: PPORun, start_step: int, logger: MetricsLogger, checkpointed: tuple[dict, dict, dict],
                after_step: StepCallback | None = None) -> None:
    """The steps of the plan from `start_step` on, each the stages in order; metrics to `logger`, checkpoints of
    the `checkpointed` (models, optimizers, schedulers) by name. With a token budget the run ends at the first step
    whose generated tokens reach max_generated_tokens, and goes on past the plan's last step until they reach
    min_generated_tokens (marlhf.trainers.token_budget)."""
    config, accelerator, device, plan = run.config, run.accelerator, run.accelerator.device, run.plan
    # rollout workers: started here, stopped when the steps end, also on an error (no orphan process)
    run.rollouts = StaleRollouts.for_run(
        config, run.plugins.engine.options, accelerator.process_index, start_step, plan.total_steps,
        lambda step: _rollout_request(run, step)[1], run.sampling, run.episodes) \
        if config.async_rollout.rollout_workers else None
    # closed on any exception too (Ctrl-C), so that the error's line starts on a line of its own
    with contextlib.closing(run.rollouts) if run.rollouts else contextlib.nullcontext(), \
            tqdm(initial=start_step, total=plan.total_steps, desc="ppo",
                 disable=not accelerator.is_local_main_process) as progress:
        step = start_step
        while goes_on(config, run.generated_tokens, step, plan.total_steps):
            clock = {"start": device_clock(device)}  # each stage's end: the time/ metrics
            rows, request = _rollout_request(run, step)
            if config.env is None:
                generation = sample(run, step, request)  # 1.
                clock["generation"] = device_clock(device)
                experience = score(run, step, rows, request, generation)  # 2.
            else:  # 1. and 2. on the episodes of an environment
                experience = sample_and_score_episodes(run, step, rows, request, clock)
            clock["scoring"] = device_clock(device)
            experience = per_token_rewards(run, experience)  # 3.
            experience = macro_actions(run, experience)  # 4.
            experience = estimate_advantages(run, experience)  # 5.
            clock["advantages"] = device_clock(device)
            experience = ppo_update(run, experience)  # 6.
            if run.kl_control is not None:
                adapt_kl_coef(run, experience)
            if run.generated_tokens is not None:
                run.generated_tokens.add(accelerator, experience)
            clock["update"] = device_clock(device)

            done = step = step + 1  # 7. metrics and checkpoint
            if done % config.logging_steps == 0 or not goes_on(config, run.generated_tokens, done, plan.total_steps):
                clock["metrics"] = device_clock(device)
                metrics = step_metrics(run, experience, clock)
                logger.log(metrics, done)
                progress.set_postfix(reward=f"{metrics['objective/rm_score']:.3f}",
                                     **({"kl": f"{metrics['objective/kl']:.3f}"} if "objective/kl" in metrics else {}))
            progress.update()
            maybe_save_checkpoint(config, done, accelerator, *checkpointed, run.tokenizer)
            if after_step is not None:
                with random_states_kept(device):
                    after_step(done, accelerator.unwrap_model(run.policy),
                               None if run.generated_tokens is None else run.generated_tokens.total)


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
    row_seeds = [mixed_seed(config.seed, step, first_row + row) for row in range(config.rollout_size)]
    # A prompt's episodes start from one environment state (its first row's seed), as verl-agent's groups do: group
    # baselines and GiGPO's anchor states compare actions, not environments.
    n = config.num_samples_per_prompt
    env_seeds = [row_seeds[row - row % n] for row in range(config.rollout_size)]
    device = accelerator.device
    return rows, RolloutRequest(prompt_ids.to(device), prompt_mask.bool().to(device), row_seeds,
                                [run.prompt_records[i] for i in rows], env_seeds)


# ---------------------------------------------------------------------------------------------- the stages
def sample(run: PPORun, step: int, request: RolloutRequest) -> Generation:
    """Stage 1: the step's responses (a prompt's samples in consecutive rows), from the engine here with this step's
    policy or from the rollout workers (policy version max(start, step - max_staleness)), with the engine's own
    log-probs when anything keeps them (`score`)."""
    config, accelerator = run.config, run.accelerator
    run.train(False)  # generate with the KV cache (train mode with gradient checkpointing turns it off)
    run.engine.sync_weights(accelerator.unwrap_model(run.policy))
    wants_logprobs = config.keeps_sampling_logprobs or config.compares_rollout_logprobs
    with accelerator.autocast():
        if run.rollouts is None:
            generation = run.engine.generate(request.prompt_ids, request.prompt_mask, row_seeds=request.row_seeds,
                                             max_new_tokens=config.max_response_length,
                                             return_logprobs=wants_logprobs, **run.sampling)
        else:
            generation = run.rollouts.generation(step, accelerator.unwrap_model(run.policy))
    if wants_logprobs and generation.logprobs is None:
        raise ValueError(f"rollout engine {config.rollout_engine!r} returned no sampling log-probs, which "
                         "old_logprobs_from='sampling' and log_rollout_logprob_diff need")
    return generation


def score(run: PPORun, step: int, rows: list[int], request: RolloutRequest, generation: Generation) -> Experience:
    """Stage 2: the step's `Experience`, the responses scored (marlhf.rollout.score_responses). The policy's
    log-probs from a forward now, or from the sampling pass (old_logprobs_from='sampling'); with one update
    (`reuses_rollout_forward`) the policy's and critic's forwards keep their gradients (`attached_*`); the engine's
    log-probs are kept beside the trainer's when something compares them."""
    config, accelerator = run.config, run.accelerator
    batch = (request.prompt_ids, request.prompt_mask, generation.response_ids, generation.response_mask)
    with_entropy = run.plugins.estimator.reads_entropy  # from the policy's forward (PPOConfig.validate)
    with accelerator.autocast():
        logprobs = values = entropy = None
        if config.reuses_rollout_forward:  # with gradients: these are the update's forwards too
            logprobs, values, entropy = _attached_forwards(run, batch, with_entropy)
        elif config.keeps_sampling_logprobs:
            logprobs = generation.logprobs
        scored = score_responses(
            *batch, ref=run.ref, temperature=config.scoring_temperature, reward_model=run.reward_model,
            reward_fn=run.reward_fn, prompts=[run.prompt_records[i]["prompt"] for i in rows], tokenizer=run.tokenizer,
            reward_kwargs=run.record_fields(rows), with_entropy=with_entropy,
            piece_size=config.forward_batch_size or run.piece_size,
            policy=run.policy if logprobs is None else None, logprobs=logprobs, entropy=entropy,
            critic=None if config.reuses_rollout_forward else run.critic, values=values)
    attached = config.reuses_rollout_forward
    kept = config.compares_rollout_logprobs  # the engine's log-probs beside the trainer's, not instead of them
    return dataclasses.replace(scored, step=step, prompt_rows=rows, attached_logprobs=logprobs if attached else None,
                               attached_values=values if attached else None,
                               rollout_logprobs=generation.logprobs.detach() if kept else None)


def per_token_rewards(run: PPORun, experience: Experience) -> Experience:
    """Stage 3: the KL-penalised per-token rewards (without a reference the penalty is 0: kl_coef is 0), from
    the scores (an episode's: one per turn) clipped to rm_score_clip if set."""
    e, turn_ids = experience, experience.turn_ids
    scores = run.clipped(e.scores if turn_ids is None else e.turn_rewards)
    rewards = kl_penalized_rewards(scores, e.logprobs, e.ref_logprobs if e.ref_logprobs is not None else e.logprobs,
                                   e.actions, run.kl_coef, turn_ids=turn_ids)
    return dataclasses.replace(experience, rewards=rewards, kl_coef=run.kl_coef)


def macro_actions(run: PPORun, experience: Experience) -> Experience:
    """Stage 4: segment ids of the responses under the termination rule (marlhf.termination), and the rule's
    stats (the parsing rule: how many rows fell back to one token per segment)."""
    config, accelerator, mask = run.config, run.accelerator, experience.response_mask
    rule = run.plugins.termination
    batch = SegmentationBatch(experience.response_ids, mask, experience.ref_logprobs, run.tokenizer, rule.options,
                              seed=mixed_seed(config.seed, experience.step),
                              gather_rows=lambda x: gather_rows(accelerator, x),
                              own_rows=lambda x: own_rows(accelerator, x, like=mask), logprobs=experience.logprobs,
                              turn_ids=experience.turn_ids)  # mask: every real token, cut at turns (docs/multiturn.md)
    segment_ids, stats = segment(rule.plugin, batch)
    if config.last_token_own_segment:
        segment_ids = split_last_token(segment_ids, mask)
    return dataclasses.replace(experience, segment_ids=segment_ids, segmentation_stats=stats)


def estimate_advantages(run: PPORun, experience: Experience) -> Experience:
    """Stage 5: the estimator's advantages (and returns, with a critic), whitened if asked, then kept only on
    the tokens sampled with probability below `advantage_mask_threshold` if set (SPO's mask; after whitening, which
    would move the zeros). Batch statistics (baselines, whitening) are taken over the rows of all processes. An
    estimator that continues prefixes (`continue_and_score`) does so here, with the rollout's weights
    (marlhf.trainers.continuations); its continuation tokens are kept for the metrics."""
    config, accelerator, mask = run.config, run.accelerator, experience.actions
    estimator = run.plugins.estimator
    continuations = run_continuations(run, experience)
    advantages, returns = estimator(AdvantageBatch(
        experience.rewards, experience.values, mask, experience.segment_ids, estimator.options,
        num_samples_per_prompt=config.num_samples_per_prompt, value_weighting=config.value_weighting,
        gather_rows=lambda x: gather_rows(accelerator, x), own_rows=lambda x: own_rows(accelerator, x, like=mask),
        response_ids=experience.response_ids, entropy=experience.entropy, continue_and_score=continuations,
        turn_ids=experience.turn_ids, turn_state_ids=experience.turn_state_ids))
    if config.whiten_advantages:
        all_advantages = whiten(gather_rows(accelerator, advantages), gather_rows(accelerator, mask))
        advantages = own_rows(accelerator, all_advantages, like=mask)
    if config.advantage_mask_threshold is not None:
        advantages = low_prob_advantage_mask(advantages, experience.logprobs, mask, config.advantage_mask_threshold)
    return dataclasses.replace(experience, advantages=advantages, returns=returns,
                               continuation_tokens=continuations.tokens if continuations.calls else None)


def ppo_update(run: PPORun, experience: Experience) -> Experience:
    """Stage 6: PPO epochs over shuffled mini-batches, each split into length-sorted pieces; one optimizer
    step of policy (and critic) per mini-batch; during the critic warm-up (`critic_warmup_steps`) the critic alone.
    Keeps each loss statistic per piece (`update_stats`). No device read inside the pieces: the inputs are checked
    once here and the pieces' sizes come from host lengths; each optimizer step reads one number, the finite-update
    guard's gradient norm (a NaN or inf one skips the step)."""
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
    mask, segment_ids = experience.actions[index], experience.segment_ids[index]
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
    mask, processes = piece.actions, accelerator.num_processes
    stats = {}
    if train_policy:
        policy_loss = run.plugins.policy_loss
        weight = run.plugins.loss_units(mask, piece.segment_ids, config.loss_agg_mode) * processes / totals["policy"]
        with accumulation_context(accelerator, policy, is_last):
            logprobs = piece.attached_logprobs if piece.attached_logprobs is not None else response_logprobs(
                policy, *piece.model_inputs(), temperature=config.scoring_temperature)
            # with a stale rollout the engine's log-probs are the behaviour policy's, piece.logprobs the proximal's
            behaviour = piece.rollout_logprobs if config.async_rollout.max_staleness else None
            loss, loss_stats = policy_loss(PolicyLossBatch(logprobs, piece.logprobs, piece.advantages, mask,
                                                           piece.segment_ids, config.loss_agg_mode, num_slots,
                                                           policy_loss.options, piece.rollout_logprobs, behaviour))
            backward(accelerator, policy, loss * weight, is_last)
        logged = ("clipfrac", "approxkl", "tis_weight_mean", "behaviour_weight_mean", "behaviour_dropped")
        stats = {"loss/policy": loss.detach(), **{f"policy/{k}": loss_stats[k] for k in logged if k in loss_stats}}
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
    """After a step under `kl_target`: move the KL coefficient with the step's KL, over all processes' rows. The
    coefficient acts through the policy's next update: none while the critic warms up (a rate of 0 to the
    controller, which then stays)."""
    row_kl = torch.where(experience.actions, experience.logprobs - experience.ref_logprobs, 0.0).sum(1)
    policy_lr = next(u for u in run.updaters if u.role == "policy").optimizer.param_groups[0]["lr"]
    if experience.step + 1 < run.config.critic_warmup_steps:
        policy_lr = 0.0
    run.kl_control.update(run.accelerator.gather(row_kl).float().mean().item(), policy_lr)


def step_metrics(run: PPORun, experience: Experience, clock: dict[str, float]) -> dict[str, float]:
    """Stage 7: the step's metrics, reduced over processes (the one place a step reads values to the host); the
    time/ ones from the step's `clock` (when each stage ended, stamped by the loop)."""
    e, mask, accelerator = experience, experience.actions, run.accelerator
    # KL (with a reference) and entropy: sample estimates summed over a response's tokens, averaged over responses
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
        "time/update": clock["update"] - clock["scoring"],  # stage 5 (time/advantages) and 6
        "time/step_seconds": clock["metrics"] - clock["start"],
        "train/skipped_steps": sum(updater.guard.skipped for updater in run.updaters),
    }
    if e.returns is not None:
        metrics["val/return_l2"] = row_l2(e.returns, mask)
    if (run.config.log_rollout_logprob_diff or run.config.async_rollout.max_staleness) and \
            e.rollout_logprobs is not None:
        diff = torch.where(mask, (e.rollout_logprobs - e.logprobs).abs(), 0.0)
        metrics["rollout/logprob_diff_mean"] = diff.sum() / mask.sum().clamp(min=1)
        metrics["rollout/logprob_diff_max"] = accelerator.gather(diff.max()[None]).max()  # over processes
    # generated tokens: totals over all processes (the reduction below is a mean)
    metrics["rollout/tokens"] = mask.sum() * accelerator.num_processes
    if e.continuation_tokens is not None:
        metrics["rollout/mc_tokens"] = e.continuation_tokens * accelerator.num_processes
    if run.rollouts is not None:  # the worker's throughput, the trainer's wait, how stale the batch was
        metrics.update(run.rollouts.metrics)
    metrics.update({f"macro/{name}": value for name, value in e.segmentation_stats.items()})
    metrics.update({f"rewards/{name}": value for name, value in getattr(run.reward_fn, "last_means", {}).items()})
    metrics.update(e.env_metrics)
    metrics = reduce_metrics(metrics, accelerator)
    if run.kl_control is not None:
        metrics["objective/kl_coef"] = e.kl_coef
    if run.generated_tokens is not None:
        metrics["rollout/generated_tokens"] = run.generated_tokens.total
    return metrics


# ---------------------------------------------------------------------------------------------- helpers
def _attached_forwards(run: PPORun, batch: tuple[torch.Tensor, ...], with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The policy's log-probs, the critic's values (None without one) and the policy's entropy (None unless
    `with_entropy`) over `batch`, with gradients: one update per step backpropagates through them."""
    run.train()
    temperature = run.config.scoring_temperature
    logprobs, entropy = (response_logprobs_and_entropy(run.policy, *batch, temperature=temperature) if with_entropy
                         else (response_logprobs(run.policy, *batch, temperature=temperature), None))
    values = response_values(run.critic, *batch) if run.critic is not None else None
    return logprobs, values, entropy


def _check_update_inputs(experience: Experience) -> None:
    """What the update's pieces slice, checked once per step: the pieces then skip the value checks."""
    mask, gaps = experience.actions, experience.action_mask is not None  # gaps: a multi-turn episode's observations
    check_mask(mask, "action_mask" if gaps else "response_mask", gaps=gaps)
    check_segment_ids(experience.segment_ids, mask)
    for name in ("logprobs", "values", "advantages", "returns"):
        if getattr(experience, name) is not None:
            check_like(getattr(experience, name), mask, name)
