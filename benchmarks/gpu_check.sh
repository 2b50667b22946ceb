#!/usr/bin/env bash
# The GPU path's check, for a session with an NVIDIA GPU (an H200: 4-6 minutes, estimated;
# it has not run on one yet).
# Run from the repository root:
#
#   bash benchmarks/gpu_check.sh                # CUDA tests, then benchmarks/gpu_check.py
#   bash benchmarks/gpu_check.sh --cpu-dry-run  # the same steps on tiny shapes, CPU only
#
# The device image has torch (CUDA), triton, transformers, pytest, aiohttp, uvloop and
# prometheus-client, but not orjson (imported by scheduling/ and the HF loader) nor
# pytest-asyncio (the async tests). Their wheels travel in .whl/ (ignored by git):
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # HERE, where pip reaches PyPI; then
#   device run: carry [".whl"], command "bash benchmarks/gpu_check.sh", timeout_s 560
#
# and this script installs whatever .whl/ holds first. gguf and openai are not needed:
# nothing here imports them (GGUF loading imports gguf lazily).
# Every section prints RESULT lines; their meaning is in benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--fetch-wheels" ]; then
    grep -qx '/.whl/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null \
        || echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl orjson==3.13.0 pytest-asyncio==1.5.0
    exit 0
fi
if [ -x .venv/bin/python ] && [ "${1:-}" = "--cpu-dry-run" ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [ "${1:-}" = "--cpu-dry-run" ]; then
    export TRITON_INTERPRET=1
    $PY -m pytest -q tests/test_triton_attention.py tests/test_triton_cuda.py
    time $PY benchmarks/gpu_check.py --cpu-dry-run
    exit 0
fi

nvidia-smi
# The kernel tests run compiled on the GPU; the CUDA-only tests (graphs, bf16 engine) run too.
timeout 180 $PY -m pytest -q -x tests/test_triton_attention.py tests/test_triton_norm_rope.py \
    tests/test_triton_backend.py tests/test_triton_cuda.py \
    && echo "RESULT cuda_tests=pass" || echo "RESULT cuda_tests=FAIL"
time timeout 290 $PY benchmarks/gpu_check.py
# Tensor parallelism over NCCL: TP=2 greedy equals TP=1, only where two GPUs exist.
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    timeout 240 $PY benchmarks/tensor_parallel.py --check --device cuda \
        || echo "RESULT tp_greedy_equal=FAIL"
fi
