"""Moving blocks between instances: a producer's block server and a consumer's client store.

```
consumer -> producer   "HRKVGET1" | u32 len | JSON {"layout": layout key, "keys": [...]}
producer -> consumer   (u64 len | encoded block) for each leading key it holds, then u64 0
```
An address with a "/" is a Unix socket path, else "host:port" over TCP. The consumer
verifies every block (block_codec) and treats a refused connection, a timeout, a short
read or a bad block as "the blocks from there on are missing": it recomputes them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvcache.connectors import block_codec
from kvcache.connectors.base import KVLayout
from kvcache.connectors.stores import MemoryStore

log = logging.getLogger("headrace.kv_connector")

REQUEST_MAGIC = b"HRKVGET1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Most keys one request may name (a 128k-token prompt of 16-token blocks is 8k).
MAX_KEYS = 1 << 16
# After a failed fetch, the consumer stops asking for this long: a dead producer on TCP
# (no answer at all) would otherwise cost each request a connect timeout.
BACKOFF_S = 2.0


def is_unix(address: str) -> bool:
    return "/" in address


def _tcp(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"kv_peer: {address!r} is neither a socket path nor host:port")
    return host, int(port)


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    # NOTE: the buffer itself is returned, not a bytes copy: a block is ~1 MB, and a copy
    # holds the GIL that the engine's loop and runner threads want.
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.timeout_s)
        try:
            if _read_exact(sock, len(REQUEST_MAGIC)) != REQUEST_MAGIC:
                return
            (size,) = _U32.unpack(_read_exact(sock, _U32.size))
            if size > 64 * MAX_KEYS + 4096:
                return
            ask = json.loads(_read_exact(sock, size))
            keys = ask.get("keys", [])[:MAX_KEYS]
            store = self.server.store
            blocks = store.get_encoded(keys) if ask.get("layout") == store.layout.key else []
            for data in blocks:
                sock.sendall(_U64.pack(len(data)))
                sock.sendall(data)
            sock.sendall(_U64.pack(0))
        except (OSError, ValueError) as e:
            log.debug("kv peer server: request failed: %s", e)


class _Server(socketserver.ThreadingMixIn, socketserver.BaseServer):
    daemon_threads = True
    store: MemoryStore
    timeout_s: float


class _UnixServer(_Server, socketserver.UnixStreamServer):
    pass


class _TCPServer(_Server, socketserver.TCPServer):
    allow_reuse_address = True


class PeerServer:
    """Serves a producer's `MemoryStore` to consumers, on its own threads."""

    def __init__(self, address: str, store: MemoryStore, timeout_s: float = 10.0) -> None:
        self.address = address
        if is_unix(address):
            if os.path.exists(address):
                os.unlink(address)  # a socket left by a producer that died
            self._server: _Server = _UnixServer(address, _Handler)
        else:
            self._server = _TCPServer(_tcp(address), _Handler)
        self._server.store, self._server.timeout_s = store, timeout_s
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="headrace-kv-peer", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        if is_unix(self.address):
            with contextlib.suppress(OSError):
                os.unlink(self.address)


class PeerStore:
    """A consumer's view of a producer's blocks: fetched on demand, verified, never stored."""

    def __init__(
        self, address: str, layout: KVLayout, payload_len: int, timeout_s: float = 5.0
    ) -> None:
        if not is_unix(address):
            _tcp(address)  # a bad address is a configuration error, found at start
        self.address, self.layout, self.payload_len = address, layout, payload_len
        self.timeout_s = timeout_s
        self.num_failed = 0
        # Failed fetches by kind: peer_down (no connection, or cut), corrupt (a bad block),
        # missing (the producer no longer holds a block asked for).
        self.failures: Counter[str] = Counter()
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
                ask = json.dumps({"layout": self.layout.key, "keys": list(keys)}).encode()
                sock.sendall(REQUEST_MAGIC + _U32.pack(len(ask)) + ask)
                for key in keys:
                    (size,) = _U64.unpack(_read_exact(sock, _U64.size))
                    if size == 0:
                        break
                    limit = block_codec.encoded_size(self.layout.key, key, self.payload_len)
                    if size != limit:
                        raise ValueError(f"block {key[:12]} has {size} bytes, want {limit}")
                    payload = block_codec.decode(
                        _read_exact(sock, size), self.layout.key, key, self.payload_len
                    )
                    if payload is None:
                        raise ValueError(f"block {key[:12]} failed its check")
                    out.append(payload)
        except OSError as e:
            return self._failed("peer_down", e, out, keys)
        except ValueError as e:
            return self._failed("corrupt", e, out, keys)
        if len(out) < len(keys):
            self.failures["missing"] += 1
        return out

    def _failed(
        self, kind: str, e: Exception, out: list[memoryview], keys: Sequence[str]
    ) -> list[memoryview]:
        self.num_failed += 1
        self.failures[kind] += 1
        if not out:
            self._down_until = time.monotonic() + BACKOFF_S
        log.warning(
            "kv peer %s: %s after %d of %d blocks; recomputing the rest",
            self.address, e, len(out), len(keys),
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
        return socket.create_connection(_tcp(self.address), timeout=self.timeout_s)
