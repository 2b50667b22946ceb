#!/usr/bin/env bash
# Run llama.cpp's llama-server in the foreground on the embedded GGUF: run_llama_server.sh PORT
set -euo pipefail
source "$(dirname "$0")/common.sh"
PORT="${1:?usage: run_llama_server.sh PORT}"
BIN="$PEERS_DIR/llama-server/bin/llama-server"
[[ -x "$BIN" ]] || die "llama-server is not built under $PEERS_DIR: run benchmarks/peers/setup_llama_server.sh"
GGUF=$(embedded_gguf)
say "llama-server on :$PORT with $GGUF"
exec "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -np 32 -c 16384 -t "$(nproc)" -cb \
    --metrics --alias smollm2
