"""Blocks between instances (torch-free): verified, leading ones only, failures back off."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import pytest

from kvcache.connectors import KVLayout, MemoryStore, PeerServer, PeerStore, block_codec, peer_wire

LAYOUT = KVLayout("m", "float32", 4, 2, 1, 8)
N = 64
KEYS = [f"{i:02x}" * 32 for i in range(6)]


def producer(tmp_path, n: int = 4) -> tuple[PeerServer, str]:
    store = MemoryStore(LAYOUT, N, 1 << 20)
    for i, key in enumerate(KEYS[:n]):
        store.put(key, bytes([i]) * N)
    address = str(tmp_path / "kv.sock")
    return PeerServer(address, store), address


def test_consumer_gets_the_leading_blocks_the_producer_holds(tmp_path):
    server, address = producer(tmp_path, n=4)
    try:
        remote = PeerStore(address, LAYOUT, N)
        got = remote.get_many(KEYS)  # 4 held, 2 not
        assert [bytes(p) for p in got] == [bytes([i]) * N for i in range(4)]
        assert remote.get_many([KEYS[5], KEYS[0]]) == []  # a gap ends the run
        other = PeerStore(address, KVLayout("m", "bfloat16", 4, 2, 1, 8), N)
        assert other.get_many(KEYS[:2]) == []  # another layout gets nothing
        assert remote.num_failed == 0
    finally:
        server.close()


def test_a_dead_producer_is_a_miss_and_backs_off(tmp_path):
    remote = PeerStore(str(tmp_path / "nobody.sock"), LAYOUT, N)
    assert remote.contains(KEYS[0])
    assert remote.get_many(KEYS[:2]) == []
    assert remote.num_failed == 1
    assert not remote.contains(KEYS[0])  # no new loads for a while


def rogue(address: str, blocks: list[bytes], close_after: int | None = None) -> threading.Thread:
    """A producer that sends these raw blocks (and maybe hangs up half-way)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(address)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(1 << 16)
        # The consumer hangs up at the first bad block: a broken pipe here is expected.
        with contextlib.suppress(OSError):
            for i, data in enumerate(blocks):
                conn.sendall(struct.pack("<Q", len(data)))
                conn.sendall(data if i != close_after else data[: len(data) // 2])
                if i == close_after:
                    break
            else:
                conn.sendall(struct.pack("<Q", 0))
        conn.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_a_transfer_cut_off_or_corrupted_keeps_only_the_good_blocks(tmp_path):
    good = [block_codec.encode(LAYOUT.key, k, bytes([i]) * N) for i, k in enumerate(KEYS[:3])]
    for name, blocks, cut, want in (
        ("cut", good, 1, 1),
        ("flipped", [good[0], good[1][:-1] + b"\x00", good[2]], None, 1),
        ("swapped", [good[0], good[2], good[1]], None, 1),
    ):
        address = str(tmp_path / f"{name}.sock")
        t = rogue(address, blocks, cut)
        remote = PeerStore(address, LAYOUT, N)
        assert len(remote.get_many(KEYS[:3])) == want, name
        assert remote.num_failed == 1
        t.join(5)


def test_addresses_are_a_path_or_host_port():
    assert peer_wire.is_unix("/run/kv.sock") and not peer_wire.is_unix("10.0.0.2:7000")
    with pytest.raises(ValueError, match="kv_peer"):
        PeerStore("nohost", LAYOUT, N)
