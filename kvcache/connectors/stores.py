"""Where connector blocks live: `BlockStore`, and an in-memory one (a producer's served blocks).

A store holds encoded blocks (kvcache/connectors/block_codec.py) by key and hands back only
verified payloads, leading ones first: blocks are chained, so a block after a missing or bad
one is useless (its KV assumes the missing prefix).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvcache.connectors import block_codec
from kvcache.connectors.base import KVLayout


@runtime_checkable
class BlockStore(Protocol):
    """Blocks by key; every method may be called from any thread."""

    def contains(self, key: str) -> bool:
        """Whether a block is (probably) there; cheap enough for the scheduler's thread."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[memoryview]:
        """Payloads of the leading keys that are present and intact (may be fewer, or none)."""
        ...

    def put(self, key: str, payload: bytes | memoryview) -> None:
        """Store one block's payload (a no-op when the key is there already)."""
        ...


class MemoryStore:
    """A bounded LRU of encoded blocks in host memory (a P/D producer serves from it)."""

    def __init__(self, layout: KVLayout, payload_len: int, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"kv_store_gb: must be > 0, got {max_bytes} bytes")
        self.layout, self.payload_len, self.max_bytes = layout, payload_len, max_bytes
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # Blocks a load wanted and did not get: corrupt, or missing (evicted meanwhile).
        self.failures: Counter[str] = Counter()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def get_encoded(self, keys: Sequence[str]) -> list[bytes]:
        """The leading present blocks, still encoded (what a peer sends on the wire)."""
        out = []
        with self._lock:
            for key in keys:
                data = self._blocks.get(key)
                if data is None:
                    break
                self._blocks.move_to_end(key)
                out.append(data)
        return out

    def get_many(self, keys: Sequence[str]) -> list[memoryview]:
        out = []
        for key, data in zip(keys, self.get_encoded(keys)):
            payload = block_codec.decode(data, self.layout.key, key, self.payload_len)
            if payload is None:
                self.failures["corrupt"] += 1
                return out
            out.append(payload)
        if len(out) < len(keys):
            self.failures["missing"] += 1
        return out

    def put(self, key: str, payload: bytes | memoryview) -> None:
        data = block_codec.encode(self.layout.key, key, payload)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= len(old)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_bytes(self) -> int:
        return self._bytes
