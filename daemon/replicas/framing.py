"""Length-prefixed pickle frames over an asyncio stream (one Unix socket per replica).

Why pickle: both ends are our own processes over a socketpair the front door made (no
untrusted peer), the messages are dataclasses holding dataclasses (SamplingParams, Delta,
EngineStats, KV events with bytes hashes), and pickle round-trips them with no schema code.
A frame costs ~10 us each way; benchmarks/data_parallel.py measures the ITL it adds.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!I")
MAX_FRAME = 256 << 20


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; raises asyncio.IncompleteReadError at end of stream."""
    header = await reader.readexactly(_HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"replica frame of {size} bytes exceeds {MAX_FRAME}")
    return pickle.loads(await reader.readexactly(size))


def write_frame(writer: asyncio.StreamWriter, message: Any) -> None:
    """Buffered; the writer's transport sends it as soon as the socket takes it."""
    writer.write(encode(message))
