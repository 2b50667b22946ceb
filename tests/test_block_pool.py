import pytest

from kvcache import BlockPool, FreeBlockQueue, KVCacheBlock, builtin_block_hash, sha256_block_hash
from kvcache.block_hash import get_hash_fn, hash_request_blocks


def test_free_queue_removes_from_the_middle_in_constant_links():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert len(q) == 4
    q.append(blocks[2])
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(99))


def test_pool_evicts_least_recently_freed_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_blocks([a, b, c], [b"ha", b"hb", b"hc"], 0)
    pool.free_blocks([b, a, c])  # freed order: b first
    pool.check_integrity()
    assert pool.num_free_blocks == 3 and len(pool.cached) == 3
    (new,) = pool.get_new_blocks(1)
    assert new is b and new.block_hash is None
    assert pool.get_cached_block(b"hb") is None
    assert pool.get_cached_block(b"ha") is a
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_blocks([a], [b"h"], 0)
    pool.free_blocks([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])


def test_integrity_check_catches_corruption():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0  # corrupt: owned-looking block with no ref and not queued
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_hashes_chain_and_salt():
    tokens = list(range(12))
    plain, salted, other = [], [], []
    for algo in ("sha256", "builtin"):
        fn = get_hash_fn(algo)
        plain, salted, other = [], [], []
        hash_request_blocks(fn, 4, tokens, plain, None)
        hash_request_blocks(fn, 4, tokens, salted, "tenant-a")
        hash_request_blocks(fn, 4, [99, *tokens[1:]], other, None)
        assert len(plain) == 3
        assert all(p != s for p, s in zip(plain, salted))  # salt reaches every block via the chain
        assert all(p != o for p, o in zip(plain, other))  # a change in block 0 changes all
    assert isinstance(sha256_block_hash(None, [1], ()), bytes)
    assert isinstance(builtin_block_hash(None, [1], ()), int)
    with pytest.raises(ValueError, match="prefix_cache_hash"):
        get_hash_fn("md5")
