"""HF model directories: config.json plus *.safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import torch
from safetensors import safe_open

from runner.model_config import ModelConfig


class HFDirectory:
    """A model directory in the HF layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(orjson.loads((self.path / "config.json").read_bytes()))

    def is_quantized(self) -> bool:
        """Safetensors are loaded as float tensors; no quantised HF format is read yet."""
        return False

    def weights(self, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no *.safetensors files (only safetensors load)")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name).float()
