#!/usr/bin/env bash
# Run vLLM's CPU build in the foreground: run_vllm_cpu.sh PORT [float32|bfloat16]
set -euo pipefail
source "$(dirname "$0")/common.sh"
PORT="${1:?usage: run_vllm_cpu.sh PORT [float32|bfloat16]}"
DTYPE="${2:-float32}"
DEST="$PEERS_DIR/vllm-cpu"
MODEL="$HF_MODEL"
[[ -x "$DEST/venv/bin/python" && -f "$DEST/vllm_launcher.py" && -f "$MODEL/config.json" ]] \
    || die "vLLM CPU is not set up under $DEST: run benchmarks/peers/setup_vllm_cpu.sh"
# Preload tcmalloc and Intel OpenMP where present: vLLM's CPU backend expects both.
PRELOAD=()
for lib in $(find "$DEST/venv/lib" /usr/lib/x86_64-linux-gnu -maxdepth 3 \
        \( -name 'libtcmalloc_minimal.so*' -o -name 'libtcmalloc.so*' -o -name 'libiomp5.so' \) \
        2>/dev/null | sort -u); do
    PRELOAD+=("$lib")
done
if ((${#PRELOAD[@]})); then
    export LD_PRELOAD="$(IFS=:; echo "${PRELOAD[*]}")${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}"
say "vLLM CPU on :$PORT dtype=$DTYPE LD_PRELOAD=${LD_PRELOAD:-none}"
exec "$DEST/venv/bin/python" "$DEST/vllm_launcher.py" serve "$MODEL" \
    --host 127.0.0.1 --port "$PORT" --served-model-name smollm2 \
    --dtype "$DTYPE" --max-model-len 4096 --max-num-seqs 64
