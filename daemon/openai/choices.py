"""Per-choice bookkeeping for one HTTP request: text, logprobs, timings, usage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from daemon.engine.client import DeltaStream
from daemon.engine.outputs import Delta
from scheduling import SpecDecodeStats

# (token id, its logprob, {top token id: logprob})
LogprobEntry = tuple[int, float, dict[int, float]]


@dataclass(slots=True)
class Choice:
    """One completion choice as it accumulates."""

    index: int
    stream: DeltaStream
    # Which prompt of the request it answers (usage counts each prompt once).
    prompt_index: int = 0
    arrival: float = field(default_factory=time.monotonic)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Time between consecutive deltas, for the inter-token latency histogram.
    gaps: list[float] = field(default_factory=list)
    # Drafts verified and accepted for this choice (None when the engine does not speculate).
    spec_stats: SpecDecodeStats | None = None

    def add(self, delta: Delta) -> None:
        now = time.monotonic()
        if delta.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            elif self.last_token_time is not None:
                self.gaps.append(now - self.last_token_time)
            self.last_token_time = now
        self.text += delta.text
        self.token_ids += delta.new_token_ids
        for token_id, lp in zip(delta.new_token_ids, delta.new_logprobs or []):
            self.logprobs.append((token_id, lp[0], lp[1]))
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        self.completion_tokens = delta.num_output_tokens or self.completion_tokens
        self.cached_tokens = delta.num_cached_tokens or self.cached_tokens
        self.spec_stats = delta.spec_stats or self.spec_stats
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival


async def merged(choices: list[Choice], firsts: list[Delta]) -> AsyncIterator[tuple[Choice, Delta]]:
    """Deltas of all choices in arrival order, starting with each one's first delta."""
    # Bounded: a consumer that stalls (a client not reading) stalls the pumps, so pending
    # deltas stay in each request's stream, where the engine bounds them.
    queue: asyncio.Queue[tuple[Choice, Delta | None]] = asyncio.Queue(maxsize=64)

    async def pump(choice: Choice) -> None:
        async for delta in choice.stream:
            await queue.put((choice, delta))
        await queue.put((choice, None))

    for choice, first in zip(choices, firsts):
        yield choice, first
    tasks = [asyncio.create_task(pump(c)) for c in choices if not c.stream.finished]
    remaining = len(tasks)
    try:
        while remaining:
            choice, delta = await queue.get()
            if delta is None:
                remaining -= 1
            else:
                yield choice, delta
    finally:
        for task in tasks:
            task.cancel()


def completion_logprobs(entries: list[LogprobEntry], decode: Any) -> dict[str, Any]:
    """The legacy completions `logprobs` object."""
    tokens, offsets, offset = [], [], 0
    for token_id, _, _ in entries:
        text = decode(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{decode(t): v for t, v in top.items()} for _, _, top in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[LogprobEntry], token_bytes: Any) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}.

    `token_bytes(id) -> (text, raw bytes)`: a token holding part of a UTF-8 character has
    its own bytes, not those of U+FFFD (daemon/openai/token_bytes.py).
    """

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_bytes(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(k, v) for k, v in top.items()]}
            for t, lp, top in entries
        ]
    }
