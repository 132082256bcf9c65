"""Issue 37's plug-ins in PPO: the termination rule `low_prob` (SPO's cutpoints), the estimators `prefix_tree`
(TEMPO) and `entropy_weighted` (GTPO / GRPO-S, from the policy's entropy at each token), and SPO's probability mask
for any estimator (`advantage_mask_threshold`). Each trains two steps on the tiny model, and what it computes inside the trainer
equals its pure function (marlhf.segments, marlhf.advantages) on the step's own tensors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import marlhf.trainers.ppo as ppo
from marlhf.advantages import entropy_weighted, grpo, prefix_tree_advantages, whiten
from marlhf.estimators import ESTIMATORS, AdvantageBatch
from marlhf.logging_utils import read_metrics
from marlhf.modeling import token_entropy
from marlhf.rollout import response_logprobs_and_entropy, score_responses
from marlhf.segments import low_prob_cutpoints
from marlhf.termination import TERMINATION_RULES, SegmentationBatch, segment
from marlhf.trainers.ppo import PPOConfig, train_ppo
from tests.trainers.test_ppo import RECORDS, _config, count_e

# The tiny random model samples its tokens with probability about 0.0036 to 0.0044 (temperature 0.8, top-k 50):
# this threshold puts some of a step's tokens on either side (asserted where it matters).
SPLIT = 0.0039


def _train(tmp_path, monkeypatch, models, stage: str, **options) -> list[tuple]:
    """Two PPO steps; returns (experience in, experience out) of the stage `stage` of marlhf.trainers.ppo per step."""
    seen = []
    real = getattr(ppo, stage)

    def recorded(run, experience, *args):
        seen.append((experience, real(run, experience, *args)))
        return seen[-1][1]

    monkeypatch.setattr(ppo, stage, recorded)
    make_policy, tokenizer = models
    train_ppo(_config(tmp_path, max_steps=2, **options), RECORDS, policy=make_policy(), tokenizer=tokenizer,
              reward_fn=count_e)
    metrics = read_metrics(tmp_path / "ppo")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(list(m.values()))).all() for m in metrics)
    assert len(seen) == 2
    return seen


def ppo_config_of(**options) -> PPOConfig:
    """A config to read traits and options off (no run)."""
    return PPOConfig(model_name_or_path="unused", kl_coef=0.0, **options)


@pytest.fixture
def models(make_tiny_causal_lm, tiny_tokenizer):
    return make_tiny_causal_lm, tiny_tokenizer


def test_low_prob_segments_are_the_cutpoints_of_the_rollout_logprobs(tmp_path, monkeypatch, models):
    options = dict(threshold=SPLIT, interval=2, max_tokens=3)
    seen = _train(tmp_path, monkeypatch, models, "macro_actions", termination="low_prob", termination_options=options,
                  kl_coef=0.0)
    for before, after in seen:
        mask, logprobs = before.response_mask, before.logprobs
        assert torch.equal(after.segment_ids, low_prob_cutpoints(mask, logprobs, **options))
        low = mask & (logprobs.double().exp() < SPLIT)
        assert low.any() and (mask & ~low).any()
    assert ppo_config_of(termination="low_prob").uses_reference is False  # reads the policy's, not the reference's


@pytest.mark.parametrize("normalize_std", [True, False])
def test_prefix_tree_in_ppo_is_the_pure_function(tmp_path, monkeypatch, models, normalize_std):
    seen = _train(tmp_path, monkeypatch, models, "estimate_advantages", advantage="prefix_tree",
                  num_samples_per_prompt=2, mini_batch_size=8, advantage_options={"normalize_std": normalize_std})
    for before, after in seen:
        expected = prefix_tree_advantages(before.rewards.sum(1), before.response_ids, before.response_mask, 2,
                                          normalize_std=normalize_std)
        assert torch.equal(after.advantages, expected) and after.returns is None
        assert after.advantages.abs().sum() > 0
    assert not ppo_config_of(advantage="prefix_tree", num_samples_per_prompt=2).uses_critic


@pytest.mark.parametrize("options", [
    dict(mini_batch_size=4),
    dict(mini_batch_size=8, advantage_options={"level": "sequence", "alpha1": 2.0, "alpha2": 0.5,
                                               "success_threshold": 0.0}),  # one update: the forward is reused
])
def test_entropy_weighted_in_ppo_is_the_pure_function_of_the_policys_entropy(tmp_path, monkeypatch, models, options):
    seen = _train(tmp_path, monkeypatch, models, "estimate_advantages", advantage="entropy_weighted",
                  num_samples_per_prompt=2, **options)
    config = ppo_config_of(advantage="entropy_weighted", num_samples_per_prompt=2, **options)
    o = config.plugin_options("advantage")
    policy, tokenizer = models[0](), models[1]
    for step, (before, after) in enumerate(seen):
        mask = before.response_mask
        expected = entropy_weighted(before.rewards.sum(1), before.entropy, mask, 2, o.level, o.alpha1, o.alpha2,
                                    o.success_threshold)
        assert torch.equal(after.advantages, expected) and after.advantages.abs().sum() > 0
        if step == 0:  # the initial policy's entropy, from its logits at the scoring temperature
            inputs = (before.prompt_ids, before.prompt_mask, before.response_ids, mask)
            logprobs, entropy = response_logprobs_and_entropy(policy, *inputs, temperature=config.temperature)
            torch.testing.assert_close(before.entropy, entropy)
            torch.testing.assert_close(before.logprobs, logprobs)
            assert (entropy[mask] > 0).all() and (entropy[mask] <= math.log(len(tokenizer)) + 1e-4).all()
            assert not torch.allclose(before.entropy[mask], -before.logprobs[mask])  # not the sampled surprisal


def test_entropy_is_the_distributions_and_kept_only_when_read(make_tiny_causal_lm, tiny_tokenizer):
    policy = make_tiny_causal_lm().eval()
    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[False, True, True], [True, True, True]])
    response = torch.tensor([[10, 11, 0], [12, 13, 14]]), torch.tensor([[True, True, False], [True, True, True]])
    scores = lambda prompts, responses: [0.0] * len(responses)  # noqa: E731
    common = dict(ref=None, temperature=0.7, reward_fn=scores, prompts=["a", "b"], tokenizer=tiny_tokenizer,
                  piece_size=1)
    kept = score_responses(*prompt, *response, policy=policy, with_entropy=True, **common)
    assert score_responses(*prompt, *response, policy=policy, **common).entropy is None
    logits = policy(input_ids=torch.cat([prompt[0], response[0]], 1)).logits  # no padding inside row 1
    probs = (logits[1, 2:-1] / 0.7).softmax(-1)
    torch.testing.assert_close(kept.entropy[1], -(probs * probs.log()).sum(-1))
    assert kept.entropy[0, 2] == 0  # padding
    assert token_entropy(torch.tensor([[[0.0, 0.0, -math.inf]]])).item() == pytest.approx(math.log(2))  # no NaN
    with pytest.raises(ValueError, match="rollout_logprobs='recompute'"):
        ppo_config_of(advantage="entropy_weighted", num_samples_per_prompt=2, rollout_logprobs="sampling",
                      mini_batch_size=4, per_device_batch_size=4)


def test_the_probability_mask_zeroes_exactly_the_high_probability_tokens(tmp_path, monkeypatch, models):
    """grpo's advantages, whitened, then 0 on every token sampled with probability >= the threshold, kept on the
    others."""
    seen = _train(tmp_path, monkeypatch, models, "estimate_advantages", advantage="grpo", num_samples_per_prompt=2,
                  mini_batch_size=8, whiten_advantages=True, advantage_mask_threshold=SPLIT)
    for before, after in seen:
        mask = before.response_mask
        unmasked = torch.where(mask, grpo(before.rewards.sum(1), 2)[:, None], 0.0)
        unmasked = whiten(unmasked, mask)
        low = mask & (before.logprobs.double().exp() < SPLIT)
        assert torch.equal(after.advantages, torch.where(low, unmasked, 0.0))
        assert (unmasked[low] != 0).any() and (unmasked[mask & ~low] != 0).any()  # both sides are tested


def test_estimators_gather_every_process_rows():
    """With the rows split over two processes, a group across both, each estimator sees all the rows of a group:
    each process's advantages are the whole batch's, cut to its rows."""
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 4, 0, 5, 2])[:, None]
    ids = torch.where(mask, torch.randint(0, 3, mask.shape, generator=g), 0)
    ids[1, :2] = ids[0, :2]  # two of the group of rows 0 to 2 share a prefix
    fields = {"rewards": torch.where(mask, torch.randn(mask.shape, generator=g), 0.0), "mask": mask,
              "response_ids": ids, "entropy": torch.where(mask, 3 * torch.rand(mask.shape, generator=g), 0.0)}
    for name in ("prefix_tree", "entropy_weighted"):
        estimator = ESTIMATORS[name]
        whole, _ = estimator.obj(_advantage_batch(estimator, fields, slice(None), lambda x: x, lambda x: x))
        assert whole.abs().sum() > 0
        halves = []
        for rows in (slice(0, 2), slice(2, 6)):  # the group of rows 0 to 2 on both processes

            def gather(x, rows=rows):
                """All processes' rows of the field whose rows `rows` x is (or of the summed rewards)."""
                for tensor in (*fields.values(), fields["rewards"].sum(1)):
                    if x.shape == tensor[rows].shape and torch.equal(x, tensor[rows]):
                        return tensor
                raise AssertionError("gathered a tensor that is no field of the batch")

            halves.append(estimator.obj(_advantage_batch(estimator, fields, rows, gather, lambda x, r=rows: x[r]))[0])
        assert torch.equal(torch.cat(halves), whole), name


