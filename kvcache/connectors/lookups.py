"""Scheduler sides of the built-in connectors: what a store holds, and what to save to it."""

from __future__ import annotations

from kvcache.connectors.base import KVConnectorScheduler, KVLayout
from kvcache.connectors.peer_store import PeerStores
from kvcache.connectors.stores import BlockStore
from kvcache.manager import KVRequest


def _max_blocks(req: KVRequest, block_size: int) -> int:
    # Every full block, the one with the last prompt token too: the caller leaves that
    # token to compute, so a prompt ending on a block boundary computes 1 token, not 16.
    return min(len(req.block_hashes), req.num_tokens // block_size)


class StoreLookup(KVConnectorScheduler):
    """Supplies the run of blocks after the local hit that `store` holds; saves new ones."""

    def __init__(self, layout: KVLayout, store: BlockStore, saves: bool = True) -> None:
        super().__init__(layout)
        self.store = store
        self._saves = saves

    @property
    def wants_saves(self) -> bool:
        return self._saves

    def store_for(self, req: KVRequest) -> BlockStore | None:
        """The store `req`'s blocks would come from (None: nowhere)."""
        return self.store

    def get_num_new_matched_tokens(self, req: KVRequest, num_computed_tokens: int) -> int:
        store = self.store_for(req)
        if store is None:
            return 0
        bs = self.layout.block_size
        first, end = num_computed_tokens // bs, _max_blocks(req, bs)
        n = 0
        for h in req.block_hashes[first:end]:
            if not store.contains(self.layout.block_key(h)):
                break
            n += 1
        # The last prompt token is always computed, so the step has logits to sample.
        return max(0, min((first + n) * bs, req.num_tokens - 1) - num_computed_tokens)


class PeerLookup(StoreLookup):
    """A P/D consumer's: the blocks after the local hit come from the producer the request
    names (`kv_source`, set by the front door), else from the one it was started with."""

    def __init__(self, layout: KVLayout, peers: PeerStores) -> None:
        super().__init__(layout, peers, saves=False)
        self.peers = peers

    def source(self, req: KVRequest) -> str | None:
        return getattr(req, "kv_source", None)

    def store_for(self, req: KVRequest) -> BlockStore | None:
        return self.peers.get(self.source(req))
