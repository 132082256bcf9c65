"""The vLLM server mode (`marlhf vllm-serve`, rollout_engine="vllm_server") and the vllm engine in a rollout worker.

Everywhere: the options, an unreachable URL (one line, under 15 s, before a PPO run writes anything), and the
weight path on 127.0.0.1 with gloo against a server whose engine is a recording stand-in (no vLLM): the first
sync sends every tensor, later ones only the buckets training can change, each tensor intact (with LoRA: the
merged layers, then the adapted ones only). In the vLLM venv
(scripts/ci_vllm.sh runs this file there and fails on a skip): `marlhf vllm-serve` in its own process against
the colocated vllm engine, before and after a weight sync (same tokens, log-probs within test_engine_vllm's
TOL), stopped by SIGTERM with exit 0; episodes of an environment through the server against the colocated
engine's, and two `--env` PPO steps through the CLI; and the vllm engine inside a RolloutWorker against the
colocated one, responses and episodes.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from marlhf.engines import EngineContext, Generation, HFEngine, VLLMServerEngine, VLLMServerOptions, get_engine
from marlhf.engines.vllm_serve import VLLMServer
from marlhf.errors import MarlhfError
from marlhf.modeling import add_lora, merge_lora
from tests.test_engine_vllm import RECORDS, SAMPLING, TOL, _model, needs_vllm

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _batch(tokenizer):
    batch = tokenizer(["Human: hi", "The quick brown fox jumps over", "a", "def add(a, b):"],
                      return_tensors="pt", padding=True, padding_side="left")
    return batch["input_ids"], batch["attention_mask"].bool()


def _generate(engine, tokenizer, seeds):
    prompt_ids, prompt_mask = _batch(tokenizer)
    return engine.generate(prompt_ids, prompt_mask, row_seeds=seeds, return_logprobs=True,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SAMPLING)


def _same(a: Generation, b: Generation) -> None:
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.allclose(a.logprobs, b.logprobs, atol=TOL, rtol=0)


# ---- everywhere (with or without vLLM) ---------------------------------------------------------------------
def test_registered_with_its_options():
    assert get_engine("vllm_server").obj is VLLMServerEngine
    for bad, what in (({"server_url": "localhost:8000"}, "'server_url'"), ({"server_timeout": 0}, "'server_timeout'"),
                      ({"server_backend": "mpi"}, "'server_backend'"), ({"server_group_port": 0}, "'server_group_port'")):
        with pytest.raises(ValueError, match=what):
            VLLMServerOptions(**bad)


def test_an_unreachable_url_fails_in_one_line_under_15_s():
    url = f"http://127.0.0.1:{_free_port()}"
    began = time.monotonic()
    with pytest.raises(MarlhfError) as error:
        VLLMServerEngine(EngineContext(options=VLLMServerOptions(server_url=url)))
    assert time.monotonic() - began < 15
    message = str(error.value)
    assert "\n" not in message and url in message and "marlhf vllm-serve" in message


def test_an_unreachable_url_stops_the_ppo_run_before_anything_is_written(tmp_path, tiny_tokenizer):
    from tests.trainers.test_ppo import _config, count_e
    from marlhf.trainers.ppo import train_ppo

    out = tmp_path / "run"
    config = _config(out, rollout_engine="vllm_server",
                     rollout_engine_options={"server_url": f"http://127.0.0.1:{_free_port()}",
                                             "server_connect_timeout": 2})
    with pytest.raises(MarlhfError, match="no server answers"):
        train_ppo(config, [r["prompt"] for r in RECORDS], tokenizer=tiny_tokenizer, reward_fn=count_e)
    assert not out.exists()


class _Recording:
    """A stand-in for the server's vllm engine: HF sampling from a model that `load_weights` writes into."""

    def __init__(self, model):
        self.model, self.hf, self.loads = model, HFEngine(), []
        self.hf.sync_weights(model)

    def load_weights(self, weights):
        self.loads.append([name for name, _ in weights])
        self.model.load_state_dict(dict(weights), strict=False)

    def generate(self, *args, **kwargs):
        return self.hf.generate(*args, **kwargs)

    def close(self):
        pass


