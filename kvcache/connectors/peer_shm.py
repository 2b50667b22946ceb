"""Peer replies through shared memory, for a producer and consumer on one host.

```
producer: memfd_create -> writev(the encoded blocks, back to back) -> seal it (no shrink,
          grow or write) -> sendmsg("HRKVSHM1" | u32 n, SCM_RIGHTS [fd]) | n x u64 len
          -> close its fd (the consumer's copy keeps the segment alive)
consumer: recvmsg -> exactly one fd, sealed, as long as the lengths say -> mmap it private
          (no copy until written) -> close the fd; blocks are decoded in place
```
The seals are what make a mapping safe to read: a segment that could shrink raises SIGBUS
on a read past its new end, one that could be written could change after its checksum was
checked. A consumer takes no segment without them. The mapping lives as long as views of
it do: the worker drops each block's view once it is in the paged cache.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import socket
import stat
import struct
from collections.abc import Sequence

try:
    import fcntl
except ImportError:  # not POSIX: no shared memory, every reply is a byte stream
    fcntl = None  # type: ignore[assignment]

SHM_MAGIC = b"HRKVSHM1"
_COUNT = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Buffers one writev passes (Linux's IOV_MAX is 1024).
_IOV_CHUNK = 512
# Room for a few fds in one message: a peer sending more gets them closed, not leaked.
_MAX_FDS = 4


class ShmError(Exception):
    """A shared-memory reply that cannot be used: no fd, unsealed, short, or unmappable."""


def available() -> bool:
    """Whether this platform has sealable memfds (Linux)."""
    return hasattr(os, "memfd_create") and fcntl is not None and hasattr(fcntl, "F_ADD_SEALS")


def _seals() -> int:
    assert fcntl is not None
    return fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def write_segment(blocks: Sequence[bytes]) -> int:
    """A sealed memfd holding `blocks` back to back; the caller owns (and closes) the fd."""
    assert fcntl is not None
    fd = os.memfd_create("headrace-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        for i in range(0, len(blocks), _IOV_CHUNK):
            _write_all(fd, blocks[i : i + _IOV_CHUNK])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals() | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, bufs: Sequence[bytes]) -> None:
    # NOTE: writev, not a copy into a mapping: the syscall releases the GIL, which the
    # producer's engine threads want, and a write-sealed memfd may have no shared mapping.
    n = os.writev(fd, bufs)
    for buf in bufs:
        if n >= len(buf):
            n -= len(buf)
            continue
        view = memoryview(buf)[n:]
        n = 0
        while view:
            view = view[os.write(fd, view) :]


def send_segment(sock: socket.socket, fd: int, lengths: Sequence[int]) -> None:
    """The reply header with `fd` attached, then the block lengths."""
    head = SHM_MAGIC + _COUNT.pack(len(lengths))
    sent = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    sock.sendall(head[sent:] + b"".join(_U64.pack(n) for n in lengths))


def recv_head(sock: socket.socket, n: int) -> tuple[bytes, list[int]]:
    """Up to `n` bytes and any fds sent with them (close-on-exec: no child inherits one)."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(
        n, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def map_segment(fds: Sequence[int], total: int) -> memoryview:
    """A private, read-write view of the segment `fds` carries (which are closed here).

    Raises ShmError unless there is exactly one fd, a regular file of `total` bytes,
    sealed against shrinking, growing and writing."""
    try:
        if len(fds) != 1:
            raise ShmError(f"a shared-memory reply carries {len(fds)} fds, want 1")
        if not available():
            raise ShmError("no sealable memfds here")
        assert fcntl is not None
        fd = fds[0]
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise ShmError(f"cannot inspect the segment: {e}") from None
        if not stat.S_ISREG(st.st_mode) or (seals & _seals()) != _seals():
            raise ShmError("the segment is not a sealed memfd")
        if st.st_size != total or total == 0:
            raise ShmError(f"the segment has {st.st_size} bytes, the lengths say {total}")
        try:
            # NOTE: private and writable: torch.frombuffer wants writable memory, and a
            # private mapping copies a page only if written (the worker only reads).
            segment = mmap.mmap(
                fd, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except (OSError, ValueError) as e:
            raise ShmError(f"cannot map the segment: {e}") from None
        return memoryview(segment)
    finally:
        close_fds(fds)
