"""Response bodies and SSE payloads in the OpenAI shapes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from daemon.engine.outputs import Delta
from daemon.openai.choices import Choice, LogprobEntry, chat_logprobs, completion_logprobs, merged
from daemon.openai.errors import OPENAI_FINISH_REASONS, failure
from daemon.openai.protocol import GenerationRequest, new_id, now
from daemon.openai.protocol import usage as openai_usage
from daemon.openai.token_bytes import TokenBytes


class ResponseBuilder:
    """Turns finished choices or a stream of deltas into OpenAI-shaped JSON."""

    def __init__(self, model_name: str, tokenizer: Any) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer

        self.token_bytes = TokenBytes(tokenizer)

    def decode(self, token_id: int) -> str:
        return self.token_bytes(token_id)[0]

    def logprobs(self, entries: list[LogprobEntry], chat: bool) -> dict[str, Any]:
        if chat:
            return chat_logprobs(entries, self.token_bytes)
        return completion_logprobs(entries, self.decode)

    def full_body(self, req: GenerationRequest, choices: list[Choice], chat: bool) -> dict:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            logprobs = self.logprobs(c.logprobs, chat) if req.logprobs is not None else None
            item: dict[str, Any] = {
                "index": c.index,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
            if chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            out.append(item)
        return {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": req.model or self.model_name,
            "choices": out,
            "usage": self.usage(choices),
        }

    @staticmethod
    def usage(choices: list[Choice]) -> dict[str, Any]:
        # A prompt counts once however many choices (n) it has.
        prompts = {c.prompt_index: c for c in choices}.values()
        return openai_usage(
            sum(c.prompt_tokens for c in prompts),
            sum(c.completion_tokens for c in choices),
            sum(c.cached_tokens for c in prompts),
        )

    async def events(
        self,
        req: GenerationRequest,
        choices: list[Choice],
        firsts: list[Delta],
        chat: bool,
        check: Callable[[Choice], str | None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The SSE payloads of one streamed request, in order.

        `check(choice)` runs on each finished choice before its last chunk: a message means
        the output may not count as a success, and an error event takes that chunk's place.
        """
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "object": kind,
                "created": created,
                "model": req.model or self.model_name,
                "choices": items,
                **extra,
            }

        if chat:
            role = {"role": "assistant", "content": ""}
            yield chunk(
                [
                    {"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}
                    for c in choices
                ]
            )
        async with contextlib.aclosing(merged(choices, firsts)) as deltas:
            async for choice, delta in deltas:
                if delta is not firsts[choices.index(choice)]:
                    choice.add(delta)
                if delta.finished and delta.finish_reason not in OPENAI_FINISH_REASONS:
                    # The request failed (or was ended by the server): an error event, which the
                    # caller follows with [DONE]; the openai client raises on it.
                    error = failure(delta.stop_reason)
                    yield stream_error(error.message, error.status, error.kind)
                    return
                problem = check(choice) if check is not None and delta.finished else None
                if problem is not None:
                    yield stream_error(problem)
                    return
                if not delta.text and not delta.finished and not delta.new_logprobs:
                    continue
                logprobs = None
                if req.logprobs is not None and delta.new_logprobs:
                    entries = [
                        (t, lp[0], lp[1]) for t, lp in zip(delta.new_token_ids, delta.new_logprobs)
                    ]
                    logprobs = self.logprobs(entries, chat)
                item: dict[str, Any] = {
                    "index": choice.index,
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason,
                }
                if chat:
                    item["delta"] = {"content": delta.text} if delta.text else {}
                else:
                    item["text"] = delta.text
                yield chunk([item])
        if req.include_usage:
            yield chunk([], usage=self.usage(choices))


def stream_error(message: str, status: int = 500, kind: str = "server_error") -> dict[str, Any]:
    """The payload of the SSE error event (vLLM's shape): {"error": {message, type, code}}."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