def test_weights_travel_over_gloo_and_only_what_changed(tiny_tokenizer):
    """A server on 127.0.0.1 whose engine records what it loads: all tensors first, then the trainable
    buckets only, each equal to the trainer's; its rollouts then match the trainer's own HF sampling; once it is
    stopped, a rollout fails with one line."""
    trainer = _model(tiny_tokenizer)
    served = _model(tiny_tokenizer, head_scale=1.0)  # other weights until the first sync
    server = VLLMServer(_Recording(served), "127.0.0.1", 0, _free_port())
    loop = threading.Thread(target=server.serve, daemon=True)
    loop.start()
    try:
        client = VLLMServerEngine(EngineContext(options=VLLMServerOptions(
            server_url=f"http://127.0.0.1:{server.port}", server_group_port=server.group_port, server_timeout=60)))
        client.sync_weights(trainer)
        names = list(trainer.state_dict())
        assert sorted(client.last_sync) == sorted(names)
        for name, tensor in trainer.state_dict().items():
            assert torch.equal(served.state_dict()[name], tensor), name
        trainer.requires_grad_(False)
        trainer.model.layers[1].requires_grad_(True)  # only layer 1 can change now
        with torch.no_grad():
            trainer.model.layers[1].mlp.down_proj.weight.mul_(0.5)
        client.sync_weights(trainer)
        assert client.last_sync and all(".layers.1." in name for name in client.last_sync)
        assert torch.equal(served.model.layers[1].mlp.down_proj.weight, trainer.model.layers[1].mlp.down_proj.weight)
        local = HFEngine()
        local.sync_weights(trainer)
        seeds = [11, 12, 13, 14]
        remote, here = _generate(client, tiny_tokenizer, seeds), _generate(local, tiny_tokenizer, seeds)
        assert torch.equal(remote.response_ids, here.response_ids)
        assert torch.allclose(remote.logprobs, here.logprobs, atol=TOL, rtol=0)
        client.close()
        assert server.group is None or client.group is None
    finally:
        server.stop()
        loop.join(30)
    assert not loop.is_alive()
    with pytest.raises(MarlhfError, match="did not answer /generate") as error:  # a server gone mid-run: one line
        _generate(client, tiny_tokenizer, [1, 2, 3, 4])
    assert "\n" not in str(error.value)


def test_a_lora_policy_sends_its_merged_layers_and_then_only_those(tiny_tokenizer):
    """With LoRA the server gets the merged weights under the base model's names, then the adapted layers only."""
    trainer = add_lora(_model(tiny_tokenizer), r=4, alpha=8.0, target_modules=("q_proj",))
    with torch.no_grad():  # adapters that change the weights (peft starts B at 0)
        for name, parameter in trainer.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    served = _model(tiny_tokenizer, head_scale=1.0)
    server = VLLMServer(_Recording(served), "127.0.0.1", 0, _free_port())
    loop = threading.Thread(target=server.serve, daemon=True)
    loop.start()
    try:
        client = VLLMServerEngine(EngineContext(options=VLLMServerOptions(
            server_url=f"http://127.0.0.1:{server.port}", server_group_port=server.group_port, server_timeout=60)))
        client.sync_weights(trainer)
        assert not any("lora" in name or "base_layer" in name for name in client.last_sync)
        merged = merge_lora(copy.deepcopy(trainer)).state_dict()
        for name, tensor in served.state_dict().items():
            assert torch.allclose(tensor, merged[name], atol=1e-6), name
        client.sync_weights(trainer)
        assert client.last_sync and all(".layers." in name for name in client.last_sync)  # no embeddings or head
        client.close()
    finally:
        server.stop()
        loop.join(30)


# ---- in the vLLM venv --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colocated(tiny_tokenizer, tmp_path_factory):
    from marlhf.engines import VLLMEngine, VLLMOptions

    model = _model(tiny_tokenizer)
    model_dir = tmp_path_factory.mktemp("served")
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    engine = VLLMEngine(EngineContext(options=VLLMOptions(kv_cache_gib=1)))
    engine.sync_weights(model)
    yield engine, model, model_dir
    engine.close()


