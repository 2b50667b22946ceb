"""A consumer's client for a producer's blocks (the wire is in peer_wire.py), and its
producers by address (`PeerStores`: one consumer may pull from any of several).

Every block is verified (block_codec). A refused connection, a timeout, a short read, a bad
block or an unusable shared-memory segment means "the blocks from there on are missing":
the consumer recomputes them. After an unusable segment it stops asking that producer for
shared memory; after a failed connection it stops asking at all for `BACKOFF_S`.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvcache.connectors import block_codec, peer_shm
from kvcache.connectors.base import KVLayout
from kvcache.connectors.peer_wire import (
    REQUEST_MAGIC,
    U32,
    U64,
    is_unix,
    read_exact,
    tcp_address,
)

log = logging.getLogger("headrace.kv_connector")

# After a failed fetch, the consumer stops asking for this long: a dead producer on TCP
# (no answer at all) would otherwise cost each request a connect timeout.
BACKOFF_S = 2.0


class PeerStore:
    """A consumer's view of a producer's blocks: fetched on demand, verified, never stored.

    `shm`: ask for replies through shared memory (Unix socket addresses only)."""

    def __init__(
        self,
        address: str,
        layout: KVLayout,
        payload_len: int,
        timeout_s: float = 5.0,
        shm: bool = True,
    ) -> None:
        if not is_unix(address):
            tcp_address(address)  # a bad address is a configuration error, found at start
        self.address, self.layout, self.payload_len = address, layout, payload_len
        self.timeout_s = timeout_s
        self.shm = shm and is_unix(address) and peer_shm.available()
        self.num_failed = 0
        # Failed fetches by kind: peer_down (no connection, or cut), corrupt (a bad block),
        # missing (the producer no longer holds a block asked for), shm (an unusable segment).
        self.failures: Counter[str] = Counter()
        # Replies with blocks by the path they came ("shm", "socket"), and their bytes.
        self.transfers: Counter[str] = Counter()
        self.transfer_bytes: Counter[str] = Counter()
        self._down_until = 0.0

    def contains(self, key: str) -> bool:
        """Unknown until asked: the consumer tries, and recomputes what does not come (but
        not while the producer is backed off after a failure)."""
        return time.monotonic() >= self._down_until

    def put(self, key: str, payload: bytes | memoryview) -> None:
        raise NotImplementedError("a consumer's peer store is read-only")

    def get_many(self, keys: Sequence[str]) -> list[memoryview]:
        out: list[memoryview] = []
        try:
            sock = self._connect()
        except OSError as e:
            return self._failed("peer_down", e, out, keys)
        try:
            with sock:
                ask: dict[str, object] = {"layout": self.layout.key, "keys": list(keys)}
                if self.shm:
                    ask["shm"] = True
                data = json.dumps(ask).encode()
                sock.sendall(REQUEST_MAGIC + U32.pack(len(data)) + data)
                first, fds = self._read_first(sock)
                if first == peer_shm.SHM_MAGIC:
                    self._read_segment(sock, fds, keys, out)
                else:
                    peer_shm.close_fds(fds)
                    self._read_stream(sock, first, keys, out)
        except peer_shm.ShmError as e:
            # The producer is up: the socket path from now on, no back-off; this load
            # recomputes what the segment did not give.
            self.shm = False
            return self._failed("shm", e, out, keys, back_off=False)
        except OSError as e:
            return self._failed("peer_down", e, out, keys)
        except ValueError as e:
            return self._failed("corrupt", e, out, keys)
        if len(out) < len(keys):
            self.failures["missing"] += 1
        return out

    def _read_first(self, sock: socket.socket) -> tuple[bytes, list[int]]:
        """The reply's first 8 bytes (a block length, or the shm magic) and any fds."""
        if not is_unix(self.address):
            return bytes(read_exact(sock, U64.size)), []
        msg, fds = peer_shm.recv_head(sock, U64.size)
        if not msg:
            peer_shm.close_fds(fds)
            raise ConnectionError("peer closed before answering")
        if len(msg) < U64.size:
            try:
                msg += read_exact(sock, U64.size - len(msg))
            except BaseException:
                peer_shm.close_fds(fds)
                raise
        return bytes(msg), fds

    def _check_size(self, key: str, size: int) -> None:
        limit = block_codec.encoded_size(self.layout.key, key, self.payload_len)
        if size != limit:
            raise ValueError(f"block {key[:12]} has {size} bytes, want {limit}")

    def _decode(self, data: bytearray | memoryview, key: str) -> memoryview:
        payload = block_codec.decode(data, self.layout.key, key, self.payload_len)
        if payload is None:
            raise ValueError(f"block {key[:12]} failed its check")
        return payload

    def _read_stream(
        self, sock: socket.socket, first: bytes, keys: Sequence[str], out: list[memoryview]
    ) -> None:
        head, nbytes = first, 0
        for key in keys:
            (size,) = U64.unpack(head or read_exact(sock, U64.size))
            head = b""
            if size == 0:
                break
            self._check_size(key, size)
            out.append(self._decode(read_exact(sock, size), key))
            nbytes += size
        if out:
            self.transfers["socket"] += 1
            self.transfer_bytes["socket"] += nbytes

    def _read_segment(
        self, sock: socket.socket, fds: list[int], keys: Sequence[str], out: list[memoryview]
    ) -> None:
        """Blocks decoded in place from the segment the producer sent (fds are closed)."""
        try:
            (n,) = U32.unpack(read_exact(sock, U32.size))
            if not 0 < n <= len(keys):
                raise ValueError(f"a shared-memory reply of {n} blocks to {len(keys)} asked")
            lengths = struct.unpack(f"<{n}Q", read_exact(sock, n * U64.size))
        except BaseException:
            peer_shm.close_fds(fds)
            raise
        view = peer_shm.map_segment(fds, sum(lengths))
        pos = 0
        for key, size in zip(keys, lengths):
            self._check_size(key, size)
            out.append(self._decode(view[pos : pos + size], key))
            pos += size
        self.transfers["shm"] += 1
        self.transfer_bytes["shm"] += pos

    def _failed(
        self,
        kind: str,
        e: Exception,
        out: list[memoryview],
        keys: Sequence[str],
        back_off: bool = True,
    ) -> list[memoryview]:
        self.num_failed += 1
        self.failures[kind] += 1
        if back_off and not out:
            self._down_until = time.monotonic() + BACKOFF_S
        # NOTE: str(e), not e: a record kept by a handler would hold the traceback, and
        # with it a mapped segment (and the fd its mmap holds).
        log.warning(
            "kv peer %s: %s after %d of %d blocks; recomputing the rest",
            self.address, str(e), len(out), len(keys),
        )  # fmt: skip
        return out

    def _connect(self) -> socket.socket:
        if is_unix(self.address):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                raise
            return sock
        return socket.create_connection(tcp_address(self.address), timeout=self.timeout_s)


