"""Tokenization, chat templating and detokenization, off the event loop when large.

A 10 MB prompt takes seconds to encode; on the loop that freezes every stream, /health and
the systemd watchdog. Large inputs go to a small thread pool instead. Threads are enough:
the Rust tokenizer releases the GIL while it encodes (measured on the embedded model's
tokenizer: a Python thread kept ~56% of its speed beside a 1 MB encode on a loaded 2-core
machine, so the loop keeps running), and a process pool would copy the prompt twice.
Small inputs stay on the loop: a thread hop costs more than encoding a short prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from daemon.openai.protocol import APIError

T = TypeVar("T")


class Tokenizing:
    """The model's tokenizer behind async calls; `offload_chars` decides loop or thread."""

    def __init__(self, tokenizer: Any, offload_chars: int = 4096, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.offload_chars = offload_chars
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="headrace-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, size: int, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        if size <= self.offload_chars:
            return fn(*args, **kw)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kw))

    def _need(self, what: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{what}: this model has no tokenizer; send token ids", what)
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self._need("prompt")
        ids = await self._run(len(text), tok.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)

    async def prompt_ids(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Completions prompts: text is encoded, token ids pass through. The batch's total
        size decides, so a thousand short prompts do not add up on the loop."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            self._need("prompt")

        def encode_all() -> list[list[int]]:
            return [
                list(self.tokenizer.encode(p)) if isinstance(p, str) else [int(t) for t in p]
                for p in prompts
            ]

        return await self._run(sum(len(p) for p in texts), encode_all)

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat template applied (with the tools it should show), then encoded without
        adding special tokens again."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template", "messages")
        size = sum(len(m.get("content") or "") for m in messages)

        def render() -> list[int]:
            text = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
            return list(tok.encode(text, add_special_tokens=False))

        return await self._run(size, render)

    async def decode(self, ids: list[int]) -> str:
        tok = self._need("tokens")
        # A token decodes to a few characters; the id count stands in for the text size.
        return await self._run(len(ids) * 4, tok.decode, ids)
