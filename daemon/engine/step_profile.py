"""`headrace serve --profile-steps LOG`: one JSON line per engine step, for `headrace bench
profile` to summarise.

Each line holds the step's shape (prefill/decode tokens, sequences) and where its wall time
went: schedule (loop thread), forward (the model and LM head, timed by the runner), sample,
the rest of the runner's execute (input and metadata preparation: Python), and process
(updating requests, detokenising: Python). `overhead_share` is the part that is neither
forward nor sample, over the whole step; it is the gap a faster kernel cannot close.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import orjson

from daemon.engine.engine import Engine
from scheduling import RunnerOutput, SchedulerOutput


class StepProfiler:
    """Times the engine's schedule / execute / process calls and writes one line per step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] = self.path.open("ab")
        self._schedule_s: dict[int, float] = {}
        self.steps = 0
        # A KV connector's runner side: seconds spent copying loads in, as of the last line.
        self._worker: object | None = None
        self._commit_s = 0.0

    def attach(self, engine: Engine) -> None:
        """Wrap the engine's own calls (instance attributes only: nothing global changes)."""
        schedule, process = engine.scheduler.schedule, engine.process

        def timed_schedule() -> SchedulerOutput:
            start = time.perf_counter()
            so = schedule()
            if not so.is_empty:
                self._schedule_s[id(so)] = time.perf_counter() - start
            return so

        def timed_process(so: SchedulerOutput, ro: RunnerOutput) -> Any:
            start = time.perf_counter()
            out = process(so, ro)
            if not so.is_empty:
                self.record(so, ro, self._schedule_s.pop(id(so), 0.0), time.perf_counter() - start)
            return out

        self._worker = engine.kv_connector.worker if engine.kv_connector else None
        engine.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        engine.process = timed_process  # type: ignore[method-assign]

    def record(
        self, so: SchedulerOutput, ro: RunnerOutput, schedule_s: float, process_s: float
    ) -> None:
        shape = so.shape
        forward_s = getattr(ro, "forward_s", 0.0)
        sample_s = getattr(ro, "sample_s", 0.0)
        execute_s = ro.duration_s
        total = schedule_s + execute_s + process_s
        line = {
            "t": time.time(),
            "prefill_tokens": shape.num_prefill_tokens,
            "decode_tokens": shape.num_decode_tokens,
            "seqs": shape.num_seqs,
            "context_tokens": shape.num_context_tokens,
            "schedule_ms": schedule_s * 1e3,
            "execute_ms": execute_s * 1e3,
            "forward_ms": forward_s * 1e3,
            "sample_ms": sample_s * 1e3,
            "prepare_ms": max(0.0, execute_s - forward_s - sample_s) * 1e3,
            "process_ms": process_s * 1e3,
            # Loaded KV copied into the paged cache since the last line (a KV connector's).
            "kv_commit_ms": self._commit_ms(),
            "step_ms": total * 1e3,
            "overhead_share": (total - forward_s - sample_s) / total if total > 0 else 0.0,
        }
        self._file.write(orjson.dumps(line) + b"\n")
        self.steps += 1
        if self.steps % 64 == 0:
            self._file.flush()

    def _commit_ms(self) -> float:
        total = getattr(self._worker, "commit_seconds", 0.0)
        delta, self._commit_s = total - self._commit_s, total
        return delta * 1e3

    def close(self) -> None:
        self._file.close()
