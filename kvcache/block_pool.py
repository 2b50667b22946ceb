"""The pool of KV blocks: hands blocks out, takes them back, and keeps the prefix cache."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcache.block import FreeBlockQueue, KVCacheBlock
from kvcache.block_hash import BlockHash


class BlockPool:
    """Owns every `KVCacheBlock`, the free queue and the `hash -> block` map.

    Invariants (checked by `check_integrity`):
    - a block is in the free queue exactly when its ref_cnt is 0;
    - a block has a hash exactly when the map points at it;
    - free + in use == num_blocks.
    Freed blocks keep their hash, so they can still be hit until eviction reuses them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner: truly empty ones plus cached ones that may be evicted."""
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks owned by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block for `block_hash`, or None."""
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the free queue, evicting the least recently freed cached ones.

        The caller checks `num_free_blocks` first; asking for more raises.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order.

        NOTE: callers pass a request's blocks tail first, so the end of a prompt is evicted
        before its start: a shared prefix is the part most likely to be hit again.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_blocks(
        self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash], start: int
    ) -> None:
        """Register `blocks[start:len(hashes)]` (now full) under their hashes.

        When another block already holds the same hash (two requests computed the same
        prefix at once), the map keeps the first one and this block stays uncached.
        """
        if not self.enable_caching:
            return
        for i in range(start, len(hashes)):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            if hashes[i] in self.cached:
                continue
            block.block_hash = hashes[i]
            self.cached[hashes[i]] = block

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of `blocks`: their contents are no longer trusted."""
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self.uncache([block])
            self.num_evictions += 1

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the pool is broken."""
        queued = list(self.free_queue)
        assert len(queued) == self.num_free_blocks, "free queue length mismatch"
        assert len({b.block_id for b in queued}) == len(queued), "block queued twice"
        assert all(b.ref_cnt == 0 for b in queued), "owned block in free queue"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(in_use) + len(queued) == self.num_blocks, "free + in use != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"map/hash mismatch on {block.block_id}"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self.cached), "hashed blocks missing from the cache map"
