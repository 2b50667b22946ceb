"""The disk tier's files: atomic, checked, bounded, shared between processes (torch-free)."""

from __future__ import annotations

import os
import time

from kvcache.connectors import DiskStore, KVLayout, MemoryStore, block_codec

LAYOUT = KVLayout("m", "float32", 4, 2, 1, 8)
OTHER = KVLayout("m", "bfloat16", 4, 2, 1, 8)
N = 64  # payload bytes of one block
KEYS = [f"{i:02x}" * 32 for i in range(10)]


def payload(i: int) -> bytes:
    return bytes([i]) * N


def test_round_trip_and_another_store_on_the_same_folder_sees_it(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, N, 1 << 20)
    for i, key in enumerate(KEYS[:3]):
        store.put(key, payload(i))
    replica = DiskStore(tmp_path, LAYOUT, N, 1 << 20)
    assert [bytes(p) for p in replica.get_many(KEYS[:3])] == [payload(i) for i in range(3)]
    assert replica.num_bytes == store.num_bytes > 3 * N
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.rglob("*"))


def test_get_many_stops_at_the_first_missing_block(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, N, 1 << 20)
    store.put(KEYS[0], payload(0))
    store.put(KEYS[2], payload(2))
    assert len(store.get_many(KEYS[:3])) == 1
    assert store.contains(KEYS[2]) and not store.contains(KEYS[1])


def test_bad_files_are_reported_missing_and_removed(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, N, 1 << 20)
    for i, key in enumerate(KEYS[:4]):
        store.put(key, payload(i))
    good = store.path(KEYS[0]).read_bytes()
    store.path(KEYS[0]).write_bytes(good[:-1])  # truncated
    flipped = bytearray(store.path(KEYS[1]).read_bytes())
    flipped[-1] ^= 1
    store.path(KEYS[1]).write_bytes(bytes(flipped))  # one bit of the payload
    store.path(KEYS[2]).write_bytes(good)  # another block's file under this name
    foreign = block_codec.encode(OTHER.key, KEYS[3], payload(3))
    store.path(KEYS[3]).write_bytes(foreign)  # another layout's bytes
    for key in KEYS[:4]:
        assert store.get_many([key]) == []
        assert not store.path(key).exists()
    assert store.num_corrupt == 4


def test_layouts_live_apart(tmp_path):
    DiskStore(tmp_path, LAYOUT, N, 1 << 20).put(KEYS[0], payload(0))
    assert not DiskStore(tmp_path, OTHER, N, 1 << 20).contains(KEYS[0])


def test_the_bound_evicts_least_recently_used_files(tmp_path):
    size = block_codec.encoded_size(LAYOUT.key, KEYS[0], N)
    store = DiskStore(tmp_path, LAYOUT, N, 5 * size)
    past = time.time() - 100
    for i, key in enumerate(KEYS[:5]):
        store.put(key, payload(i))
        os.utime(store.path(key), (past + i, past + i))
    store.get_many([KEYS[0]])  # a hit: now the most recently used
    store.put(KEYS[5], payload(5))  # over the bound: down to 90% of it
    kept = [k for k in KEYS[:6] if store.contains(k)]
    assert kept == [KEYS[0], KEYS[3], KEYS[4], KEYS[5]]
    assert store.num_bytes == 4 * size


def test_a_writer_that_died_leaves_no_stale_temporary_file(tmp_path):
    store = DiskStore(tmp_path, LAYOUT, N, 1 << 20)
    store.put(KEYS[0], payload(0))
    stale = store.path(KEYS[0]).parent / ".tmp-1-2-abc"
    stale.write_bytes(b"half a block")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    DiskStore(tmp_path, LAYOUT, N, 1 << 20)
    assert not stale.exists()


def test_memory_store_is_a_bounded_lru():
    size = block_codec.encoded_size(LAYOUT.key, KEYS[0], N)
    store = MemoryStore(LAYOUT, N, 3 * size)
    for i, key in enumerate(KEYS[:3]):
        store.put(key, payload(i))
    store.get_many([KEYS[0]])
    store.put(KEYS[3], payload(3))
    assert [store.contains(k) for k in KEYS[:4]] == [True, False, True, True]
    assert [bytes(p) for p in store.get_many([KEYS[0]])] == [payload(0)]
