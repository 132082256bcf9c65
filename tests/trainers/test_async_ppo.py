"""Bounded-staleness PPO (PPOConfig.max_staleness, docs/async.md): the decoupled loss against a slow reference,
the staleness schedule, and runs with a rollout worker."""

from __future__ import annotations

import dataclasses
import math
import time
import types
from pathlib import Path

import pytest
import torch

from marlhf.advantages import macro_gae
from marlhf.engines import Generation
from marlhf.logging_utils import read_metrics
from marlhf.losses import behaviour_weights, policy_loss
from marlhf.segments import fixed_ngram, randomized_ngram
from marlhf.trainers.staleness import RolloutRequest, StaleRollouts, behaviour_version
from marlhf.trainers.ppo import train_ppo
from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer
from tests.reference import random_batch, segments_of_row
from tests.sweeps import seeds
from tests.trainers.killed_run import run_until_killed
from tests.trainers.test_ppo import RECORDS, _config, _metrics_without_timings, count_e


# ------------------------------------------------------------------------------- the loss, against a reference
def decoupled_loss_ref(logprobs, prox, behav, advantages, segment_ids, clip, cap, correction, granularity):
    """Decoupled PPO from its definition, one unit at a time: the ratio pi / pi_prox clipped around 1, the unit's
    surrogate times its behaviour weight w = prod over its tokens of pi_prox / pi_behav (decoupled: w, or 0 when
    w > cap; tis: min(w, cap)), times its token count, over the batch's tokens."""
    total, tokens = 0.0, 0
    for b in range(len(logprobs)):
        for positions in segments_of_row(segment_ids[b]):
            for group in ([positions] if granularity == "macro" else [[t] for t in positions]):
                ratio = math.exp(sum(logprobs[b][t] - prox[b][t] for t in group))
                a = advantages[b][group[0]]
                surrogate = max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
                w = math.prod(math.exp(prox[b][t] - behav[b][t]) for t in group)
                if cap is not None:
                    w = (w if w <= cap else 0.0) if correction == "decoupled" else min(w, cap)
                total += w * surrogate * len(group)
            tokens += len(positions)
    return total / max(tokens, 1)


def _stale_batch(seed: int, batch: int = 9, width: int = 13):
    g = torch.Generator().manual_seed(seed)
    mask, _ = random_batch(batch, width, g)  # ragged: lengths 0 (all padding), 1 and the full width among them
    prox = -torch.rand(batch, width, generator=g, dtype=torch.double) * 3
    behav = prox + 0.5 * torch.randn(batch, width, generator=g, dtype=torch.double)  # an older policy version
    new = prox + 0.3 * torch.randn(batch, width, generator=g, dtype=torch.double)
    rewards = torch.randn(batch, width, generator=g, dtype=torch.double)
    values = torch.randn(batch, width, generator=g, dtype=torch.double)
    return mask, prox, behav, new, rewards, values, g


@pytest.mark.parametrize("seed", seeds(3))
@pytest.mark.parametrize("correction", ["decoupled", "tis"])
@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("granularity", ["macro", "token"])
def test_decoupled_loss_matches_the_slow_reference(seed, correction, cap, granularity):
    mask, prox, behav, new, rewards, values, g = _stale_batch(seed)
    for ids in (fixed_ngram(mask, 1), fixed_ngram(mask, 3), randomized_ngram(mask, generator=g)):
        adv, _ = macro_gae(rewards, values, mask, ids)
        loss, stats = policy_loss(new, prox, adv, mask, ids, clip=0.2, ratio_granularity=granularity,
                                  behaviour_logprobs=behav, behaviour_cap=cap, staleness_correction=correction)
        expected = decoupled_loss_ref(new.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), ids.tolist(), 0.2,
                                      cap, correction, granularity)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert torch.isfinite(stats["behaviour_weight_mean"])


def test_decoupled_loss_on_policy_is_the_plain_loss_exactly():
    """Behaviour = proximal (max_staleness 0's rollout) gives weights 1: the plain loss and gradient, bit for bit;
    all-padding rows add nothing and make no NaN."""
    mask, prox, _, new, rewards, values, g = _stale_batch(0)
    mask[2:4] = False  # two more rows of padding only
    ids = fixed_ngram(mask, 3)
    adv, _ = macro_gae(rewards, values, mask, ids)
    for correction in ("decoupled", "tis"):
        plain_new = new.clone().requires_grad_()
        plain, _ = policy_loss(plain_new, prox, adv, mask, ids)
        plain.backward()
        stale_new = new.clone().requires_grad_()
        stale, stats = policy_loss(stale_new, prox, adv, mask, ids, behaviour_logprobs=prox.clone(),
                                   behaviour_cap=2.0, staleness_correction=correction)
        stale.backward()
        assert torch.equal(plain, stale) and torch.equal(plain_new.grad, stale_new.grad)
        assert stats["behaviour_weight_mean"].item() == 1.0 and stats["behaviour_dropped"].item() == 0.0
    empty = torch.zeros_like(mask)
    loss, _ = policy_loss(new, prox, adv, empty, fixed_ngram(empty, 3), behaviour_logprobs=prox - 1.0,
                          behaviour_cap=2.0)
    assert loss.item() == 0.0


