"""The built-in connectors, registered as entry points like any plugin: `disk` and `peer`."""

from __future__ import annotations

from typing import ClassVar

from kvcache.connectors import (
    KV_CONNECTOR_API_VERSION,
    DiskStore,
    MemoryStore,
    PeerLookup,
    PeerServer,
    PeerStores,
    StoreLookup,
)
from runner.kv_connectors.base import KVConnectorContext
from runner.kv_connectors.worker import StoreWorker


class DiskConnector:
    """A persistent second tier of the prefix cache: every computed prompt block is written
    to files under the cache directory, and a later engine (restarted, or another replica on
    the host) loads the run of blocks after its own prefix-cache hit instead of computing it."""

    name: ClassVar[str] = "disk"
    api_version: ClassVar[int] = KV_CONNECTOR_API_VERSION

    def __init__(self, ctx: KVConnectorContext) -> None:
        self.store = DiskStore(ctx.root, ctx.layout, ctx.payload_len, ctx.store_bytes)
        self.scheduler = StoreLookup(ctx.layout, self.store)
        self.worker = StoreWorker(ctx, self.store)

    def close(self) -> None:
        self.worker.close()


class PeerConnector:
    """Prefill/decode disaggregation between two instances.

    producer: computes prompts (the front door asks for max_tokens 1) and keeps each prompt
    block in a bounded in-memory store, served on `ctx.peer`. consumer: for every prompt,
    pulls the blocks after its own prefix hit from the producer at `ctx.peer`, then decodes;
    whatever does not arrive intact (dead producer, evicted blocks) it computes itself. A
    request may name another producer (`kv_source`: the data-parallel front door's P/D
    mode does), so a consumer started without `ctx.peer` pulls only from those.
    On a Unix socket the blocks go through shared memory unless `ctx.peer_shm` is off.
    """

    name: ClassVar[str] = "peer"
    api_version: ClassVar[int] = KV_CONNECTOR_API_VERSION

    def __init__(self, ctx: KVConnectorContext) -> None:
        if ctx.role not in ("producer", "consumer"):
            raise ValueError(
                f"kv_role: the peer connector needs producer or consumer, got {ctx.role!r}"
            )
        self.server: PeerServer | None = None
        if ctx.role == "producer":
            if not ctx.peer:
                raise ValueError("kv_peer: a producer needs a socket path or host:port to serve")
            store = MemoryStore(ctx.layout, ctx.payload_len, ctx.store_bytes)
            self.server = PeerServer(ctx.peer, store, shm=ctx.peer_shm)
            self.scheduler = StoreLookup(ctx.layout, _NothingToLoad())
            self.worker = StoreWorker(ctx, store, sync_saves=True)
        else:
            peers = PeerStores(ctx.peer, ctx.layout, ctx.payload_len, shm=ctx.peer_shm)
            self.scheduler = PeerLookup(ctx.layout, peers)
            self.worker = StoreWorker(ctx, peers, sources=peers.get)

    def close(self) -> None:
        self.worker.close()
        if self.server is not None:
            self.server.close()


class _NothingToLoad:
    """A producer computes every prompt itself."""

    def contains(self, key: str) -> bool:
        return False
