"""Paged KV memory: blocks, the free queue, prefix-cache hashing and per-request block tables.

Plain Python, no torch: the runner owns the tensors, this package owns who holds which page.
"""

from kvcache.block import FreeBlockQueue, KVCacheBlock
from kvcache.block_hash import (
    BlockHash,
    builtin_block_hash,
    get_hash_fn,
    prefix_block_hashes,
    request_extra_keys,
    sha256_block_hash,
)
from kvcache.block_pool import BlockPool
from kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventRecordingBlockPool,
    KVEvent,
    apply_events,
    replay,
)
from kvcache.manager import KVCacheManager, KVRequest, PrefixCacheStats, cdiv

DEFAULT_BLOCK_SIZE = 16

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "AllBlocksCleared",
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "EventRecordingBlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVEvent",
    "KVRequest",
    "PrefixCacheStats",
    "apply_events",
    "builtin_block_hash",
    "cdiv",
    "get_hash_fn",
    "prefix_block_hashes",
    "replay",
    "request_extra_keys",
    "sha256_block_hash",
]
