"""Runner side of the KV connector interface, and what a connector plugin is built from.

A connector plugin (entry point group `headrace.kv_connectors`) is a class with
`name`, `api_version` (kvcache.connectors.KV_CONNECTOR_API_VERSION) and a constructor taking
a `KVConnectorContext`; the instance carries `scheduler` (a KVConnectorScheduler, torch-free,
used on the scheduler's thread) and `worker` (a KVConnectorWorker, used by the runner).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from kvcache.connectors import KVConnectorMeta, KVConnectorScheduler, KVLayout, LoadSpec
from scheduling import SchedulerOutput


@dataclass(frozen=True, slots=True)
class KVConnectorContext:
    """Everything a connector needs to know about the engine it serves."""

    layout: KVLayout
    dtype: torch.dtype
    device: torch.device
    # producer or consumer for P/D connectors; None otherwise.
    role: str | None
    # A peer's address: a Unix socket path or host:port.
    peer: str | None
    # Bound on the connector's store (disk files, or a producer's blocks in RAM).
    store_bytes: int
    # Folder for persistent tiers (under the cache directory).
    root: Path
    # Bytes of loaded KV one step copies into the paged cache while other requests run.
    commit_bytes_per_step: int = 16 << 20
    # Peer connectors on one host: blocks through shared memory rather than the socket.
    peer_shm: bool = True

    @property
    def payload_len(self) -> int:
        """Bytes of one block's K and V over all layers."""
        lay = self.layout
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * lay.head_dim * itemsize


class BlockTables(Protocol):
    """What the worker reads of the runner's request copies: each request's block table."""

    def __getitem__(self, req_id: str) -> object: ...


@runtime_checkable
class KVConnectorWorker(Protocol):
    """Runner side: moves blocks between the paged cache and wherever the connector keeps them.

    `start_loads`, `poll_loads`, `needs_commit` and `discard` may be called from any thread
    (the engine loop calls them); `commit` and `save` run on the runner thread, inside
    `execute`.
    """

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        """Begin fetching these blocks into host memory, off the calling thread."""
        ...

    def poll_loads(self) -> dict[str, int]:
        """Loads finished since the last call: req id -> leading blocks now in the paged
        cache (maybe 0)."""
        ...

    def needs_commit(self) -> bool:
        """Whether fetched blocks wait for `commit` (the engine then runs an empty step)."""
        ...

    def has_inflight(self) -> bool:
        """Whether a load is still being fetched."""
        ...

    def wait_any(self, timeout: float) -> None:
        """Sleep until a load finishes or `timeout` passes."""
        ...

    def discard(self, req_ids: Iterable[str]) -> None:
        """Drop staged or in-flight loads of requests that ended."""
        ...

    def commit(self, so: SchedulerOutput, block_ids: Mapping[str, list[int]],
               kv_caches: list[torch.Tensor]) -> None:  # fmt: skip
        """Copy fetched blocks into the paged cache, at the start of every runner step (also
        an empty one), before its forward. The blocks are those of `LoadSpec.block_ids`,
        owned by requests still waiting: a load is reported by `poll_loads` only once all
        of it is in. A budget per step keeps one long load from stretching a step."""
        ...

    def save(self, meta: KVConnectorMeta, block_ids: Mapping[str, list[int]],
             kv_caches: list[torch.Tensor]) -> None:  # fmt: skip
        """Copy the blocks `meta.saves` names out of the paged cache (after the forward)."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Wait for saves still being written."""
        ...

    def close(self) -> None: ...


class KVConnector(Protocol):
    """What a `headrace.kv_connectors` entry point builds."""

    name: str
    api_version: int
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker

    def close(self) -> None:
        """Finish writes and stop threads; the engine calls it once, at its end."""
        ...
