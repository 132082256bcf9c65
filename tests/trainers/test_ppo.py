from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import marlhf.estimators.gae as gae_estimator
import marlhf.policy_losses.ppo as ppo_loss
import marlhf.trainers.ppo as ppo
from marlhf.advantages import token_gae
from marlhf.checkpoint import list_checkpoints
from marlhf.logging_utils import read_metrics
from marlhf.losses import policy_loss, value_loss
from marlhf.modeling import ScalarHeadModel
from marlhf.rewards import code_reward_fn
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.killed_run import run_until_killed

TOPICS = ("cats", "dogs", "bread", "rain", "code", "tea", "maps", "boats")
RECORDS = [{"prompt": f"Human: say something about {topic}\n\nAssistant:"} for topic in TOPICS]


def count_e(prompts: list[str], responses: list[str]) -> list[float]:
    """A reward a tiny random model learns in a few steps: the number of 'e' in the response text."""
    return [float(response.count("e")) for response in responses]


def _config(tmp_path, **overrides) -> PPOConfig:
    values = dict(output_dir=str(tmp_path / "ppo"), model_name_or_path="unused", per_device_batch_size=4,
                  mini_batch_size=4, max_prompt_length=32, max_response_length=8, max_length=64, max_steps=2,
                  learning_rate=1e-2, critic_learning_rate=1e-2, warmup_ratio=0.0, lr_scheduler="constant",
                  save_steps=0, seed=3)
    values.update(overrides)
    return PPOConfig(**values)


def _metrics_without_timings(output_dir) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(output_dir)]


