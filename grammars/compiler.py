"""Compiles GrammarSpecs with xgrammar on a thread pool, behind a bounded LRU cache.

```
API / Engine.add_request --submit(spec)--> LRU hit?  --yes--> done future
                                             | no
                                             v
                               thread pool: xgrammar compile (GIL released in C++)
                                             |
                          CompiledGrammar (cached) or GrammarError (not cached)
```
The engine polls the future each step; a request waits in WAITING_FOR_GRAMMAR meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from grammars.schema.regex import regex_dot
from grammars.spec import GrammarError, GrammarSpec, clean_compiler_message


@dataclass(slots=True)
class CompileStats:
    """Counters for /metrics; `compile_seconds` is drained by whoever reports it."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    compile_seconds: list[float] = field(default_factory=list)

    def drain_compile_seconds(self) -> list[float]:
        out, self.compile_seconds = self.compile_seconds, []
        return out


class GrammarCompiler:
    """One per model: the tokenizer's vocabulary as xgrammar sees it, and the compile cache.

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's own
    vocabulary: padded rows are never allowed). `stop_token_ids` are the ids that end a
    request; the grammar allows them only where it may end.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
        max_workers: int = 2,
        time_limit_s: float = 30.0,
    ) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        # xgrammar's own cache is off: ours is keyed by canonical text and bounded by count.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="headrace-grammar")
        self.cache_size = cache_size
        # How long a request may wait for its grammar before it fails (the engine checks).
        self.time_limit_s = time_limit_s
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        # Compilations under way: a second request for the same spec shares the future.
        self._in_flight: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def submit(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar; already done on a cache hit."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(compiled)
                return done
            future = self._in_flight.get(spec)
            if future is not None:
                self.stats.hits += 1
                return future
            self.stats.misses += 1
            future = self._in_flight[spec] = self._pool.submit(self._compile_and_cache, spec)
            return future

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Compile now (blocking, through the cache); GrammarError on a bad grammar."""
        return self.submit(spec).result(timeout if timeout is not None else self.time_limit_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_and_cache(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except Exception as e:
            with self._lock:
                self.stats.errors += 1
                self._in_flight.pop(spec, None)
            raise GrammarError(f"{_FIELD[spec.kind]}: {clean_compiler_message(e)}") from None
        with self._lock:
            self.stats.compile_seconds.append(time.perf_counter() - start)
            self._in_flight.pop(spec, None)
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.kind == "json":
            return c.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            return c.compile_json_schema(
                spec.text, any_whitespace=False, separators=(",", ":"), strict_mode=True
            )
        if spec.kind == "regex":
            return c.compile_regex(regex_dot(spec.text))
        if spec.kind == "choice":
            return c.compile_grammar(spec.ebnf())
        if spec.kind == "grammar":
            return c.compile_grammar(spec.text)
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# Which request field the compiler's complaint is about.
_FIELD = {
    "json": "json",
    "json_schema": "schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