def _start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, int, int]:
    port, group_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "marlhf", "vllm-serve", "--model", str(model_dir), "--port",
                                str(port), "--group_port", str(group_port), "--kv_cache_gib", "1"],
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return process, port, group_port


@pytest.fixture(scope="module")
def server(colocated, tmp_path_factory):
    """`marlhf vllm-serve` in its own process, for the module's tests; stopped by SIGTERM at the end: exit 0."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    process, port, group_port = _start_server(colocated[2], log)
    yield port, group_port
    process.send_signal(signal.SIGTERM)
    code = process.wait(60)
    output = log.read_text()
    assert code == 0, output
    assert "vllm-serve: stopped" in output


@needs_vllm
def test_the_server_samples_what_the_colocated_engine_samples(colocated, server, tiny_tokenizer):
    engine, model, _ = colocated
    port, group_port = server
    client = VLLMServerEngine(EngineContext(options=VLLMServerOptions(
        server_url=f"http://127.0.0.1:{port}", server_group_port=group_port, server_connect_timeout=600,
        server_timeout=300)))
    seeds = [3, 4, 5, 6]
    try:
        client.sync_weights(model)
        engine.sync_weights(model)
        _same(_generate(client, tiny_tokenizer, seeds), _generate(engine, tiny_tokenizer, seeds))
        with torch.no_grad():  # a training step's worth of change, then a sync of both
            for parameter in model.model.layers[0].parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        client.sync_weights(model)
        engine.sync_weights(model)
        _same(_generate(client, tiny_tokenizer, seeds), _generate(engine, tiny_tokenizer, seeds))
    finally:
        client.close()


@needs_vllm
def test_ppo_trains_with_the_server(server, tiny_tokenizer, tmp_path):
    """Two PPO steps sampled by the server (a second trainer joins the weight group after the first left it)."""
    from marlhf.logging_utils import read_metrics
    from marlhf.trainers.ppo import train_ppo
    from tests.trainers.test_ppo import _config, count_e

    port, group_port = server
    config = _config(tmp_path, rollout_engine="vllm_server", log_rollout_logprob_diff=True,
                     rollout_engine_options={"server_url": f"http://127.0.0.1:{port}",
                                             "server_group_port": group_port})
    train_ppo(config, [r["prompt"] for r in RECORDS], policy=_model(tiny_tokenizer), tokenizer=tiny_tokenizer,
              reward_fn=count_e)
    metrics = read_metrics(config.output_dir)
    assert len(metrics) == 2
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in metrics)  # the server's log-probs are the policy's


@needs_vllm
def test_the_vllm_engine_in_a_rollout_worker_samples_what_it_samples_here(colocated, tiny_tokenizer, tmp_path):
    """Responses, and the episodes of an environment that the worker makes and runs itself (PPOConfig.env with
    rollout_workers): the same tokens as the colocated engine, log-probs within TOL."""
    from marlhf.engines import VLLMOptions
    from marlhf.engines.worker import RolloutWorker, WorkerSpec
    from marlhf.multiturn import EpisodeSpec, MultiTurnOptions, run_episodes
    from marlhf.trainers.staleness import _episodes_in_worker

    engine, model, _ = colocated
    engine.sync_weights(model)
    seeds = [7, 8, 9, 10]
    prompt_ids, prompt_mask = _batch(tiny_tokenizer)
    spec = EpisodeSpec("tests/fixtures/guess_env.py:GuessNumber", None, tiny_tokenizer,
                       MultiTurnOptions(max_turns=3, max_turn_tokens=5), 128,
                       dict(eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id,
                            **{k: v for k, v in SAMPLING.items() if k != "max_new_tokens"}))
    worker = RolloutWorker(WorkerSpec("vllm", VLLMOptions(kv_cache_gib=1), threads=1, timeout=600,
                                      log_path=str(tmp_path / "rollout_worker_0.log")))
    try:
        worker.send_weights(model)
        worker.submit(0, prompt_ids, prompt_mask, row_seeds=seeds, return_logprobs=True,
                      eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id, **SAMPLING)
        worker.submit_call(1, _episodes_in_worker, spec=spec, seeds=seeds, env_seeds=seeds, tasks=[None] * 4)
        generation, seconds, tokens = worker.result(0)
        episodes, _, action_tokens = worker.result(1)
    finally:
        worker.close()
    assert not worker.process.is_alive()
    _same(generation, _generate(engine, tiny_tokenizer, seeds))
    assert tokens == int(generation.response_mask.sum()) and seconds > 0
    here = run_episodes(engine, spec, seeds, None, [None] * 4)
    for name in ("response_ids", "response_mask", "action_mask", "turn_ids", "turn_rewards"):
        assert torch.equal(getattr(episodes, name), getattr(here, name)), name
    assert torch.allclose(episodes.logprobs, here.logprobs, atol=TOL, rtol=0)
    assert action_tokens == int(here.action_mask.sum()) and here.num_turns.max() > 1


def _guess_spec(tokenizer):
    """The episodes of tests/fixtures/guess_env.py, three turns of at most five tokens, with SAMPLING's settings."""
    from marlhf.multiturn import EpisodeSpec, MultiTurnOptions

    return EpisodeSpec("tests/fixtures/guess_env.py:GuessNumber", None, tokenizer,
                       MultiTurnOptions(max_turns=3, max_turn_tokens=5), 128,
                       dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **{k: v for k, v in SAMPLING.items() if k != "max_new_tokens"}))


