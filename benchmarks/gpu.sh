#!/usr/bin/env bash
# PPO step throughput of marlhf on one GPU for a ~110M-parameter Llama built from a config (random weights,
# nothing downloaded): policy, reference, critic and reward model of that size, bf16 autocast, token-level
# macro actions of n=5 (the paper's default rule). Prints the GPU name, the parameter count, steps/s,
# sampled tokens/s and peak GPU memory, from the time/* metrics of train_ppo after warm-up steps. Then, in the
# same run, ppo_step.py's phases against the float32 GEMM peak (model-FLOPs utilisation) and generation.py's
# sampling options (sampling_noise x kv_cache) side by side, and vs_trl.py's comparisons with TRL (PPO against
# TRL 0.26, GRPO and RLOO against TRL 1.16, on the GPU) for each TRL venv that exists (.venv-trl, .venv-trl116).
# When vLLM imports in VLLM_PYTHON (default .venv-vllm/bin/python if it exists, else PYTHON; vLLM needs its own
# venv, docs/vllm.md), generation.py and ppo_step.py once more with --engine vllm. The PPO throughput is also
# measured with bounded staleness (max_staleness 1, one rollout worker) and, with vLLM, with the rollouts from
# `marlhf vllm-serve` on the same GPU (rollout_engine vllm_server); vs_trl.py's PPO line runs with --async.
# Last, the environments' recipe (docs/envs.md): an instruct model on a reasoning-gym curriculum, MA-PPO against
# GRPO (ENV_MODEL, ENV_STEPS; skipped without the envs extra or the model in the local cache).
#
#   bash benchmarks/gpu.sh                 # on a GPU machine, from the repository root (uses .venv if present)
#   bash benchmarks/gpu.sh --tiny          # smoke test on CPU: a ~0.1M-parameter model, 2 small steps
#   BATCH=64 NEW_TOKENS=256 STEPS=10 bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
VLLM_PYTHON=${VLLM_PYTHON:-$([ -x .venv-vllm/bin/python ] && echo .venv-vllm/bin/python || echo "$PYTHON")}
TINY=0
if [[ "${1:-}" == "--tiny" ]]; then TINY=1; fi
# ppo_throughput MODE: sync (the engine in the trainer), async (max_staleness 1, one rollout worker process) or
# server (rollout_engine vllm_server: `marlhf vllm-serve` started with VLLM_PYTHON on the same GPU, weights over
# gloo; NCCL needs the two ends on different GPUs)
ppo_throughput() {
TINY=$TINY MODE=$1 VLLM_PYTHON=$VLLM_PYTHON BATCH=${BATCH:-32} NEW_TOKENS=${NEW_TOKENS:-128} STEPS=${STEPS:-5} \
  WARMUP=${WARMUP:-2} TQDM_DISABLE=1 PYTHONPATH=. "$PYTHON" - <<'PY'
import contextlib
import os
import signal
import socket
import subprocess
import random
import statistics
import tempfile

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from marlhf.logging_utils import read_metrics
from marlhf.modeling import ScalarHeadModel
from marlhf.trainers.ppo import PPOConfig, train_ppo

hf_logging.set_verbosity_error()
tiny = os.environ["TINY"] == "1"
batch, new_tokens = (4, 8) if tiny else (int(os.environ["BATCH"]), int(os.environ["NEW_TOKENS"]))
steps, warmup = (2, 0) if tiny else (int(os.environ["STEPS"]), int(os.environ["WARMUP"]))
vocab_size = 512 if tiny else 16384
if not tiny and not torch.cuda.is_available():
    raise SystemExit("no GPU found: run on a GPU machine, or pass --tiny for a CPU smoke test")

specials = ["<pad>", "<s>", "</s>"]
vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1) if tiny else
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12))


def llama(seed):
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, **size)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