def test_reward_rises(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    config = _config(tmp_path, per_device_batch_size=8, num_samples_per_prompt=2, mini_batch_size=16, max_steps=8,
                     kl_coef=0.0, whiten_advantages=True)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    scores = [m["objective/rm_score"] for m in metrics]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.5, scores
    expected = {"objective/entropy", "objective/rm_score", "policy/clipfrac", "policy/approxkl",
                "val/advantage_l2", "val/return_l2", "time/step_seconds", "macro/mean_segment_length", "loss/policy",
                "loss/value", "time/generation", "time/scoring", "time/update", "objective/repetition"}
    assert expected <= set(metrics[0])
    assert "objective/kl" not in metrics[0]  # kl_coef 0 and fixed n-grams: no reference (the next test)
    assert metrics[0]["macro/mean_segment_length"] == pytest.approx(8 / 2)  # 8 tokens -> segments of 5 and 3
    assert (tmp_path / "ppo" / "model.safetensors").exists()


def test_without_a_reader_the_reference_is_dropped_and_nothing_else_changes(tmp_path, make_tiny_causal_lm,
                                                                            tiny_tokenizer, monkeypatch):
    """kl_coef 0 with a reference-free rule: no reference is scored (nor copied), no objective/kl is logged, and
    every other metric equals the run that keeps the reference for a rule that may read it."""
    from marlhf.termination import TERMINATION_RULES, register_termination

    references = []
    real_score = ppo.score_responses
    monkeypatch.setattr(ppo, "score_responses",
                        lambda *a, ref, **k: references.append(ref) or real_score(*a, ref=ref, **k))
    fixed = TERMINATION_RULES["fixed"]
    register_termination("fixed_reading_reference", options=fixed.options)(fixed.obj)
    try:
        runs = {}
        for termination in ("fixed", "fixed_reading_reference"):
            config = _config(tmp_path, output_dir=str(tmp_path / termination), termination=termination, kl_coef=0.0,
                             ngram=3, max_steps=2, mini_batch_size=2)
            assert config.uses_reference == (termination != "fixed")
            train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
            runs[termination] = _metrics_without_timings(tmp_path / termination)
    finally:
        TERMINATION_RULES.pop("fixed_reading_reference")
    assert references[:2] == [None, None] and all(ref is not None for ref in references[2:])
    kept = runs["fixed_reading_reference"]
    assert all(m.pop("objective/kl") is not None for m in kept)
    assert runs["fixed"] == kept
    assert _config(tmp_path, kl_coef=0.0, termination="perplexity").uses_reference
    assert _config(tmp_path, kl_coef=0.01).uses_reference


def test_ngram_one_equals_token_level_ppo(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    """fixed n=1 through macro_gae and the segment-level losses gives exactly the run forced through
    token_gae and the losses without segments."""
    def run(output_dir, ngram=1):
        config = _config(tmp_path, output_dir=str(output_dir), termination="fixed", ngram=ngram, max_steps=2,
                         mini_batch_size=2)
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        return _metrics_without_timings(output_dir)

    macro = run(tmp_path / "macro")
    whole = run(tmp_path / "whole", ngram=None)  # same first rollout, other macro actions: other advantages
    assert whole[0]["objective/rm_score"] == macro[0]["objective/rm_score"]
    assert whole[0]["val/advantage_l2"] != pytest.approx(macro[0]["val/advantage_l2"])
    calls = []

    def forced_token_gae(rewards, values, mask, segment_ids, gamma, lam, value_weighting, segment_reward, discount):
        calls.append(segment_ids)
        return token_gae(rewards, values, mask, gamma, lam)

    monkeypatch.setattr(gae_estimator, "macro_gae", forced_token_gae)
    monkeypatch.setattr(ppo_loss, "policy_loss", lambda *args: policy_loss(*args[:4], None, *args[5:]))
    monkeypatch.setattr(ppo, "value_loss", lambda *args: value_loss(*args[:4], None, *args[5:]))
    token = run(tmp_path / "token")
    assert len(calls) == 2 and all(c.max() == c.shape[1] - 1 for c in calls)
    assert macro[-1]["macro/mean_segment_length"] == 1.0
    assert token == macro


@pytest.mark.parametrize("options", [
    dict(advantage="rloo", num_samples_per_prompt=2, mini_batch_size=8),
    dict(advantage="grpo", num_samples_per_prompt=2, mini_batch_size=4, termination="fixed", ngram=None),
    dict(advantage="reinforce", termination="perplexity", whiten_advantages=True),
    dict(termination="randomized", randomized_lengths=(1, 2), repeat_times=2, ppo_epochs=2,
         gradient_accumulation_steps=2, value_weighting="position"),
    dict(termination="parsing", parsing_language="python", last_token_own_segment=True, ratio_granularity="token",
         segment_reward="mean", rm_score_clip=0.01, value_clip_range=None, value_weighting="unit"),
    dict(termination="word", value_weighting="first", segment_weighting="geometric"),
])
def test_estimators_and_options_run(tmp_path, make_tiny_causal_lm, tiny_tokenizer, options):
    config = _config(tmp_path, save_steps=2, **options)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(list(m.values()))).all() for m in metrics)
    checkpoint = list_checkpoints(tmp_path / "ppo")[-1]
    assert (checkpoint / "policy" / "model.safetensors").exists()
    uses_critic = config.advantage == "gae"
    assert ("loss/value" in metrics[0]) == uses_critic
    assert (checkpoint / "critic").exists() == uses_critic
    assert (checkpoint / "optimizer.critic.json").exists() == uses_critic
    if config.termination == "parsing":
        assert "macro/parse_fallbacks" in metrics[0]
    if config.termination_options == {"ngram": None}:  # one segment per response
        assert metrics[0]["macro/mean_segment_length"] == pytest.approx(metrics[0]["objective/response_length"])


