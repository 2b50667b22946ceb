"""Blocks between instances (torch-free): verified, leading ones only, failures back off."""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
import struct
import threading
import time

import pytest

from kvcache.connectors import (
    KVLayout,
    MemoryStore,
    PeerServer,
    PeerStore,
    block_codec,
    peer_shm,
    peer_wire,
)

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


def open_fds(want: int | None = None) -> int:
    """Open fds of this process; with `want`, once they are back to it (or after 5 s): a
    server thread closes its connection after the consumer has its answer."""
    deadline = time.monotonic() + 5
    while (n := len(os.listdir("/proc/self/fd"))) != want and time.monotonic() < deadline:
        if want is None:
            break
        time.sleep(0.01)
    return n


def test_on_a_unix_socket_the_blocks_come_through_shared_memory(tmp_path):
    server, address = producer(tmp_path, n=4)
    fds = open_fds()
    try:
        remote = PeerStore(address, LAYOUT, N)
        got = remote.get_many(KEYS)
        assert [bytes(p) for p in got] == [bytes([i]) * N for i in range(4)]
        # decoded in place: each payload is a view of the mapped segment, writable for torch
        assert all(isinstance(p.obj, mmap.mmap) and not p.readonly for p in got)
        assert remote.transfers == {"shm": 1} and server.replies == {"shm": 1}
        assert remote.transfer_bytes["shm"] == 4 * block_codec.encoded_size(LAYOUT.key, KEYS[0], N)
        del got
        assert open_fds(fds) == fds  # the fd was closed once mapped, on both sides
    finally:
        server.close()


def test_producers_or_consumers_without_shm_and_tcp_use_the_socket(tmp_path):
    store = MemoryStore(LAYOUT, N, 1 << 20)
    store.put(KEYS[0], b"\x07" * N)
    for address, server_shm, client_shm in (
        (str(tmp_path / "declines.sock"), False, True),
        (str(tmp_path / "old-consumer.sock"), True, False),
        ("127.0.0.1:0", True, True),
    ):
        server = PeerServer(address, store, shm=server_shm)
        try:
            remote = PeerStore(server.address, LAYOUT, N, shm=client_shm)
            got = remote.get_many(KEYS[:1])
            assert [bytes(p) for p in got] == [b"\x07" * N], address
            assert remote.transfers == {"socket": 1} and server.replies == {"socket": 1}
        finally:
            server.close()


def sealed_segment(data: bytes, seal: bool = True) -> int:
    fd = os.memfd_create("rogue", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, peer_shm._seals())
    return fd


def rogue_shm(address: str, fds: list[int], lengths: list[int]) -> threading.Thread:
    """A producer that answers with a shared-memory header carrying these fds."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(address)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(1 << 16)
        head = peer_shm.SHM_MAGIC + struct.pack("<I", len(lengths))
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        with contextlib.suppress(OSError):
            conn.sendmsg([head + struct.pack(f"<{len(lengths)}Q", *lengths)], anc)
        peer_shm.close_fds(fds)
        conn.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_an_unusable_segment_is_recomputed_and_the_socket_used_from_then_on(tmp_path):
    good = [block_codec.encode(LAYOUT.key, k, bytes([i]) * N) for i, k in enumerate(KEYS[:2])]
    whole = b"".join(good)
    size = len(good[0])
    fds = open_fds()
    for name, make, lengths, kind in (
        ("no-fd", lambda: [], [size], "shm"),
        ("unsealed", lambda: [sealed_segment(whole, seal=False)], [size, size], "shm"),
        ("short", lambda: [sealed_segment(whole[:-10])], [size, size], "shm"),
        ("two-fds", lambda: [sealed_segment(whole), sealed_segment(whole)], [size, size], "shm"),
        ("flipped", lambda: [sealed_segment(whole[:-1] + b"\x00")], [size, size], "corrupt"),
    ):
        address = str(tmp_path / f"{name}.sock")
        t = rogue_shm(address, make(), lengths)
        remote = PeerStore(address, LAYOUT, N)
        got = remote.get_many(KEYS[:2])
        assert len(got) == (1 if name == "flipped" else 0), name
        assert remote.failures == {kind: 1}, name
        assert remote.shm is (kind != "shm"), name  # a bad segment: the socket from now on
        assert remote.contains(KEYS[0]), name  # the producer is up: no back-off
        del got
        t.join(5)
    assert open_fds() == fds  # every fd received was closed