def _advantage_batch(estimator, fields, rows, gather, own) -> AdvantageBatch:
    mask = fields["mask"][rows]
    return AdvantageBatch(fields["rewards"][rows], None, mask, mask.long().cumsum(1).sub(1).masked_fill(~mask, -1),
                          estimator.options(), num_samples_per_prompt=3, value_weighting="first", gather_rows=gather,
                          own_rows=own, response_ids=fields["response_ids"][rows], entropy=fields["entropy"][rows])


def test_options_are_checked_in_one_line_and_listed_in_help():
    from marlhf.cli import build_parser

    for options, message in [
        (dict(termination="low_prob", termination_options={"threshold": 1.5}),
         r"termination rule 'low_prob' option 'threshold' must be <= 1"),
        (dict(termination="low_prob", termination_options={"min_tokens": 4, "max_tokens": 3}),
         r"'min_tokens' \(4\) must be <= 'max_tokens' \(3\)"),
        (dict(advantage="entropy_weighted", num_samples_per_prompt=2, advantage_options={"level": "word"}),
         r"advantage estimator 'entropy_weighted' option 'level' must be one of \['token', 'sequence'\]"),
        (dict(advantage="prefix_tree"), r"advantage='prefix_tree' needs num_samples_per_prompt >= 2"),
        (dict(advantage_mask_threshold=-0.1), r"advantage_mask_threshold must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            ppo_config_of(**options)
    usage = build_parser("ppo")._subparsers._group_actions[0].choices["ppo"].format_help()
    usage = " ".join(usage.split())
    for listed in ("low_prob (threshold=0.9, interval=1, min_tokens=None, max_tokens=None)",
                   "prefix_tree (normalize_std=True)",
                   "entropy_weighted (level='token', alpha1=1.0, alpha2=0.1, success_threshold=0.5)",
                   "--advantage_mask_threshold", "entropy at each token"):
        assert listed in usage, listed


def test_low_prob_without_logprobs_is_refused(tiny_tokenizer):
    mask = torch.ones(1, 3, dtype=torch.bool)
    batch = SegmentationBatch(torch.zeros(1, 3, dtype=torch.long), mask, None, tiny_tokenizer,
                              TERMINATION_RULES["low_prob"].options(), seed=0)
    with pytest.raises(ValueError, match="needs the sampling policy's log-probs"):
        segment("low_prob", batch)
    batch = dataclasses.replace(batch, logprobs=torch.log(torch.tensor([[0.95, 0.5, 0.99]])))
    assert segment("low_prob", batch)[0].tolist() == [[0, 1, 1]]