class PeerStores:
    """A consumer's producers by KV address: the one it was started with (`--kv-peer`, maybe
    none) and any a request names (LoadSpec.source), each a PeerStore made on first use.

    Also a BlockStore over the default producer, and the sum of every producer's figures
    (`failures`, `transfers`, `num_failed`) for /metrics. Any thread may call it.
    """

    def __init__(
        self,
        default: str | None,
        layout: KVLayout,
        payload_len: int,
        shm: bool = True,
        max_peers: int = 256,
    ) -> None:
        self.layout, self.payload_len, self.shm, self.max_peers = (
            layout,
            payload_len,
            shm,
            max_peers,
        )
        self.default = default
        self._peers: OrderedDict[str, PeerStore] = OrderedDict()
        self._lock = threading.Lock()
        # Figures of producers forgotten to keep `max_peers`.
        self._past_failures: Counter[str] = Counter()
        self._past_transfers: Counter[str] = Counter()
        self._past_failed = 0
        if default is not None:
            # A bad --kv-peer is a configuration error, found at start (ValueError).
            self._peers[default] = PeerStore(default, layout, payload_len, shm=shm)

    def get(self, address: str | None) -> PeerStore | None:
        """The store for `address` (None: the default producer); None when there is none."""
        address = address or self.default
        if address is None:
            return None
        with self._lock:
            store = self._peers.get(address)
            if store is None:
                try:
                    store = PeerStore(address, self.layout, self.payload_len, shm=self.shm)
                except ValueError as e:
                    log.warning("kv peer: %s; the request computes its prompt", e)
                    return None
                self._peers[address] = store
                while len(self._peers) > self.max_peers:
                    _, old = self._peers.popitem(last=False)
                    self._past_failures.update(old.failures)
                    self._past_transfers.update(old.transfers)
                    self._past_failed += old.num_failed
            self._peers.move_to_end(address)
            return store

    def contains(self, key: str) -> bool:
        store = self.get(None)
        return store is not None and store.contains(key)

    def get_many(self, keys: Sequence[str]) -> list[memoryview]:
        store = self.get(None)
        return store.get_many(keys) if store is not None else []

    def put(self, key: str, payload: bytes | memoryview) -> None:
        raise NotImplementedError("a consumer's peer store is read-only")

    def _sum(self, past: Counter[str], name: str) -> Counter[str]:
        with self._lock:
            out = Counter(past)
            for store in self._peers.values():
                out.update(getattr(store, name))
        return out

    @property
    def failures(self) -> Counter[str]:
        return self._sum(self._past_failures, "failures")

    @property
    def transfers(self) -> Counter[str]:
        return self._sum(self._past_transfers, "transfers")

    @property
    def num_failed(self) -> int:
        """Fetches that failed (a miss of an evicted block is not a failure)."""
        with self._lock:
            return self._past_failed + sum(s.num_failed for s in self._peers.values())
