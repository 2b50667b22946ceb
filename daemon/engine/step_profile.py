"""`headrace serve --profile-steps LOG`: one JSON line per engine step, for `headrace bench
profile` to summarise.

Each line holds the step's shape (prefill/decode tokens, sequences) and where its wall time
went: schedule (loop thread), forward (the model and LM head, timed by the runner), sample,
the rest of the runner's execute (input and metadata preparation: Python), and process
(updating requests, detokenising: Python). `overhead_share` is the part that is neither
forward nor sample, over the whole step; it is the gap a faster kernel cannot close.

`scheduled_at` / `done_at` (time.monotonic, the clock of a request's `arrival_time`) and
`first_tokens` (the requests whose first token this step samples: id, priority, arrival)
let `daemon/bench/first_token.py` lay out every step between a request's arrival and its
first token: how many there were, what each carried, how long each took.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import orjson

from daemon.engine.engine import Engine
from scheduling import Request, RunnerOutput, SchedulerOutput


class StepProfiler:
    """Times the engine's schedule / execute / process calls and writes one line per step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] = self.path.open("ab")
        # id(step) -> its schedule time and the `timing` fields of its line.
        self._scheduled: dict[int, tuple[float, dict[str, Any]]] = {}
        self.steps = 0
        # A KV connector's runner side: seconds spent copying loads in, as of the last line.
        self._worker: object | None = None
        self._commit_s = 0.0

    def attach(self, engine: Engine) -> None:
        """Wrap the engine's own calls (instance attributes only: nothing global changes)."""
        scheduler, process = engine.scheduler, engine.process
        schedule = scheduler.schedule

        def timed_schedule() -> SchedulerOutput:
            at, start = time.monotonic(), time.perf_counter()
            so = schedule()
            if not so.is_empty:
                # The governor's count is the one `launch` applies to this step.
                threads = engine.governor.current if engine.governor else torch_threads()
                timing = {
                    "scheduled_at": at,
                    "threads": threads,
                    "first_tokens": first_tokens(so, scheduler.requests),
                    # A policy's cap on this step's tokens (priority's `step_cap`), if any.
                    "policy_cap": getattr(scheduler.policy, "step_cap", None),
                }
                self._scheduled[id(so)] = (time.perf_counter() - start, timing)
            return so

        def timed_process(so: SchedulerOutput, ro: RunnerOutput) -> Any:
            start = time.perf_counter()
            out = process(so, ro)
            if not so.is_empty:
                schedule_s, timing = self._scheduled.pop(id(so), (0.0, {}))
                timing["done_at"] = time.monotonic()
                self.record(so, ro, schedule_s, time.perf_counter() - start, timing)
            return out

        self._worker = engine.kv_connector.worker if engine.kv_connector else None
        engine.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        engine.process = timed_process  # type: ignore[method-assign]

    def record(
        self,
        so: SchedulerOutput,
        ro: RunnerOutput,
        schedule_s: float,
        process_s: float,
        timing: dict[str, Any] | None = None,
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
            **(timing or {}),
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


def torch_threads() -> int:
    import torch  # the engine has loaded it already

    return torch.get_num_threads()


def first_tokens(so: SchedulerOutput, requests: dict[str, Request]) -> list[list[Any]]:
    """[id, priority, arrival_time] of the requests whose first output token `so` samples
    (a recompute after preemption keeps its tokens, so it never counts)."""
    out = []
    for rid in so.sampling_req_ids:
        req = requests.get(rid)
        # build() has counted this step's placeholder: one, and no token yet, is the first.
        if req is not None and not req.num_output_tokens and req.num_output_placeholders == 1:
            out.append([rid, req.priority, req.arrival_time])
    return out
