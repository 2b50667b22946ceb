"""Constrained requests waiting for their grammar: submit, then poll each step.

```
add_request --submit--> WAITING_FOR_GRAMMAR (no KV blocks)
                          --poll: compiled--> WAITING
                          --poll: error or time limit--> FINISHED_ERROR (the API: 400)
```
Only the engine loop's thread calls this; compilation runs on grammars/' thread pool.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from grammars import CompileStats, GrammarCompiler, GrammarError, GrammarSpec
from scheduling import Request, RequestStatus


class GrammarRequests:
    """The model's grammar compiler (built on first use) and the requests waiting on it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._waiting: dict[str, tuple[Request, Future[Any], float]] = {}
        # Constrained requests accepted since start (/metrics).
        self.num_requests = 0

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use: it reads the whole vocabulary (~0.1 s for 49k tokens)."""
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError("structured output: this model has no tokenizer")
            self._compiler = GrammarCompiler(
                self._tokenizer, self._vocab_size, self._stop_token_ids
            )
        return self._compiler

    @property
    def stats(self) -> CompileStats | None:
        """The compiler's counters, or None before the first constrained request."""
        return None if self._compiler is None else self._compiler.stats

    def submit(self, req: Request, spec: GrammarSpec) -> None:
        """Start compiling `req`'s grammar; `req` must be in WAITING_FOR_GRAMMAR."""
        self._waiting[req.request_id] = (req, self.compiler.submit(spec), time.monotonic())
        self.num_requests += 1

    def wait_compiled(self) -> None:
        """Block until every submitted grammar has compiled or failed (or hit its limit)."""
        for _, future, _ in list(self._waiting.values()):
            # A failure is poll()'s to report, with its request.
            with contextlib.suppress(Exception):
                future.result(timeout=self.compiler.time_limit_s)

    def poll(self) -> list[tuple[Request, str]]:
        """Release the requests whose grammar is ready; return those that failed, with why.

        A ready request becomes WAITING with its compiled grammar attached. Requests that
        ended meanwhile (aborted) are forgotten.
        """
        if not self._waiting:
            return []
        failed = []
        now = time.monotonic()
        for rid, (req, future, since) in list(self._waiting.items()):
            if req.is_finished:
                del self._waiting[rid]
                continue
            if not future.done():
                limit = self.compiler.time_limit_s
                if now - since > limit:
                    del self._waiting[rid]
                    failed.append((req, f"grammar: compiling took longer than {limit:g} s"))
                continue
            del self._waiting[rid]
            error = future.exception()
            if error is None:
                req.grammar = future.result()
                req.status = RequestStatus.WAITING
            elif isinstance(error, GrammarError):
                failed.append((req, str(error)))
            else:
                failed.append((req, f"grammar: {type(error).__name__}: {error}"))
        return failed
