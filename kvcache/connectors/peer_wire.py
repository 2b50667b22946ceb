"""Moving blocks between instances: the wire, and a producer's block server.

```
consumer -> producer   "HRKVGET1" | u32 len | JSON {"layout": layout key, "keys": [...],
                                                    "shm": true (Unix socket only)}
producer -> consumer   socket: (u64 len | encoded block) for each leading key it holds, u64 0
                       shm:    "HRKVSHM1" + fd of a sealed memfd | u32 n | n x u64 len
```
An address with a "/" is a Unix socket path, else "host:port" over TCP. Over a Unix socket
the consumer asks for shared memory (peer_shm.py): the producer may decline (an older one
ignores the field, one with shm off or no blocks to send answers on the socket), and the
first 8 bytes say which it chose ("HRKVSHM1" is never a valid block length). The consumer's
side is peer_store.py.
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
from collections import Counter

from kvcache.connectors import peer_shm
from kvcache.connectors.stores import MemoryStore

log = logging.getLogger("headrace.kv_connector")

REQUEST_MAGIC = b"HRKVGET1"
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
# Most keys one request may name (a 128k-token prompt of 16-token blocks is 8k).
MAX_KEYS = 1 << 16


def is_unix(address: str) -> bool:
    return "/" in address


def tcp_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"kv_peer: {address!r} is neither a socket path nor host:port")
    return host, int(port)


def read_exact(sock: socket.socket, n: int) -> bytearray:
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
            if read_exact(sock, len(REQUEST_MAGIC)) != REQUEST_MAGIC:
                return
            (size,) = U32.unpack(read_exact(sock, U32.size))
            if size > 64 * MAX_KEYS + 4096:
                return
            ask = json.loads(read_exact(sock, size))
            keys = ask.get("keys", [])[:MAX_KEYS]
            store = self.server.store
            blocks = store.get_encoded(keys) if ask.get("layout") == store.layout.key else []
            if blocks and ask.get("shm") is True and self.server.shm and self._send_shm(blocks):
                return
            if blocks:
                self.server.count("socket", sum(map(len, blocks)))
            for data in blocks:
                sock.sendall(U64.pack(len(data)))
                sock.sendall(data)
            sock.sendall(U64.pack(0))
        except (OSError, ValueError) as e:
            log.debug("kv peer server: request failed: %s", e)

    def _send_shm(self, blocks: list[bytes]) -> bool:
        """The reply through a memfd; False (nothing sent) when one cannot be made."""
        try:
            fd = peer_shm.write_segment(blocks)
        except OSError as e:
            log.warning("kv peer server: no shared memory (%s); answering on the socket", e)
            return False
        self.server.count("shm", sum(map(len, blocks)))
        try:
            peer_shm.send_segment(self.request, fd, [len(b) for b in blocks])
        finally:
            os.close(fd)
        return True


class _Server(socketserver.ThreadingMixIn, socketserver.BaseServer):
    daemon_threads = True
    store: MemoryStore
    timeout_s: float
    shm: bool
    # Replies with blocks and their bytes by path ("shm", "socket"), counted on the handler
    # threads as a reply starts (so a consumer that has its reply sees it counted).
    replies: Counter[str]
    reply_bytes: Counter[str]
    lock: threading.Lock

    def count(self, path: str, nbytes: int) -> None:
        with self.lock:
            self.replies[path] += 1
            self.reply_bytes[path] += nbytes


class _UnixServer(_Server, socketserver.UnixStreamServer):
    pass


class _TCPServer(_Server, socketserver.TCPServer):
    allow_reuse_address = True


class PeerServer:
    """Serves a producer's `MemoryStore` to consumers, on its own threads.

    `shm`: answer a consumer on the Unix socket that asks for it through shared memory."""

    def __init__(
        self, address: str, store: MemoryStore, timeout_s: float = 10.0, shm: bool = True
    ) -> None:
        self.address = address
        if is_unix(address):
            if os.path.exists(address):
                os.unlink(address)  # a socket left by a producer that died
            self._server: _Server = _UnixServer(address, _Handler)
        else:
            self._server = _TCPServer(tcp_address(address), _Handler)
            # The port bound, should `address` have asked for any (port 0).
            self.address = f"{address.rpartition(':')[0]}:{self._server.server_address[1]}"
        self._server.store, self._server.timeout_s = store, timeout_s
        self._server.shm = shm and is_unix(address) and peer_shm.available()
        self._server.replies, self._server.reply_bytes = Counter(), Counter()
        self._server.lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="headrace-kv-peer", daemon=True
        )
        self._thread.start()

    @property
    def replies(self) -> Counter[str]:
        """Replies sent by path: "shm" or "socket"."""
        return self._server.replies

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        if is_unix(self.address):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
