#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist.
# Idempotent: an existing binary is kept. ~11 min on 2 cores.
set -euo pipefail
source "$(dirname "$0")/common.sh"
DEST="$PEERS_DIR/llama-server"
BIN="$DEST/bin/llama-server"
if [[ -x "$BIN" ]]; then
    say "llama-server already built: $BIN (delete $DEST to rebuild)"
    exit 0
fi
mkdir -p "$DEST/src"
start=$(date +%s)
if ! ls "$DEST"/src/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    say "downloading the llama-cpp-python sdist"
    python3 -m pip download -q --no-binary :all: --no-deps llama-cpp-python -d "$DEST/src"
fi
SDIST=$(ls "$DEST"/src/llama_cpp_python-*.tar.gz | head -1)
SRC_ROOT="$DEST/src/$(basename "$SDIST" .tar.gz)"
[[ -d "$SRC_ROOT" ]] || tar -xzf "$SDIST" -C "$DEST/src"
LLAMA_SRC="$SRC_ROOT/vendor/llama.cpp"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || die "no vendored llama.cpp in $SDIST"

# GGML_NATIVE=ON died with SIGILL on a Sapphire Rapids guest: name the ISA flags that lscpu
# reports instead, so the binary uses exactly what this CPU has.
FLAGS=$(lscpu | sed -n 's/^Flags:\s*//p')
has() { [[ " $FLAGS " == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma)
     -DGGML_F16C=$(onoff f16c) -DGGML_AVX512=$(onoff avx512f) -DGGML_AVX512_VBMI=$(onoff avx512vbmi)
     -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)
     -DGGML_AVX_VNNI=$(onoff avx_vnni))
# AMX is off unless asked for (LLAMA_AMX=1): the AMX build died with SIGILL at start-up on
# a Sapphire Rapids KVM guest whose flags list amx_tile/amx_int8.
if [[ "${LLAMA_AMX:-0}" == 1 ]] && has amx_tile && has amx_int8; then
    ISA+=(-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON)
    if has amx_bf16; then ISA+=(-DGGML_AMX_BF16=ON); fi
else
    ISA+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
say "ISA flags: ${ISA[*]}"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
nice -n 15 cmake -S "$LLAMA_SRC" -B "$DEST/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF "${ISA[@]}"
nice -n 15 cmake --build "$DEST/build" --target llama-server -j "$(nproc)"
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$BIN"
say "built $BIN in $(( $(date +%s) - start )) s"
