"""Compile worker processes fed by the fair queue, each compile under its own time limit.

```
FairQueue --take--> slot thread i --(kind, text)--> worker process i (grammars/compile_worker)
                         |   waits: answer | its compile's limit | nobody waiting any more
                         |   past the limit or abandoned: kill the process, start another
                         v
             future <- CompiledGrammar.deserialize_json(answer) | GrammarError
```
NOTE: why processes. xgrammar compiles in C++ without a way to stop it; a thread pool keeps
a worker busy for as long as any grammar takes (`[a-z]{1,20000}` is 14 bytes and takes tens
of seconds), so compiles could be neither limited nor cancelled. A process can be killed. The
price is the result's trip through JSON, which grows with the compiled grammar's size
(measured, SmolLM2's 49k vocabulary: a 50 KB grammar adds ~2 ms, a 660 KB one with formats
~130 ms, most of it in xgrammar's serialize_json; a 100 KB choice list 1.5 s + ~5 s; the
request limits in grammars/limits.py keep the latter rare). Smaller grammars
(grammars/schema/formats.py) are the lever: xgrammar 0.2.9 has no other serialisation.
A killed worker is replaced before its slot takes the next job (an import of xgrammar:
about a second).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from grammars.fair_queue import CompileJob, FairQueue
from grammars.spec import GrammarError

log = logging.getLogger("headrace.grammars")

# How often a waiting slot looks at its job's deadline and waiters.
_POLL_S = 0.02
# A worker imports xgrammar (and torch) and reads the vocabulary before its first compile.
_START_TIMEOUT_S = 120.0
# Answers past this size are followed by a malloc_trim (below).
_TRIM_BYTES = 1 << 20
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def release_freed_memory() -> None:
    """Give glibc's freed heap pages back to the system.

    NOTE: a big compile's JSON answer (tens of MiB for a large choice list) is freed once
    deserialized, but glibc raises its mmap threshold after such frees and keeps later ones
    on the heap: measured, a flood of 10 MiB grammars left the daemon ~110 MiB above its
    16 MiB cache budget in one run of three. Trimming after each large answer keeps RSS
    near the budget (tests/reliability/test_grammar_flood_rss.py).
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class WorkerProcess:
    """One compile process and its pipe; started on first use, replaced after a kill."""

    def __init__(self, tokenizer_info_json: str, name: str) -> None:
        self._info_json = tokenizer_info_json
        self.name = name
        self._proc: Any = None
        self._conn: Connection | None = None
        # Processes started (the first one included): > 1 means some were killed.
        self.starts = 0

    def _start(self) -> Connection:
        # NOTE: a plain subprocess, not multiprocessing: its spawn/forkserver children re-run
        # the parent's main script, and fork would copy a process full of threads.
        parent, child = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "grammars.compile_worker", str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        conn = Connection(parent.detach())
        conn.send(self._info_json)
        if not conn.poll(_START_TIMEOUT_S) or conn.recv()[0] != "ready":
            proc.kill()
            raise RuntimeError(f"grammar worker {self.name} did not start")
        self._proc, self._conn = proc, conn
        self.starts += 1
        return conn

    def ensure_started(self) -> None:
        if self._conn is None:
            self._start()

    def run(self, job: CompileJob, limit_s: float, stop: Callable[[], bool]) -> tuple[str, str]:
        """Send `job` and wait: ("ok", json) | ("error", why) | ("timeout", "") | ("left", "").

        "timeout": the compile itself ran past `limit_s`; "left": `stop()` turned true (its
        waiters left, or the pool is closing). Both kill the process.
        """
        conn = self._conn or self._start()
        job.started = time.perf_counter()
        try:
            conn.send((job.spec.kind, job.spec.text))
            while not conn.poll(_POLL_S):
                if stop():
                    self.kill()
                    return "left", ""
                if time.perf_counter() - job.started > limit_s:
                    self.kill()
                    return "timeout", ""
            return conn.recv()
        except (EOFError, OSError):
            code = self._proc.poll() if self._proc is not None else None
            self.kill()
            return "error", f"the grammar compiler crashed (exit code {code})"

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid


class CompilePool:
    """`workers` compile processes serving a FairQueue; results come back on job futures.

    `on_result(job, status, compiled_or_None, seconds)` runs on the slot thread before the
    future is set (the cache stores it there); status is "ok", "error", "timeout" or "left".
    Each compile gets `limit_s` seconds of its own; time in the queue does not count.
    """

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        workers: int,
        limit_s: float,
        on_result: Callable[[CompileJob, str, xgr.CompiledGrammar | None, float], None],
    ) -> None:
        self.info = info
        self.limit_s = limit_s
        # One worker stays free for another client's first grammar (see FairQueue).
        self.queue = FairQueue(per_client=max(1, workers - 1))
        self._on_result = on_result
        self._closed = False
        info_json = info.serialize_json()
        self.workers = [WorkerProcess(info_json, f"headrace-grammar-{i}") for i in range(workers)]
        self._threads = [
            threading.Thread(target=self._slot, args=(w,), name=w.name, daemon=True)
            for w in self.workers
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: CompileJob) -> None:
        if self._closed:
            raise RuntimeError("the grammar compile pool is shut down")
        self.queue.put(job)

    def cancel(self, job: CompileJob) -> bool:
        """One waiter left; with none left the job leaves the queue (True, its future
        cancelled) or its worker stops it (the slot reports "left")."""
        job.waiters -= 1
        if job.abandoned and self.queue.remove(job):
            job.future.cancel()
            return True
        return False

    def shutdown(self) -> None:
        self._closed = True
        for job in self.queue.close():
            job.future.cancel()
        for t in self._threads:
            t.join(5)
        for w in self.workers:
            w.kill()

    def _slot(self, worker: WorkerProcess) -> None:
        while not self._closed:
            # (Re)start the worker while no job waits on it: a start is not compile time.
            try:
                worker.ensure_started()
            except Exception:
                log.exception("grammar worker %s failed to start", worker.name)
            job = self.queue.take()
            if job is None:
                return
            try:
                self._run(worker, job)
            except Exception as e:  # the slot must survive whatever one job does
                log.exception("grammar compile slot failed")
                if not job.future.done():
                    job.future.set_exception(GrammarError(f"grammar: {e}"))
            finally:
                self.queue.done(job)

    def _run(self, worker: WorkerProcess, job: CompileJob) -> None:
        if job.abandoned:
            job.future.cancel()
            return
        status, payload = worker.run(job, self.limit_s, lambda: job.abandoned or self._closed)
        seconds = time.perf_counter() - (job.started or time.perf_counter())
        if status == "ok":
            compiled = xgr.CompiledGrammar.deserialize_json(payload, self.info)
            if len(payload) > _TRIM_BYTES:
                del payload
                release_freed_memory()
            self._on_result(job, status, compiled, seconds)
            job.future.set_result(compiled)
            return
        self._on_result(job, status, None, seconds)
        if status == "left":
            job.future.cancel()
        elif status == "timeout":
            # Said only of the job whose own compile ran this long (queue time is not counted).
            job.future.set_exception(
                GrammarError(f"grammar: compiling took longer than {self.limit_s:g} s")
            )
        else:
            job.future.set_exception(GrammarError(payload))
