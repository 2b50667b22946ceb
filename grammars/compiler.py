"""Compiles GrammarSpecs in worker processes, behind an LRU cache bounded in bytes.

```
API / Engine.add_request --submit(spec, client)--> cache hit? --yes--> done future
                                                     | no (or same spec in flight: shared)
                                                     v
                          FairQueue (per client) -> worker process: xgrammar compile
                                                     |   (own time limit; killed past it)
                                 CompiledGrammar (cached) or GrammarError (not cached)
```
The cache counts each grammar's own memory figure (`CompiledGrammar.memory_size_bytes`:
its token-mask cache dominates) against `cache_bytes`; least recently used entries go first,
and a grammar larger than the whole budget is served but not kept. Grammars that requests
still use stay alive with them (bounded by the request size limits, grammars/limits.py).
The engine polls the future each step; a request waits in WAITING_FOR_GRAMMAR meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from grammars.compile_pool import CompilePool
from grammars.fair_queue import CompileJob
from grammars.spec import GrammarSpec


@dataclass(slots=True)
class CompileStats:
    """Counters for /metrics; `compile_seconds` is drained by whoever reports it."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    # Compiles stopped at their time limit, and those stopped because nobody waited.
    timeouts: int = 0
    abandoned: int = 0
    # Bytes the cache holds now (xgrammar's own figure per grammar).
    cache_bytes: int = 0
    compile_seconds: list[float] = field(default_factory=list)

    def drain_compile_seconds(self) -> list[float]:
        out, self.compile_seconds = self.compile_seconds, []
        return out


class GrammarCompiler:
    """One per model: the tokenizer's vocabulary as xgrammar sees it, and the compile cache.

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's own
    vocabulary: padded rows are never allowed). `stop_token_ids` are the ids that end a
    request; the grammar allows them only where it may end. `time_limit_s` bounds each
    compile from the moment a worker starts it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_bytes: int = 256 << 20,
        max_workers: int = 2,
        time_limit_s: float = 30.0,
    ) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self.time_limit_s = time_limit_s
        self._cache: OrderedDict[GrammarSpec, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        # Compilations queued or under way: a second request for the same spec shares it.
        self._in_flight: dict[GrammarSpec, CompileJob] = {}
        self._jobs: dict[int, CompileJob] = {}  # id(future) -> job, for release()
        self._lock = threading.Lock()
        self.stats = CompileStats()
        self.pool = CompilePool(self.info, max_workers, time_limit_s, self._finished)

    def submit(self, spec: GrammarSpec, client: str = "") -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar; already done on a cache hit.

        `client` (an API key, a peer address) picks the fair queue the compile waits in.
        Call `release(future)` if the result is no longer wanted.
        """
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(hit[0])
                return done
            job = self._in_flight.get(spec)
            if job is not None and not job.abandoned:
                job.waiters += 1
                self.stats.hits += 1
                return job.future
            self.stats.misses += 1
            job = self._in_flight[spec] = CompileJob(spec, client)
            self._jobs[id(job.future)] = job
        self.pool.submit(job)
        return job.future

    def release(self, future: Future[Any]) -> None:
        """One waiter of `future` left: a compile nobody waits for is dropped or stopped."""
        with self._lock:
            job = self._jobs.get(id(future))
            if job is None or future.done():
                return
        if self.pool.cancel(job):  # it never started: nothing will call _finished
            with self._lock:
                self._jobs.pop(id(job.future), None)
                if self._in_flight.get(job.spec) is job:
                    del self._in_flight[job.spec]
                self.stats.abandoned += 1

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Compile now (blocking, through the cache); GrammarError on a bad grammar."""
        return self.submit(spec).result(timeout)

    def shutdown(self) -> None:
        self.pool.shutdown()

    def cached_bytes(self) -> int:
        with self._lock:
            return self.stats.cache_bytes

    def _finished(
        self, job: CompileJob, status: str, compiled: xgr.CompiledGrammar | None, seconds: float
    ) -> None:
        """On a slot thread, before the job's future is set."""
        with self._lock:
            self._jobs.pop(id(job.future), None)
            if self._in_flight.get(job.spec) is job:
                del self._in_flight[job.spec]
            if status == "ok":
                assert compiled is not None
                self.stats.compile_seconds.append(seconds)
                self._store(job.spec, compiled)
            elif status == "timeout":
                self.stats.timeouts += 1
            elif status == "left":
                self.stats.abandoned += 1
            else:
                self.stats.errors += 1

    def _store(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.cache_bytes:
            return
        self._cache[spec] = (compiled, size)
        self.stats.cache_bytes += size
        while self.stats.cache_bytes > self.cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self.stats.cache_bytes -= evicted