policy = llama(0)
reward_model = ScalarHeadModel(llama(1).model)
rng = random.Random(0)
prompts = [{"prompt": " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(rng.randint(32, 64)))}
           for _ in range(batch * (steps + warmup))]
on_gpu = torch.cuda.is_available()
mode = os.environ["MODE"]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def engine_options(directory):
    """The mode's PPOConfig options; for the server mode, `marlhf vllm-serve` running meanwhile."""
    if mode == "async":
        yield dict(max_staleness=1, rollout_workers=1, rollout_worker_threads=torch.get_num_threads())
        return
    if mode != "server":
        yield {}
        return
    policy.save_pretrained(f"{directory}/policy")
    tokenizer.save_pretrained(f"{directory}/policy")
    port, group_port = free_port(), free_port()
    memory = ["--gpu_memory_utilization", "0.3"] if on_gpu else ["--kv_cache_gib", "1"]
    server = subprocess.Popen([os.environ["VLLM_PYTHON"], "-m", "marlhf", "vllm-serve", "--model", f"{directory}/policy",
                               "--port", str(port), "--group_port", str(group_port), *memory],
                              stdout=open(f"{directory}/server.log", "w"), stderr=subprocess.STDOUT)
    try:
        yield dict(rollout_engine="vllm_server", rollout_engine_options=dict(
            server_url=f"http://127.0.0.1:{port}", server_group_port=group_port, server_backend="gloo",
            server_connect_timeout=900))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


with tempfile.TemporaryDirectory() as output_dir, engine_options(output_dir) as options:
    config = PPOConfig(output_dir=output_dir, model_name_or_path="benchmark", per_device_batch_size=batch,
                       mini_batch_size=batch, max_prompt_length=64, max_response_length=new_tokens,
                       max_length=64 + new_tokens, max_steps=steps + warmup, ngram=5, save_steps=0,
                       mixed_precision="bf16" if on_gpu else "no", learning_rate=1e-5, critic_learning_rate=1e-5,
                       **options)
    train_ppo(config, prompts, policy=policy, reward_model=reward_model, tokenizer=tokenizer)
    metrics = read_metrics(output_dir)[warmup:]

device = torch.cuda.get_device_name() if on_gpu else f"CPU ({torch.get_num_threads()} threads)"
parameters = sum(p.numel() for p in policy.parameters())
seconds = statistics.mean(m["time/step_seconds"] for m in metrics)
tokens = statistics.mean(m["objective/response_length"] for m in metrics) * batch
print(f"device: {device}")
print(f"policy {parameters / 1e6:.1f}M parameters (x4 models), batch {batch}, {new_tokens} new tokens, "
      f"{len(metrics)} steps after {warmup} warm-up")
for phase in ("generation", "scoring", "update"):
    print(f"  time/{phase}: {statistics.mean(m[f'time/{phase}'] for m in metrics):.3f} s")
what = {"sync": "PPO throughput", "async": "async PPO throughput (max_staleness 1, 1 rollout worker)",
        "server": "PPO throughput, rollouts from vllm-serve"}[mode]
print(f"{what}: {1 / seconds:.3f} steps/s, {tokens / seconds:.0f} sampled tokens/s")
if mode == "async":
    print(f"  rollout/staleness {statistics.mean(m['rollout/staleness'] for m in metrics):.2f}, trainer's wait "
          f"{statistics.mean(m['time/rollout_wait'] for m in metrics):.3f} s a step, the worker "
          f"{statistics.mean(m['time/rollout_worker_tokens_per_s'] for m in metrics):.0f} tokens/s (its hf engine "
          "samples on the CPU)")
if on_gpu:
    print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
PY
}
ppo_throughput sync
echo; echo "== bounded-staleness PPO (max_staleness 1, one rollout worker; docs/async.md)"
ppo_throughput async
echo; echo "== PPO with its rollouts from marlhf vllm-serve (rollout_engine vllm_server)"
if "$VLLM_PYTHON" -c "import vllm" >/dev/null 2>&1; then
  ppo_throughput server
else
  echo "skipped: vllm does not import in $VLLM_PYTHON (make a vLLM venv as docs/vllm.md says; VLLM_PYTHON=...)"
fi

if [[ $TINY == 1 ]]; then
  STEP_ARGS=(--batch 4 --mini-batch 4 --new-tokens 8 --steps 1 --warmup 0 --gemm-size 256); GEN_ARGS=(--batch 4 --new-tokens 8 --rounds 1)
else
  STEP_ARGS=(--batch "${BATCH:-32}" --mini-batch "${BATCH:-32}" --new-tokens "${NEW_TOKENS:-128}"); GEN_ARGS=(--batch 256 --new-tokens "${NEW_TOKENS:-128}")
fi
echo; echo "== PPO step phases against the float32 GEMM peak (benchmarks/ppo_step.py)"
TQDM_DISABLE=1 PYTHONPATH=. "$PYTHON" benchmarks/ppo_step.py "${STEP_ARGS[@]}"
echo; echo "== sampling options side by side (benchmarks/generation.py)"
TQDM_DISABLE=1 PYTHONPATH=. "$PYTHON" benchmarks/generation.py "${GEN_ARGS[@]}"
echo; echo "== the vllm rollout engine (generation.py and ppo_step.py with --engine vllm)"
if "$VLLM_PYTHON" -c "import vllm" >/dev/null 2>&1; then
  TQDM_DISABLE=1 PYTHONPATH=. "$VLLM_PYTHON" benchmarks/generation.py --engine vllm "${GEN_ARGS[@]}"
  TQDM_DISABLE=1 PYTHONPATH=. "$VLLM_PYTHON" benchmarks/ppo_step.py --engine vllm "${STEP_ARGS[@]}"
else
  echo "skipped: vllm does not import in $VLLM_PYTHON (make a vLLM venv as docs/vllm.md says; VLLM_PYTHON=...)"
fi
if [[ $TINY == 1 ]]; then
  PPO_ARGS=(--batch 2 --new-tokens 8 --steps 1 --warmup 0)
  GROUP_ARGS=(--batch 2 --generations 2 --new-tokens 8 --steps 1 --warmup 0)
else  # the paper's shape: 32 rows in 8 accumulation pieces, prompts of 32-256 tokens
  PPO_ARGS=(--batch 32 --pieces 8 --prompt-lengths 32 256 --new-tokens "${NEW_TOKENS:-128}" --steps 4 --rounds 2)
  GROUP_ARGS=(--batch 8 --generations 4 --pieces 8 --prompt-lengths 32 256 --new-tokens "${NEW_TOKENS:-128}" --steps 4
              --rounds 2)
