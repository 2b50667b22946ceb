"""One page of KV memory and the free queue that holds unused pages."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvcache.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block; the tensors themselves belong to the runner."""

    block_id: int
    # Number of requests whose block table holds this block; 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Set once the block is full and cached; kept after it is freed, until it is evicted.
    block_hash: BlockHash | None = None
    # Free-queue links; only meaningful while ref_cnt == 0.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first.

    A cached block that gets a prefix hit must leave the middle of the queue, so removal
    is O(1) through the links stored on the block itself. Two sentinels remove the
    empty-list special cases.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block; the queue must not be empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block`, which must be in this queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the most recently freed end."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
