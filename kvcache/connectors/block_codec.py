"""One stored KV block as bytes: a header naming what it is, a checksum, the payload.

```
| "HRKVBLK1" | u32 n | layout key | u32 n | block key | u64 payload len | u32 crc32 | payload |
```
`decode` returns None for anything that is not exactly the block asked for in this layout,
whole and intact (a truncated file, a flipped byte, another model's block): the caller
recomputes instead of reading a wrong KV.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"HRKVBLK1"
_LEN = struct.Struct("<I")
_TAIL = struct.Struct("<QI")


def encode(layout_key: str, block_key: str, payload: bytes | memoryview) -> bytes:
    """Header + payload of one block (the payload is one block's K and V, all layers)."""
    layout, key = layout_key.encode(), block_key.encode()
    return b"".join(
        (
            MAGIC,
            _LEN.pack(len(layout)),
            layout,
            _LEN.pack(len(key)),
            key,
            _TAIL.pack(len(payload), zlib.crc32(payload)),
            payload,
        )
    )


def decode(
    data: bytes | bytearray | memoryview, layout_key: str, block_key: str, payload_len: int
) -> memoryview | None:
    """The payload of `data` if it is block `block_key` of `layout_key`, intact; else None."""
    view = memoryview(data)
    layout, key = layout_key.encode(), block_key.encode()
    head = len(MAGIC) + _LEN.size + len(layout) + _LEN.size + len(key) + _TAIL.size
    if len(view) != head + payload_len:
        return None  # truncated, padded, or a different shape
    expect = MAGIC + _LEN.pack(len(layout)) + layout + _LEN.pack(len(key)) + key
    if view[: len(expect)] != expect:
        return None  # not ours, another layout, or another block under this name
    size, crc = _TAIL.unpack_from(view, len(expect))
    payload = view[head:]
    if size != payload_len or zlib.crc32(payload) != crc:
        return None
    return payload


def encoded_size(layout_key: str, block_key: str, payload_len: int) -> int:
    return (
        len(MAGIC) + 2 * _LEN.size + len(layout_key.encode()) + len(block_key.encode())
        + _TAIL.size + payload_len
    )  # fmt: skip