def test_behaviour_weights_drop_or_truncate_above_the_cap():
    log_ratio = torch.tensor([[math.log(0.5), math.log(2.0), math.log(4.0), 0.0]])
    units = torch.tensor([[True, True, True, False]])
    assert behaviour_weights(log_ratio, units, 3.0, "decoupled")[0].tolist() == pytest.approx([0.5, 2.0, 0.0, 0.0])
    assert behaviour_weights(log_ratio, units, 3.0, "tis")[0].tolist() == pytest.approx([0.5, 2.0, 3.0, 0.0])
    assert behaviour_weights(log_ratio, units, None, "decoupled")[0].tolist() == pytest.approx([0.5, 2.0, 4.0, 0.0])
    with pytest.raises(ValueError, match="behaviour_cap"):
        behaviour_weights(log_ratio, units, 0.0)
    with pytest.raises(ValueError, match="staleness_correction"):
        behaviour_weights(log_ratio, units, 1.0, "clip")
    with pytest.raises(ValueError, match="two corrections"):
        policy_loss(log_ratio, log_ratio, log_ratio, units, behaviour_logprobs=log_ratio, rollout_logprobs=log_ratio,
                    tis_cap=2.0)


# ------------------------------------------------------------------------------- the schedule
class _FakeWorker:
    """In-process stand-in for a RolloutWorker: records which policy version each request was sampled by."""

    def __init__(self) -> None:
        self.version, self.sampled_by, self.weights_sent = None, {}, 0

    def send_weights(self, policy) -> None:
        self.version, self.weights_sent = policy.version, self.weights_sent + 1

    def submit(self, step, prompt_ids, prompt_mask, *, row_seeds, **sampling) -> None:
        self.sampled_by[step] = self.version

    def result(self, step):
        rows = 2
        return Generation(torch.full((rows, 3), step), torch.ones(rows, 3, dtype=torch.bool),
                          torch.zeros(rows, 3)), 0.1, 6

    def close(self) -> None:
        pass


def test_behaviour_version_table():
    assert [behaviour_version(t, 0) for t in range(5)] == [0, 1, 2, 3, 4]
    assert [behaviour_version(t, 1) for t in range(5)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]
    assert [behaviour_version(t, 2, start_step=3) for t in range(3, 7)] == [3, 3, 3, 4]  # after a resume at 3
    with pytest.raises(ValueError, match="max_staleness"):
        behaviour_version(1, -1)


@pytest.mark.parametrize("k,start", [(0, 0), (1, 0), (2, 0), (2, 3)])
def test_each_step_is_sampled_by_its_scheduled_version_and_asked_for_once(k, start):
    total = 7
    worker = _FakeWorker()
    request = lambda step: RolloutRequest(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                                          [step, step])
    rollouts = StaleRollouts([worker], k, start, total, request, dict(pad_token_id=0))
    policy = types.SimpleNamespace(version=None)
    staleness = []
    for step in range(start, total):
        policy.version = step  # the policy after `step` updates
        generation = rollouts.generation(step, policy)
        assert generation.response_ids[0, 0].item() == step  # its own step's batch
        staleness.append(rollouts.metrics["rollout/staleness"])
    assert worker.sampled_by == {t: behaviour_version(t, k, start) for t in range(start, total)}
    assert staleness == [t - behaviour_version(t, k, start) for t in range(start, total)]
    assert worker.weights_sent == total - start - k if k else total - start  # once per version that samples
    assert not rollouts.versions and not rollouts.asked  # nothing left in flight


# ------------------------------------------------------------------------------- runs
def _run(tmp_path, name, records=RECORDS, **overrides):
    config = _config(tmp_path, output_dir=str(tmp_path / name), per_device_batch_size=4, mini_batch_size=2,
                     ppo_epochs=2, max_steps=4, **overrides)
    train_ppo(config, records, policy=build_tiny_causal_lm(build_tiny_tokenizer()), tokenizer=build_tiny_tokenizer(),
              reward_fn=count_e)
    return _metrics_without_timings(tmp_path / name)


def test_a_worker_at_staleness_0_trains_like_the_engine_in_process(tmp_path):
    """The worker samples what the in-process engine samples: every metric of the synchronous run, bit for bit."""
    here = _run(tmp_path, "in_process")
    assert _run(tmp_path, "in_process_explicit", max_staleness=0, rollout_workers=0) == here
    worker = _run(tmp_path, "worker", rollout_workers=1)
    assert [{k: v for k, v in m.items() if k != "rollout/staleness"} for m in worker] == here
    assert {m["rollout/staleness"] for m in worker} == {0.0}
    assert "request 3: 4 rows" in (tmp_path / "worker" / "rollout_worker_0.log").read_text()


