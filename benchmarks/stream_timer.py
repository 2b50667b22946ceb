"""One streamed completion, timed: TTFT, the gaps between text chunks, E2E, and the usage.

Shared by the load generators (serve_load.py, data_parallel.py) so they time a stream the
same way: the first token is the first chunk with text, ITL gaps are between text chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


@dataclass
class StreamTiming:
    """Seconds from the request's start; token counts from the final usage chunk."""

    ttft: float
    e2e: float
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def timed_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamTiming:
    """POST `body` to /v1/completions as a stream (usage included) and time its chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append(now - last)
                last = now
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return StreamTiming(
        (first or end) - start,
        end - start,
        gaps,
        usage.get("prompt_tokens", 0),
        details.get("cached_tokens") or 0,
        usage.get("completion_tokens", 0),
    )