@pytest.mark.parametrize("options", [
    dict(),
    dict(advantage="rloo", num_samples_per_prompt=2, mini_batch_size=8, whiten_advantages=True),
    dict(use_lora=True, lora_r=4, gradient_checkpointing=True),
], ids=["gae", "rloo-whitened", "lora-checkpointing"])
def test_reusing_the_rollout_forward_equals_recomputing_it(tmp_path, make_tiny_causal_lm, tiny_tokenizer,
                                                           monkeypatch, options):
    """With one update per step the rollout's policy and critic forwards double as the update's: same
    weights and metrics as running them again, one policy forward fewer per step."""
    import marlhf.rollout as rollout

    config = _config(tmp_path, max_steps=3, **options)
    assert config.reuses_rollout_forward
    results = {}
    for reuse in (True, False):
        calls = []

        def counting(forward):
            return lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)

        monkeypatch.setattr(PPOConfig, "reuses_rollout_forward", property(lambda self, reuse=reuse: reuse))
        monkeypatch.setattr(ppo, "response_logprobs", counting(rollout.response_logprobs))
        monkeypatch.setattr(rollout, "response_logprobs", counting(rollout.response_logprobs))
        output_dir = tmp_path / f"reuse_{reuse}"
        policy = train_ppo(dataclasses.replace(config, output_dir=str(output_dir)), RECORDS,
                           policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        monkeypatch.undo()
        results[reuse] = (policy.state_dict(), _metrics_without_timings(output_dir), len(calls))
    (reused, reused_metrics, reused_calls), (recomputed, recomputed_metrics, recomputed_calls) = results.values()
    assert (reused_calls, recomputed_calls) == (2 * 3, 3 * 3)  # policy + reference (+ the update's policy forward)
    for name, tensor in recomputed.items():
        # rows meet the update in another order (summation order), and Adam at lr 1e-2 amplifies that
        torch.testing.assert_close(reused[name], tensor, rtol=0, atol=2e-5, msg=name)
    assert any(not torch.equal(reused[name], w) for name, w in make_tiny_causal_lm().state_dict().items())
    for mine, theirs in zip(reused_metrics, recomputed_metrics, strict=True):
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6)


