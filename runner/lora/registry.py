"""The adapters a daemon serves, by name: read and checked once, shared with the runner.

The engine owns it (loop thread). Adding reads files and may take a while, so callers on
the event loop run `read` in a worker thread and `add` the result. An adapter removed while
requests still use it stays alive through those requests (each holds its adapter object);
new requests no longer find the name.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from runner.lora.adapter import LoRAAdapter, LoRABase, LoRAError, load_adapter


class UnknownAdapterError(LookupError):
    """No adapter of that name (the API answers 404 naming it)."""


class LoRARegistry:
    """Name -> LoRAAdapter, each validated against the base and `max_rank`."""

    def __init__(self, base: LoRABase, max_rank: int) -> None:
        if max_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {max_rank}")
        self.base, self.max_rank = base, max_rank
        self._adapters: dict[str, LoRAAdapter] = {}

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load and check an adapter file without registering it (thread-safe)."""
        if not name or any(c.isspace() for c in name):
            raise LoRAError(f"lora_name: {name!r} must be a non-empty name without spaces")
        return load_adapter(name, path, self.base, self.max_rank)

    def add(self, adapter: LoRAAdapter, replace: bool = False) -> None:
        if adapter.name in self._adapters and not replace:
            raise LoRAError(f"lora_name: an adapter named {adapter.name!r} is loaded already")
        self._adapters[adapter.name] = adapter

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """`read` then `add`."""
        adapter = self.read(name, path)
        self.add(adapter)
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        try:
            return self._adapters.pop(name)
        except KeyError:
            raise UnknownAdapterError(f"the LoRA adapter {name!r} does not exist") from None

    def get(self, name: str) -> LoRAAdapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise UnknownAdapterError(f"the model {name!r} does not exist") from None

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterable[LoRAAdapter]:
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)