fi
for trainer in ppo grpo rloo; do
  echo; echo "== marlhf against TRL, $trainer (benchmarks/vs_trl.py)"
  if [[ $trainer == ppo ]]; then venv=.venv-trl; ARGS=("${PPO_ARGS[@]}" --async); else venv=.venv-trl116; ARGS=(--trainer "$trainer" "${GROUP_ARGS[@]}"); fi
  if [[ -x $venv/bin/python ]]; then
    "$PYTHON" benchmarks/vs_trl.py "${ARGS[@]}"
  else
    echo "skipped: no $venv (make it as benchmarks/vs_trl.py's docstring says)"
  fi
done

# The environments (docs/envs.md): an instruct model of 0.5-1.5B (ENV_MODEL, default Qwen/Qwen2.5-0.5B-Instruct, a
# directory or a Hub id already in the local cache: nothing is downloaded) on a reasoning-gym curriculum, chain_sum
# with more terms at each stage, each stage starting from the previous stage's policy; MA-PPO (critic, GAE over
# 5-token macro actions) against GRPO (4 samples per prompt, token level), ENV_STEPS steps a stage. It prints each
# arm's mean library score over the last stage's steps and the share of raising scorers. --tiny: a tiny model made
# here, 2 steps a stage. Then the TextArena recipe, which waits for the trainer's multi-turn integration.
env_recipe() {
  if ! "$PYTHON" -c "import reasoning_gym" >/dev/null 2>&1; then
    echo "skipped: the envs extra is not installed in $PYTHON (pip install -e \".[envs]\")"; return
  fi
  local work model steps batch samples mini new_tokens prompt_tokens=384
  work=$(mktemp -d)
  if [[ $TINY == 1 ]]; then
    model=$work/tiny; steps=2; batch=2; samples=2; mini=4; new_tokens=8; prompt_tokens=768  # ~1 token a character
    PYTHONPATH=. "$PYTHON" - "$model" <<'PY'
import sys
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

backend = Tokenizer(models.BPE())
backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
backend.train_from_iterator(["<answer>1 + 2 - 3 = 0</answer> State the final answer"] * 8, trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
PY
  else
    model=${ENV_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}; steps=${ENV_STEPS:-50}; batch=8; samples=4; mini=32
    new_tokens=${NEW_TOKENS:-256}
    if ! HF_HUB_OFFLINE=1 "$PYTHON" -c "from transformers import AutoConfig; AutoConfig.from_pretrained('$model')" \
        >/dev/null 2>&1; then
      echo "skipped: $model is neither a directory nor in the local Hugging Face cache (ENV_MODEL=...)"; return
    fi
  fi
  for arm in ma_ppo grpo; do
    local start=$model
    if [[ $arm == ma_ppo ]]; then ARM=(--advantage gae --ngram 5); else ARM=(--advantage grpo --ngram none); fi
    for terms in "2, max_terms: 3" "3, max_terms: 5" "5, max_terms: 8"; do
      local out=$work/$arm/terms${terms%%,*}
      HF_HUB_OFFLINE=1 TQDM_DISABLE=1 PYTHONPATH=. "$PYTHON" -m marlhf ppo --model_name_or_path "$start" \
        --dataset "reasoning_gym:chain_sum{size: 4096, config: {min_terms: $terms}}" \
        --reward_fns marlhf.envs.reasoning_gym:score marlhf.envs.reasoning_gym:scorer_errors --reward_weights 1 0 \
        "${ARM[@]}" --num_samples_per_prompt "$samples" --per_device_batch_size "$batch" --mini_batch_size "$mini" \
        --kl_coef 0 --max_prompt_length "$prompt_tokens" --max_response_length "$new_tokens" \
        --max_length $((prompt_tokens + new_tokens)) --max_steps "$steps" --save_steps 0 --output_dir "$out" >/dev/null
      start=$out
    done
    "$PYTHON" -c "import json, sys; m = [json.loads(l) for l in open(sys.argv[1])]; \
print(f'$arm: last stage (5-8 terms), {len(m)} steps: mean score', \
round(sum(x['rewards/score'] for x in m) / len(m), 3), 'scorer errors', \
round(sum(x['rewards/scorer_errors'] for x in m) / len(m), 3))" "$start/metrics.jsonl"
  done
  rm -rf "$work"
  echo "pending (the trainer's multi-turn integration, marlhf ppo --env): MA-PPO with turn-level macro actions"
  echo "  against episode GRPO on a TextArena game, e.g."
  echo "  marlhf ppo --model_name_or_path $model --env textarena:GuessTheNumber-v0 --max_turns 10 --termination turn"
  echo "  marlhf ppo --model_name_or_path $model --env textarena:GuessTheNumber-v0 --max_turns 10 --advantage grpo"
}
echo; echo "== environments: a reasoning-gym curriculum, MA-PPO against GRPO (docs/envs.md)"
env_recipe
