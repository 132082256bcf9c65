"""Shared tiny-model fixtures: everything is built offline from configs, nothing is downloaded.

    tiny_tokenizer          byte-level BPE (vocab ~300) with <pad>, <s>, </s>; round-trips any text
    tiny_model_dir          directory with a tiny Llama causal LM + tokenizer: from_pretrained(path) works
    make_tiny_causal_lm()   a fresh tiny LlamaForCausalLM (seeded) matching tiny_tokenizer
    tiny_records            small in-memory records for the "sft", "rm" stages
    fake_hub                a Hub on 127.0.0.1 answering each HEAD with `fake_hub.status` (None: hangs), online
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "POST\nSubreddit: r/test\nMy cat sleeps all day and I wonder why.\nTL;DR: ",
    "Human: How do I bake bread?\n\nAssistant: Mix flour, water, salt and yeast, then bake it.",
    "def add(a, b):\n    return a + b\n",
    "A short summary. A long and winding answer that keeps going.",
]


# The files whose tests read the session's demo run (`demo_run`, minutes): one pytest-xdist worker runs them all.
DEMO_RUN_FILES = {"tests/demo/test_demo.py", "tests/test_readme.py"}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the vLLM venv (scripts/ci_vllm.sh) runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist (`-n 2`) a file's tests go to one worker, which makes the file's module fixtures once
    (trainings, torchrun launches), and the DEMO_RUN_FILES go to one worker, which makes the demo run once."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "demo_run" if path in DEMO_RUN_FILES else path

    return ByFile(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    strays = sorted({item.nodeid.split("::", 1)[0] for item in items if "demo_run" in item.fixturenames}
                    - DEMO_RUN_FILES)
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(strays)} to DEMO_RUN_FILES (they read demo_run)")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run several times faster on one thread (no thread hand-offs, no oversubscription
    when a test starts worker processes), most of all on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_causal_lm(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def make_tiny_causal_lm(tiny_tokenizer):
    def make(seed: int = 0) -> LlamaForCausalLM:
        return build_tiny_causal_lm(tiny_tokenizer, seed)

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_causal_lm(tiny_tokenizer).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_records():
    sft = [{"prompt": f"Human: count to {i}\n\nAssistant:", "response": " " + " ".join(str(j) for j in range(i + 1))}
           for i in range(8)]
    rm = [{"prompt": f"Human: say something about {topic}\n\nAssistant:",
           "chosen": f" {topic} is a fine thing, thank you.", "rejected": " no."}
          for topic in ("cats", "dogs", "bread", "rain", "code", "tea", "maps", "boats", "songs", "trees")]
    return {"sft": sft, "rm": rm}


DEMO_TERMINATIONS = ("fixed:none",)  # the --terminations path, on a rule that is not a fixed n-gram
DEMO_BASELINES = ("dpo",)  # the --methods path, on the baseline that trains without rollouts
# The other kinds (a rule that reads the policy's log-probs, a critic-free PPO-loop baseline) in a demo of their own:
# tests/demo/test_demo.py, under -m slow.
SLOW_DEMO_TERMINATIONS, SLOW_DEMO_BASELINES = ("perplexity",), ("reinforce",)


def run_quick_demo(out, terminations: tuple[str, ...], methods: tuple[str, ...]) -> tuple:
    """`marlhf demo --quick` with more termination rules and baselines: (output directory, summary, console output)."""
    import contextlib
    import io

    from marlhf.demo import DemoConfig, run_demo

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = run_demo(DemoConfig.quick(out=str(out), terminations=terminations, methods=methods))
    return out, summary, printed.getvalue()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The quick demo with DEMO_TERMINATIONS and DEMO_BASELINES, run once for the session (`run_quick_demo`). Its
    models and data/ also serve the README's tour."""
    return run_quick_demo(tmp_path_factory.mktemp("demo"), DEMO_TERMINATIONS, DEMO_BASELINES)


class FakeHubHandler(BaseHTTPRequestHandler):
    """HEAD of a Hub file: answers `server.status`, or hangs until the test ends when it is None."""

    def do_HEAD(self):
        self.server.requests.append(self.path)
        if self.server.status is None:
            self.server.release.wait(60)
        else:
            self.send_response(self.server.status)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A Hub on 127.0.0.1 (ENDPOINT and the file URL template that hf_hub_url reads), online, an empty cache and a
    2 s MARLHF_HUB_TIMEOUT."""
    import huggingface_hub.constants as hub

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHubHandler)
    server.daemon_threads, server.requests, server.status, server.release = True, [], 200, threading.Event()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(hub, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MARLHF_HUB_TIMEOUT", "2")
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