def test_staleness_1_with_a_fixed_seed_gives_identical_metrics_twice(tmp_path):
    first = _run(tmp_path, "first", max_staleness=1, rollout_workers=1)
    assert first == _run(tmp_path, "second", max_staleness=1, rollout_workers=1)
    assert [m["rollout/staleness"] for m in first] == [0.0, 1.0, 1.0, 1.0]
    assert all(math.isfinite(m["policy/behaviour_weight_mean"]) for m in first)
    assert {"rollout/logprob_diff_mean", "rollout/logprob_diff_max"} <= set(first[1])
    assert first[1]["rollout/logprob_diff_max"] > 0  # a stale batch: behaviour and proximal policies differ
    metrics = read_metrics(tmp_path / "first")
    assert metrics[1]["time/rollout_worker_tokens_per_s"] > 0 and metrics[1]["time/rollout_wait"] >= 0


def test_options_are_checked():
    with pytest.raises(ValueError, match="rollout_workers >= 1"):
        _config(Path("/tmp"), max_staleness=1).validate()
    with pytest.raises(ValueError, match="unset tis_cap"):
        _config(Path("/tmp"), max_staleness=1, rollout_workers=1, tis_cap=2.0).validate()
    with pytest.raises(ValueError, match="max_staleness"):
        _config(Path("/tmp"), max_staleness=1, rollout_workers=1, rollout_logprobs="sampling",
                mini_batch_size=2).validate()
    with pytest.raises(ValueError, match="max_staleness"):
        _config(Path("/tmp"), max_staleness=-1).validate()


def test_resume_regenerates_the_batches_in_flight_none_lost_none_used_twice(tmp_path):
    """max_staleness 2, checkpoint after step 2, SIGKILL after step 3 was logged: batches 3 and 4 were in flight.
    The resumed run asks for each of the steps 3..5 (0-based 2..4) once, trains each once, and its worker died
    with the trainer."""
    config = _config(tmp_path, output_dir=str(tmp_path / "run"), per_device_batch_size=4, mini_batch_size=2,
                     max_steps=5, save_steps=2, max_staleness=2, rollout_workers=1, reward_fns=(f"{__name__}:count_e",),
                     model_name_or_path=str(_tiny_model_dir(tmp_path)))
    run_until_killed("marlhf.trainers.ppo", "PPOConfig", "train_ppo", config, RECORDS, kill_after=3, work_dir=tmp_path)
    log = tmp_path / "run" / "rollout_worker_0.log"
    first_pid = int(log.read_text().split("pid ")[1].split(",")[0])
    # The worker logs a request when its batch is done: batches 3 and 4 were asked for, and may or may not have
    # finished before the kill (a race CI once lost when this asserted both).
    done_before_kill = [line.split(":")[0] for line in log.read_text().splitlines() if line.startswith("request")]
    assert 3 <= len(done_before_kill) <= 5 and done_before_kill == [f"request {i}" for i in range(len(done_before_kill))]
    deadline = time.monotonic() + 15
    while Path(f"/proc/{first_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{first_pid}").exists(), "the worker outlived its killed trainer"

    before = log.read_text()
    resumed = dataclasses.replace(config, resume="latest")
    train_ppo(resumed, RECORDS)
    after = log.read_text()[len(before):]
    assert [line.split(":")[0] for line in after.splitlines() if line.startswith("request")] == \
        ["request 2", "request 3", "request 4"]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["rollout/staleness"] for m in metrics[2:]] == [0.0, 1.0, 2.0]  # version max(2, t - 2)


def _tiny_model_dir(tmp_path):
    path = tmp_path / "tiny"
    tokenizer = build_tiny_tokenizer()
    build_tiny_causal_lm(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_without_a_last_step_the_workers_keep_k_steps_ahead():
    """A token budget (min_generated_tokens) may draw a run out past its plan: StaleRollouts with no last step."""
    worker = _FakeWorker()
    request = lambda step: RolloutRequest(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                                          [step, step])
    rollouts = StaleRollouts([worker], 1, 0, None, request, dict(pad_token_id=0))
    for step in range(6):
        assert rollouts.generation(step, types.SimpleNamespace(version=step)).response_ids[0, 0].item() == step
    assert worker.sampled_by == {t: behaviour_version(t, 1) for t in range(7)}  # step 6 asked for, never used


def test_staleness_1_runs_past_the_plan_under_a_token_budget(tmp_path):
    """4 planned steps of at most 4 x 8 tokens cannot reach 129 tokens: the run goes on, its workers with it."""
    config = _config(tmp_path, output_dir=str(tmp_path / "budget"), per_device_batch_size=4, mini_batch_size=2,
                     max_steps=4, max_staleness=1, rollout_workers=1, min_generated_tokens=129,
                     max_generated_tokens=129)
    train_ppo(config, RECORDS, policy=build_tiny_causal_lm(build_tiny_tokenizer()), tokenizer=build_tiny_tokenizer(),
              reward_fn=count_e)
    metrics = read_metrics(tmp_path / "budget")
    assert len(metrics) >= 5 and metrics[-1]["rollout/generated_tokens"] >= 129
    assert [m["rollout/staleness"] for m in metrics[1:]] == [1.0] * (len(metrics) - 1)
