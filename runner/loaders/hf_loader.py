"""HF model directories: config.json plus *.safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import torch
from safetensors import safe_open

from runner.model_config import ModelConfig
from runner.parallel.sharding import ShardPlan


class HFDirectory:
    """A model directory in the HF layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(orjson.loads((self.path / "config.json").read_bytes()))

    def is_quantized(self) -> bool:
        """Safetensors are loaded as float tensors; no quantised HF format is read yet."""
        return False

    def weights(
        self, cfg: ModelConfig, shard: ShardPlan | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named fp32 tensors; with `shard` only this rank's slice of each is read."""
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no *.safetensors files (only safetensors load)")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    where = shard.select(name) if shard is not None else None
                    if where is None:
                        yield name, f.get_tensor(name).float()
                        continue
                    dim, ranges = where
                    part = f.get_slice(name)
                    cut = [slice(None)] * dim
                    pieces = [part[(*cut, slice(a, b))] for a, b in ranges]
                    yield name, torch.cat(pieces, dim).float()
