"""KV-cache events: which prefix-cache hashes a block pool gained and dropped.

A replica drains these each step and publishes them; a router applies them to its mirror
of that replica's cache. They are exact: replaying every event from an empty set gives
exactly the pool's `cached` keys (`replay` below; the property tests check it).

```
BlockStored(hashes, parent)   full blocks became cache entries, in chain order
BlockRemoved(hashes)          entries evicted, or dropped by an untrusted free
AllBlocksCleared()            reset_prefix_cache: every entry forgotten
```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvcache.block import KVCacheBlock
from kvcache.block_hash import BlockHash
from kvcache.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that became prefix-cache entries, in chain order."""

    block_hashes: tuple[BlockHash, ...]
    # The hash of the block before the first one (None: the prompt's start). Lets a
    # consumer keep a tree instead of a set; the set semantics do not need it.
    parent_hash: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cache entries whose hash was dropped (evicted, or their contents were not trusted)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The pool forgot every hash (reset_prefix_cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def apply_events(hashes: set[BlockHash], events: Iterable[KVEvent]) -> None:
    """Apply `events` in order to the set `hashes` (a mirror of one pool)."""
    for ev in events:
        if isinstance(ev, BlockStored):
            hashes.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            hashes.difference_update(ev.block_hashes)
        else:
            hashes.clear()


def replay(events: Iterable[KVEvent]) -> set[BlockHash]:
    """The set of hashes that `events` leave, starting from an empty pool."""
    hashes: set[BlockHash] = set()
    apply_events(hashes, events)
    return hashes


class EventRecordingBlockPool(BlockPool):
    """A BlockPool that records every hash it gains or drops.

    NOTE: a subclass rather than `if recording:` branches inside BlockPool, so the pool a
    single engine uses (record_events=False) runs exactly the code it ran before.
    Removals are buffered and flushed as one BlockRemoved before the next other event, so
    evicting n blocks in one allocation is one event, not n.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self._events: list[KVEvent] = []
        self._removed: list[BlockHash] = []

    def cache_blocks(
        self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash], start: int
    ) -> None:
        before = [blocks[i].block_hash for i in range(start, len(hashes))]
        super().cache_blocks(blocks, hashes, start)
        # A block was stored when it had no hash before and has one now; blocks already
        # cached, or whose hash another block holds, break the run into several events.
        run: list[BlockHash] = []
        parent: BlockHash | None = None
        for offset, old in enumerate(before):
            i = start + offset
            if old is None and blocks[i].block_hash is not None:
                if not run:
                    parent = hashes[i - 1] if i else None
                run.append(hashes[i])
            elif run:
                self._store(run, parent)
                run = []
        if run:
            self._store(run, parent)

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        self._removed.extend(b.block_hash for b in blocks if b.block_hash is not None)
        super().uncache(blocks)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self._removed.clear()
        self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """Every event since the last drain, oldest first; each is handed out once."""
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def _store(self, run: list[BlockHash], parent: BlockHash | None) -> None:
        self._flush_removed()
        self._events.append(BlockStored(tuple(run), parent))

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed)))
            self._removed = []