def test_sampling_pass_logprobs_save_a_forward_and_train_alike(tmp_path, make_tiny_causal_lm, tiny_tokenizer,
                                                               monkeypatch):
    import marlhf.rollout as rollout

    config = _config(tmp_path, mini_batch_size=2, max_steps=3)  # two updates a step: no forward is reused
    results = []
    for source in ("recompute", "sampling"):
        calls = []
        forward = rollout.response_logprobs
        monkeypatch.setattr(rollout, "response_logprobs", lambda *a, **k: calls.append(1) or forward(*a, **k))
        output_dir = tmp_path / source
        policy = train_ppo(dataclasses.replace(config, output_dir=str(output_dir), rollout_logprobs=source), RECORDS,
                           policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        monkeypatch.undo()
        results.append((policy.state_dict(), read_metrics(output_dir), len(calls)))
    (recomputed, recomputed_metrics, recomputed_calls), (sampled, sampled_metrics, sampled_calls) = results
    # per step, in two chunks of the update's piece size: policy + reference, or the reference only
    assert (recomputed_calls, sampled_calls) == (2 * 2 * 3, 1 * 2 * 3)
    for name, tensor in recomputed.items():
        torch.testing.assert_close(sampled[name], tensor, rtol=0, atol=1e-4, msg=name)
    for mine, theirs in zip(sampled_metrics, recomputed_metrics, strict=True):
        assert mine["objective/kl"] == pytest.approx(theirs["objective/kl"], abs=1e-4)


@pytest.mark.parametrize("weighting", [
    {}, dict(segment_weighting="uniform", termination="word", value_weighting="first"),
    dict(loss_agg_mode="seq-mean-token-mean", value_loss_granularity="token", ngram=3),
], ids=["tokens", "uniform-word", "released-aggregation"])
def test_update_and_scoring_pieces_do_not_change_the_run(tmp_path, make_tiny_causal_lm, tiny_tokenizer,
                                                                 weighting):
    """Rows scored and updated in small length-sorted pieces with their padding cut train like one piece (with
    a plain mean over macro actions, each piece weighs by its share of the mini-batch's macro actions)."""
    records = [{"prompt": "Human: " + "more " * k + "\n\nAssistant:"} for k in (0, 9, 2, 14, 5, 1, 11, 3)]
    config = _config(tmp_path, per_device_batch_size=8, mini_batch_size=8, ppo_epochs=2, max_steps=2,
                     max_prompt_length=96, max_length=128, **weighting)
    runs = []
    for options in (dict(), dict(gradient_accumulation_steps=4, forward_batch_size=3)):
        output_dir = tmp_path / f"run_{len(runs)}"
        policy = train_ppo(dataclasses.replace(config, output_dir=str(output_dir), **options), records,
                           policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        runs.append((policy.state_dict(), _metrics_without_timings(output_dir)))
    (one_piece, one_piece_metrics), (pieces, pieces_metrics) = runs
    for name, tensor in one_piece.items():
        # float summation order differs; Adam at lr 1e-2 moves each weight by ~1e-2 a step, a misplaced row or
        # column by that much
        torch.testing.assert_close(pieces[name], tensor, rtol=0, atol=1e-4, msg=name)
    for mine, theirs in zip(pieces_metrics, one_piece_metrics, strict=True):
        # per-piece means of the losses are averaged over pieces: only the batch-level figures must agree
        batch_level = {k: v for k, v in theirs.items() if not k.startswith(("loss/", "policy/", "val/clipfrac"))}
        assert {k: mine[k] for k in batch_level} == pytest.approx(batch_level, rel=1e-5, abs=1e-6)


def test_a_static_kv_cache_trains_exactly_like_the_dynamic_one(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    runs = []
    for kv_cache in ("dynamic", "static"):
        output_dir = tmp_path / kv_cache
        policy = train_ppo(_config(tmp_path, output_dir=str(output_dir), kv_cache=kv_cache), RECORDS,
                           policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
        runs.append((policy.state_dict(), _metrics_without_timings(output_dir)))
    (dynamic, dynamic_metrics), (static, static_metrics) = runs
    assert static_metrics == dynamic_metrics
    assert all(torch.equal(static[name], tensor) for name, tensor in dynamic.items())


def test_raw_logits_convention_scores_at_temperature_one(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    """logprob_temperature='raw' (the released code): ratio, KL and perplexity log-probs from raw logits, while
    sampling keeps the temperature."""
    seen = []
    original = ppo.response_logprobs

    def spy(*args, temperature, **kwargs):
        seen.append(temperature)
        return original(*args, temperature=temperature, **kwargs)

    monkeypatch.setattr(ppo, "response_logprobs", spy)
    monkeypatch.setattr("marlhf.rollout.response_logprobs", spy)
    config = _config(tmp_path, temperature=0.7, logprob_temperature="raw", mini_batch_size=2, max_steps=1)
    assert config.scoring_temperature == 1.0 and _config(tmp_path, temperature=0.7).scoring_temperature == 0.7
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert seen and set(seen) == {1.0}
    with pytest.raises(ValueError, match="old_logprobs_from"):
        _config(tmp_path, logprob_temperature="raw", rollout_logprobs="sampling")


def test_config_validation():
    with pytest.raises(ValueError, match="num_samples_per_prompt"):
        PPOConfig(advantage="rloo")
    with pytest.raises(ValueError, match="kv_cache='static' needs mixed_precision='no'"):
        PPOConfig(kv_cache="static", mixed_precision="bf16")
    with pytest.raises(ValueError, match="mini_batch_size"):
        PPOConfig(per_device_batch_size=4, mini_batch_size=3)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        PPOConfig(per_device_batch_size=4, mini_batch_size=4, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="max_length"):
        PPOConfig(max_prompt_length=512, max_response_length=600)
    with pytest.raises(ValueError, match="ngram"):
        PPOConfig(ngram=0)
    with pytest.raises(ValueError, match="segment_weighting"):
        PPOConfig(segment_weighting="uniform", ratio_granularity="token")
    with pytest.raises(ValueError, match="segment_weighting"):
        PPOConfig(segment_weighting="uniform", loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError, match="critic_warmup_steps=2 needs a critic; advantage='rloo'"):
        PPOConfig(advantage="rloo", num_samples_per_prompt=2, critic_warmup_steps=2)
    with pytest.raises(ValueError, match="kl_target adapts kl_coef"):
        PPOConfig(kl_target=6.0, kl_coef=0.0)
    with pytest.raises(ValueError, match="kl_horizon"):
        PPOConfig(kl_target=6.0, kl_horizon=1, per_device_batch_size=8)
    with pytest.raises(ValueError, match="lam_critic must be <= 1"):
        PPOConfig(lam_critic=1.5)
    defaults = PPOConfig()
    gae, ppo_loss = defaults.plugin_options("advantage"), defaults.plugin_options("policy_loss")
    assert (gae.lam_critic, gae.lam_schedule, defaults.critic_warmup_steps, defaults.kl_control.kl_target) == (
        None, "constant", 0, None)
    assert (ppo_loss.clip_range, gae.gamma, gae.lam, defaults.kl_coef, defaults.ppo_epochs) == (
        0.2, 1.0, 1.0, 0.05, 1)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.8, 50, 1.0)
    assert (defaults.max_prompt_length, defaults.max_response_length) == (512, 512)
    assert (ppo_loss.ratio_granularity, gae.segment_reward, defaults.last_token_own_segment,
            defaults.rm_score_clip) == ("macro", "sum", False, None)


def test_long_prompts_are_dropped_and_missing_reward_is_an_error(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    config = _config(tmp_path, max_prompt_length=8)
    with pytest.raises(ValueError, match="every prompt is longer"):
        train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    with pytest.raises(ValueError, match="reward_model_name_or_path"):
        train_ppo(_config(tmp_path), RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer)


def test_long_prompts_truncate_like_the_other_stages(tmp_path, make_tiny_causal_lm, tiny_tokenizer, monkeypatch):
    """long_prompts="truncate": a prompt over max_prompt_length keeps its last tokens and its leading special
    tokens, exactly as SFT, reward modelling, DPO and evaluation encode it (prompt_token_ids)."""
    from marlhf.data.encoding import prompt_token_ids

    seen = []
    real = ppo.pad_sequences
    monkeypatch.setattr(ppo, "pad_sequences", lambda rows, *a, **k: (seen.extend(rows), real(rows, *a, **k))[1])
    config = _config(tmp_path, max_prompt_length=8, long_prompts="truncate", max_steps=1)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    expected = [prompt_token_ids(tiny_tokenizer, r["prompt"], 8) for r in RECORDS]
    assert all(len(ids) == 8 for ids in expected) and seen and all(ids in expected for ids in seen)
    assert all(len(tiny_tokenizer(r["prompt"])["input_ids"]) > 8 for r in RECORDS)  # every prompt was cut
    with pytest.raises(ValueError, match="long_prompts"):
        PPOConfig(long_prompts="keep")


def test_code_reward_fn_scores_programs_on_their_record_tests():
    tests = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    score = code_reward_fn([{"prompt": "add", "input_output": tests}])
    assert score(["add", "add"], ["a, b = map(int, input().split())\nprint(a + b)\n", "print(("]) == [1.0, -1.0]
    with pytest.raises(ValueError, match="input_output"):
        code_reward_fn([{"prompt": "add"}])
    with pytest.raises(ValueError, match="different unit tests"):
        code_reward_fn([{"prompt": "add", "input_output": tests}, {"prompt": "add", "input_output": "{}"}])


def test_critic_warmup_trains_the_critic_alone(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    policy, critic = make_tiny_causal_lm(), ScalarHeadModel(make_tiny_causal_lm(seed=5).model)
    start_policy = {k: v.clone() for k, v in policy.state_dict().items()}
    start_critic = {k: v.clone() for k, v in critic.state_dict().items()}
    config = _config(tmp_path, max_steps=2, critic_warmup_steps=2)
    train_ppo(config, RECORDS, policy=policy, critic=critic, tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert all(torch.equal(v, start_policy[k]) for k, v in policy.state_dict().items())
    assert not all(torch.equal(v, start_critic[k]) for k, v in critic.state_dict().items())
    metrics = read_metrics(tmp_path / "ppo")
    assert all("loss/value" in m and "loss/policy" not in m for m in metrics)

    train_ppo(_config(tmp_path, output_dir=str(tmp_path / "after"), max_steps=3, critic_warmup_steps=2), RECORDS,
              policy=policy, tokenizer=tiny_tokenizer, reward_fn=count_e)  # the policy trains from step 3
    assert ["loss/policy" in m for m in read_metrics(tmp_path / "after")] == [False, False, True]
    assert not all(torch.equal(v, start_policy[k]) for k, v in policy.state_dict().items())


def test_adaptive_kl_moves_the_coefficient_towards_the_target(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    config = _config(tmp_path, max_steps=5, kl_coef=0.1, kl_target=0.5, kl_horizon=10)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    coefs = [m["objective/kl_coef"] for m in metrics]
    assert coefs[0] == 0.1
    errors = [max(-0.2, min(0.2, m["objective/kl"] / 0.5 - 1)) for m in metrics]
    assert errors[0] == -0.2 and max(errors) > 0  # KL 0 at the first step (policy = reference), then above
    for error, coef, next_coef in zip(errors, coefs, coefs[1:]):
        assert next_coef == pytest.approx(coef * (1 + error * 4 / 10))
    train_ppo(_config(tmp_path, output_dir=str(tmp_path / "fixed")), RECORDS, policy=make_tiny_causal_lm(),
              tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert "objective/kl_coef" not in read_metrics(tmp_path / "fixed")[0]


@pytest.mark.parametrize("lora, noise, extra", [  # each kills a child process: full by default, the rest slow
    (False, "row_generators", {}), pytest.param(True, "row_generators", {}, marks=pytest.mark.slow),
    pytest.param(False, "counter_hash", {}, marks=pytest.mark.slow),
    pytest.param(False, "row_generators", dict(kl_target=1e-3, kl_horizon=4, critic_warmup_steps=1, lam_critic=1.0),
                 marks=pytest.mark.slow)],
    ids=["full", "lora", "counter_hash", "adaptive_kl_warmup"])
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, tiny_model_dir, make_tiny_causal_lm, lora, noise,
                                                         extra):
    """Loaded from directories as the CLI does: policy/reference from the SFT dir, critic and frozen reward
    model from the reward-model dir. Killed after logging step 2 (before its checkpoint), resumed from
    checkpoint-1: steps 2 and 3 and the final policy must come out as in the uninterrupted run. A LoRA run's
    checkpoints hold the adapters (and the critic's head) only; the frozen weights come from the paths again."""
    torch.manual_seed(0)
    reward_model_dir = tmp_path / "rm"
    ScalarHeadModel(make_tiny_causal_lm(seed=7).model).save_pretrained(reward_model_dir)
    common = dict(model_name_or_path=str(tiny_model_dir), reward_model_name_or_path=str(reward_model_dir),
                  max_steps=3, save_steps=1, save_total_limit=1, mini_batch_size=2, sampling_noise=noise, **extra)
    if lora:
        common.update(use_lora=True, lora_r=4, lora_alpha=8.0)
    straight = _config(tmp_path, output_dir=str(tmp_path / "straight"), **common)
    train_ppo(straight, RECORDS)

    crashed = _config(tmp_path, output_dir=str(tmp_path / "crashed"), **common)
    run_until_killed("marlhf.trainers.ppo", "PPOConfig", "train_ppo", crashed, RECORDS, kill_after=2,
                     work_dir=tmp_path)
    checkpoint = tmp_path / "crashed" / "checkpoint-1"
    assert list_checkpoints(tmp_path / "crashed") == [checkpoint]
    assert {p.name for p in checkpoint.iterdir()} >= {
        "policy", "critic", "optimizer.policy.json", "optimizer.critic.json", "scheduler.policy.json",
        "rng_state.0.json", "trainer_state.json"}
    assert (checkpoint / "policy" / "model.safetensors").exists() != lora
    if lora:
        critic_files = {p.name for p in (checkpoint / "critic").iterdir()}
        assert {"adapter_model.safetensors", "scalar_head.safetensors"} <= critic_files
    assert read_metrics(tmp_path / "crashed")[-1]["step"] == 2

    train_ppo(dataclasses.replace(crashed, resume="latest"), RECORDS)
    after_resume = _metrics_without_timings(tmp_path / "crashed")
    assert [m["step"] for m in after_resume] == [1, 2, 3]
    assert after_resume == _metrics_without_timings(tmp_path / "straight")
    if "kl_target" in extra:  # the coefficient the killed run had reached came back from the checkpoint
        assert len({m["objective/kl_coef"] for m in after_resume}) == 3
    resumed_policy = load_file(str(tmp_path / "crashed" / "model.safetensors"))
    straight_policy = load_file(str(tmp_path / "straight" / "model.safetensors"))
    assert resumed_policy.keys() == straight_policy.keys()
    assert all(torch.equal(resumed_policy[k], straight_policy[k]) for k in straight_policy)


def test_prompts_as_strings_train_like_records(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    for name, prompts in (("records", RECORDS), ("strings", [r["prompt"] for r in RECORDS])):
        train_ppo(_config(tmp_path, output_dir=str(tmp_path / name), max_steps=1), prompts,
                  policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert _metrics_without_timings(tmp_path / "strings") == _metrics_without_timings(tmp_path / "records")


def test_rollout_logprob_diff_only_adds_its_metrics(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    """The hf engine's KV-cached sampling pass against the trainer's full forward: the same numbers up to float32
    rounding; asking for them changes nothing else (same tokens, same updates)."""
    metrics = {}
    for name, extra in (("default", {}), ("diff", dict(log_rollout_logprob_diff=True))):
        train_ppo(_config(tmp_path / name, **extra), RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer,
                  reward_fn=count_e)
        metrics[name] = _metrics_without_timings(tmp_path / name / "ppo")
    for default, diff in zip(metrics["default"], metrics["diff"]):
        assert {key for key in default if key.startswith("rollout/")} == {"rollout/tokens"}  # logged every step
        assert {key: value for key, value in diff.items() if not key.startswith("rollout/logprob_diff")} == default
        assert 0 <= diff["rollout/logprob_diff_mean"] <= diff["rollout/logprob_diff_max"] < 1e-4


def test_truncated_importance_sampling_runs(tmp_path, make_tiny_causal_lm, tiny_tokenizer):
    config = _config(tmp_path, tis_cap=2.0, ngram=3, per_device_batch_size=8, mini_batch_size=4)
    train_ppo(config, RECORDS, policy=make_tiny_causal_lm(), tokenizer=tiny_tokenizer, reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert all(m["policy/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3) for m in metrics)  # hf: on-policy
    assert "rollout/logprob_diff_mean" not in metrics[0]


def test_rollout_logprob_options_errors():
    with pytest.raises(ValueError, match="old_logprobs_from='recompute'"):
        PPOConfig(log_rollout_logprob_diff=True, rollout_logprobs="sampling", mini_batch_size=4)
    with pytest.raises(ValueError, match="logprob_temperature='sampling'"):
        PPOConfig(tis_cap=2.0, logprob_temperature="raw")
    with pytest.raises(ValueError, match="tis_cap must be > 0|tis_cap.*> 0"):
        PPOConfig(tis_cap=0.0)
    assert PPOConfig(tis_cap=2.0).plugin_options("policy_loss").tis_cap == 2.0
