#!/usr/bin/env bash
# Run `transformers serve` (CPU, fp32) in the foreground: run_transformers.sh PORT
# TRANSFORMERS_SERVE_FLAGS=--continuous-batching turns on its paged continuous batching; here
# (transformers 5.24, CPU) that server died silently on the first streamed completion.
set -euo pipefail
source "$(dirname "$0")/common.sh"
PORT="${1:?usage: run_transformers.sh PORT}"
DEST="$PEERS_DIR/transformers"
MODEL="$HF_MODEL"
[[ -x "$DEST/venv/bin/transformers" && -f "$MODEL/config.json" ]] \
    || die "transformers serve is not set up under $DEST: run benchmarks/peers/setup_transformers.sh"
say "transformers serve on :$PORT with $MODEL"
exec "$DEST/venv/bin/transformers" serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --device cpu --dtype float32 ${TRANSFORMERS_SERVE_FLAGS:-}
