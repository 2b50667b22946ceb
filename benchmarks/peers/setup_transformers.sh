#!/usr/bin/env bash
# Set up transformers' own server (`transformers serve`, continuous batching) in its own venv,
# on the HF directory that setup_vllm_cpu.sh converts (made here too when missing).
# Idempotent: each finished step is skipped.
set -euo pipefail
source "$(dirname "$0")/common.sh"
DEST="$PEERS_DIR/transformers"
VENV="$DEST/venv"
start=$(date +%s)
# The same transformers release as headrace's own environment, so only the server differs.
TF_VERSION=$("$HEADRACE_PY" -c "import transformers; print(transformers.__version__)")
mkdir -p "$DEST"
[[ -x "$VENV/bin/python" ]] || { say "creating $VENV"; python3 -m venv "$VENV"; }
if ! "$VENV/bin/python" -c "import transformers, fastapi, uvicorn" >/dev/null 2>&1; then
    say "installing transformers[serving]==$TF_VERSION (torch 2.13.0+cpu from the local store)"
    nice -n 15 "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    nice -n 15 "$VENV/bin/python" -m pip install -q "transformers[serving]==$TF_VERSION" accelerate
else
    say "transformers[serving] already installed in $VENV"
fi
ensure_hf_model
say "transformers serve ready in $(( $(date +%s) - start )) s"
