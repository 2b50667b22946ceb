"""Constrained requests waiting for their grammar: submit, then poll each step.

```
add_request --submit--> WAITING_FOR_GRAMMAR (no KV blocks)
                          --poll: compiled--> WAITING
                          --poll: too large, invalid, or its own compile past the
                                  limit--> FINISHED_ERROR (the API: 400)
abort --forget--> the compile is dropped from its queue, or stopped, if nobody else waits
```
Only the engine loop's thread calls this; compiles run in grammars/' worker processes, queued
per client (time in the queue never counts against a request's compile limit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from grammars import CompileStats, GrammarCompiler, GrammarError, GrammarSpec
from grammars.limits import GrammarLimits, check_size
from scheduling import Request, RequestStatus


class GrammarRequests:
    """The model's grammar compiler (built on first use) and the requests waiting on it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        limits: GrammarLimits | None = None,
        cache_bytes: int = 256 << 20,
        time_limit_s: float = 30.0,
        workers: int = 2,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.limits = limits or GrammarLimits()
        self._cache_bytes, self._time_limit_s, self._workers = cache_bytes, time_limit_s, workers
        self._compiler: GrammarCompiler | None = None
        self._waiting: dict[str, tuple[Request, Future[Any]]] = {}
        # Refused before compiling (too large): reported by the next poll().
        self._refused: list[tuple[Request, str]] = []
        # Constrained requests accepted since start (/metrics).
        self.num_requests = 0

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use: it reads the whole vocabulary (~0.1 s for 49k tokens)."""
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError("structured output: this model has no tokenizer")
            self._compiler = GrammarCompiler(
                self._tokenizer,
                self._vocab_size,
                self._stop_token_ids,
                self._cache_bytes,
                self._workers,
                self._time_limit_s,
            )
        return self._compiler

    @property
    def stats(self) -> CompileStats | None:
        """The compiler's counters, or None before the first constrained request."""
        return None if self._compiler is None else self._compiler.stats

    def submit(self, req: Request, spec: GrammarSpec, client: str = "") -> None:
        """Start compiling `req`'s grammar (`req` in WAITING_FOR_GRAMMAR), queued as
        `client`'s; one over the size limits fails at the next poll, before any compile."""
        self.num_requests += 1
        try:
            check_size(spec, self.limits)
        except GrammarError as e:
            self._refused.append((req, str(e)))
            return
        self._waiting[req.request_id] = (req, self.compiler.submit(spec, client))

    def forget(self, request_ids: Sequence[str]) -> None:
        """These requests ended (aborted): their compiles may stop if nobody else waits."""
        for rid in request_ids:
            entry = self._waiting.pop(rid, None)
            if entry is not None and self._compiler is not None:
                self._compiler.release(entry[1])

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()

    def wait_compiled(self) -> None:
        """Block until every submitted grammar has compiled or failed (each compile is
        bounded by its limit)."""
        for _, future in list(self._waiting.values()):
            # A failure is poll()'s to report, with its request.
            with contextlib.suppress(Exception):
                future.result()

    def poll(self) -> list[tuple[Request, str]]:
        """Release the requests whose grammar is ready; return those that failed, with why.

        A ready request becomes WAITING with its compiled grammar attached. Requests that
        ended meanwhile (aborted) are forgotten.
        """
        failed, self._refused = self._refused, []
        failed = [(req, why) for req, why in failed if not req.is_finished]
        for rid, (req, future) in list(self._waiting.items()):
            if req.is_finished:
                self.forget([rid])
                continue
            if not future.done():
                continue
            del self._waiting[rid]
            if future.cancelled():
                failed.append((req, "grammar: the compiler was shut down"))
                continue
            error = future.exception()
            if error is None:
                req.grammar = future.result()
                req.status = RequestStatus.WAITING
            elif isinstance(error, GrammarError):
                failed.append((req, str(error)))
            else:
                failed.append((req, f"grammar: {type(error).__name__}: {error}"))
        return failed