@needs_vllm
def test_the_servers_episodes_are_the_colocated_engines(colocated, server, tiny_tokenizer):
    """Episodes run here, each round asked of the server (EngineSampler, no cache to continue): the same tokens,
    turns and rewards as on the colocated engine, log-probs within TOL."""
    from marlhf.multiturn import run_episodes

    engine, model, _ = colocated
    port, group_port = server
    client = VLLMServerEngine(EngineContext(options=VLLMServerOptions(
        server_url=f"http://127.0.0.1:{port}", server_group_port=group_port, server_connect_timeout=600,
        server_timeout=300)))
    spec, seeds = _guess_spec(tiny_tokenizer), [7, 8, 9, 10]
    try:
        client.sync_weights(model)
        engine.sync_weights(model)
        remote = run_episodes(client, spec, seeds, None, [None] * 4)
    finally:
        client.close()
    here = run_episodes(engine, spec, seeds, None, [None] * 4)
    for name in ("response_ids", "response_mask", "action_mask", "turn_ids", "turn_rewards"):
        assert torch.equal(getattr(remote, name), getattr(here, name)), name
    assert torch.allclose(remote.logprobs, here.logprobs, atol=TOL, rtol=0)
    assert here.num_turns.max() > 1 and remote.metrics["env/generate_calls"] == here.metrics["env/generate_calls"]


@needs_vllm
def test_the_example_environment_trains_two_steps_with_the_server(server, tiny_tokenizer, tmp_path):
    """`marlhf ppo --env tests/fixtures/guess_env.py:GuessNumber --rollout_engine vllm_server`: turn-level PPO for
    two steps, the environments in the trainer's process, each round sampled by the server."""
    from marlhf import cli
    from marlhf.logging_utils import read_metrics
    from tests.trainers.test_ppo_multiturn import COMBINATIONS, _argv

    port, group_port = server
    model_dir = tmp_path / "model"
    _model(tiny_tokenizer, head_scale=1.0).save_pretrained(model_dir)  # the server's model until the first sync
    tiny_tokenizer.save_pretrained(model_dir)
    output_dir = tmp_path / "env_server"
    options = f"{{server_url: 'http://127.0.0.1:{port}', server_group_port: {group_port}}}"
    assert cli.main(_argv(tmp_path, model_dir, output_dir, *COMBINATIONS["turn_ppo"], "--rollout_engine",
                          "vllm_server", "--rollout_engine_options", options, "--log_rollout_logprob_diff",
                          "true")) == 0
    metrics = read_metrics(output_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["env/episodes"] == 4 and m["env/observation_tokens"] > 0 for m in metrics)
    assert all(m["env/generate_calls"] >= 2 for m in metrics)  # a request per round
    assert metrics[0]["objective/kl"] == 0 != metrics[1]["objective/kl"]  # step 1's update moved the policy
    assert all(m["rollout/logprob_diff_max"] < TOL for m in metrics)  # and the server samples with it
    assert (output_dir / "model.safetensors").exists()
