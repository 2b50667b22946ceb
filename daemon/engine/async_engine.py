"""AsyncEngine: the engine loop as one asyncio task, the forward pass on one runner thread.

```
loop thread:   schedule N | schedule N+1 | process N, stream N | schedule N+2 | process N+1 ...
runner thread:            | execute N ------------------------ | execute N+1 -------------- ...
```
A batch queue of depth 2: while step N runs, step N+1 is already scheduled and queued, so
the runner never waits for Python between steps. Decode requests in N are scheduled for
N+1 with a placeholder token that the runner fills from N's sampled ids. With `overlap`
off the queue depth is 1 (schedule, execute, process, repeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from daemon.engine.client import AdapterInfo, EngineDeadError, EngineStats
from daemon.engine.delta_stream import QueuedDeltaStream
from daemon.engine.engine import Engine
from daemon.engine.lora import load_at_run_time
from daemon.engine.outputs import Delta
from runner.device_queue import PendingOutput
from runner.step_interrupt import StepInterrupted
from scheduling import RunnerOutput, SamplingParams, SchedulerOutput

log = logging.getLogger("headrace.engine")


def runner_executor() -> ThreadPoolExecutor:
    """The one runner thread: every forward (and, in the daemon, the engine's construction)."""
    return ThreadPoolExecutor(1, thread_name_prefix="headrace-runner")


class AsyncEngine:
    """The in-process EngineClient: owns the Engine; only its loop task touches scheduler
    state (one owner).

    Handlers call `add_request` (or `generate`) and iterate the deltas; leaving the
    iteration early (a client that disconnects) aborts the request and frees its blocks at
    the next step.
    """

    def __init__(
        self, engine: Engine, overlap: bool = True, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        if overlap and engine.speculative.enabled:
            # Drafts for step N+1 come from step N's sampled tokens, so N+1 cannot be
            # scheduled while N runs: speculation and the batch queue exclude each other.
            log.warning("speculative decoding is on: batch-queue overlap turned off")
            overlap = False
        self.overlap = overlap
        self.depth = 2 if overlap else 1
        if self.depth == 1:  # one step at a time: the one running may stop for an urgent one
            engine.enable_step_stops()
        # The runner thread; pass the one that built the engine (see daemon/service/server.py).
        self._executor = executor or runner_executor()
        # Waits for CUDA steps' sampled ids (runner/device_queue.py); idle on CPU.
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="headrace-waiter")
        self._streams: dict[str, QueuedDeltaStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Called once per loop iteration (the systemd watchdog pings from here).
        self.on_iteration: Callable[[], None] | None = None
        # When set, an idle loop still wakes this often (so the watchdog keeps pinging).
        self.idle_timeout: float | None = None
        self.num_steps = 0
        self._checked_at_step = 0
        # A stream holding this many undelivered deltas (its client stopped reading) is
        # ended: memory per request stays bounded whatever the client does.
        self.max_pending_deltas = 4096
        # Set once the engine can run no more steps (the loop died, or a tensor-parallel rank
        # was lost: see _die); then told to `on_failure`.
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        # Depth 1: the step now on the runner thread, which an urgent arrival may stop
        # (Engine.interrupt_for); None between steps and with the batch queue.
        self._running: SchedulerOutput | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None and self.failure is None:
            loop = asyncio.get_running_loop()
            driver = self.engine.tp_driver
            if driver is not None:  # a worker that exits wakes an idle loop at once
                driver.on_failure.append(lambda _: loop.call_soon_threadsafe(self._wake.set))
            self._task = loop.create_task(self._run_guarded(), name="engine-loop")

    async def stop(self, wait: bool = True) -> None:
        """Stop the loop task. `wait=False` leaves a forward that is still running to end
        on its own thread (the daemon's stop path must not block on it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        self._waiter.shutdown(wait=wait, cancel_futures=not wait)
        self.engine.grammars.shutdown()  # its worker processes

    @property
    def num_in_flight_requests(self) -> int:
        return len(self._streams)

    def in_flight_ids(self) -> list[str]:
        return list(self._streams)

    def stats(self) -> EngineStats:
        if self.failure is not None:  # scheduler state may be what broke: read none of it
            return EngineStats(failure=self.failure)
        return self.engine.stats()

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, **options: Any
    ) -> QueuedDeltaStream:
        """Queue a request now; iterate the returned stream for its deltas.

        `options` are Engine.add_request's (request_id, priority, slo, cache_salt, grammar,
        lora). Raises ValueError (bad input), LookupError (no such adapter) or QueueFullError
        (come back later) right here; EngineDeadError once the engine cannot serve (`failure`).
        """
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        self.start()
        rid = self.engine.add_request(prompt, params, **options)
        stream = QueuedDeltaStream(rid, self.abort)
        self._streams[rid] = stream
        if self._running is not None and self.engine.interrupt_for(self._running, rid):
            log.debug("request %s: stopping the step in flight for it", rid)
        self._wake.set()
        return stream

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kw: Any
    ) -> AsyncIterator[Delta]:
        """Add a request and yield its deltas until it finishes (aborted if left early)."""
        stream = self.add_request(prompt, params, **kw)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def adapters(self) -> list[AdapterInfo]:
        return self.engine.adapters()

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        loras = self.engine.loras if self.info.lora_runtime_updates else None
        return await load_at_run_time(loras, self.info.name, name, path)

    def unload_adapter(self, name: str) -> None:
        if self.engine.loras is None:
            raise LookupError(f"the LoRA adapter {name!r} does not exist")
        self.engine.loras.remove(name)
        log.info("LoRA adapter %s unloaded", name)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort([request_id])
        self._wake.set()

    def end_all(self, why: str) -> int:
        """Abort every request that has a reader, and hand each reader a last delta
        (finish "abort", stop reason `why`), so none waits for tokens that will not come.
        Returns how many were ended."""
        ids = list(self._streams)
        for rid in ids:
            self._streams.pop(rid).put(Delta.ending(rid, "abort", why))
        if ids:
            self.engine.abort(ids)
            self._wake.set()
        return len(ids)

    # -- the loop ------------------------------------------------------------------------

    async def _run_guarded(self) -> None:
        """The loop; if it raises, every reader gets an error delta instead of waiting
        forever, new requests are refused (EngineDeadError) and `on_failure` is told (the
        daemon exits non-zero for systemd to restart it; a replica exits for its front
        door to restart it). A failed step does not get here: `fail_step` ends its
        requests and the loop goes on."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("engine loop died")
            self._die(f"engine loop died: {type(e).__name__}: {e}", deque())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        in_flight: deque[tuple[SchedulerOutput, asyncio.Future[RunnerOutput]]] = deque()
        while True:
            if self.on_iteration is not None:
                self.on_iteration()
            if self.engine.fatal is not None:
                self._die(self.engine.fatal, in_flight)
                return
            if len(in_flight) < self.depth and self.engine.has_unfinished_requests():
                so = self.engine.schedule()
                if not so.is_empty:
                    if self.depth == 1:
                        self.engine.arm_interrupt()
                        self._running = so
                    in_flight.append(
                        (so, loop.run_in_executor(self._executor, self._launcher(), so))
                    )
                    if len(in_flight) < self.depth:
                        continue  # queue the next step before waiting on this one
                else:
                    # Nothing runnable (all waiting or deferred): send out rejections now; the
                    # runner drops finished state on its own thread, after any step in flight.
                    self._dispatch(self.engine.process(so, RunnerOutput()))
                    if self.engine.needs_runner():
                        # An empty step copies in fetched KV (nothing else runs); awaited,
                        # so such steps do not pile up on the runner thread's queue.
                        await loop.run_in_executor(self._executor, self.engine.execute, so)
                    elif so.finished_req_ids or so.preempted_req_ids:
                        self._executor.submit(self.engine.execute, so)
            if in_flight:
                so, future = in_flight.popleft()
                try:
                    ro = await future
                    if isinstance(ro, PendingOutput):
                        # CUDA: the ids are still copying to pinned memory; wait on that
                        # step's event off the loop, while the runner launches the next.
                        ro = await loop.run_in_executor(self._waiter, ro.result)
                except StepInterrupted:
                    # An urgent arrival stopped it between layers: it is taken back and
                    # its requests run again from where they were, after the urgent one.
                    self._running = None
                    self.engine.undo_step(so)
                    continue
                except Exception as e:
                    self._running = None
                    self._dispatch(self.engine.fail_step(so, e))
                else:
                    self._running = None
                    self._dispatch(self.engine.process(so, ro))
                self.num_steps += 1
                continue
            self._wake.clear()
            if not self.engine.has_unfinished_requests():
                # Idle: the ids that finished in the last step would otherwise wait for the
                # next one. Scheduler state stays on this thread, runner state on its own.
                so = self.engine.schedule()
                if so.finished_req_ids or so.preempted_req_ids:
                    await loop.run_in_executor(self._executor, self.engine.execute, so)
                if self.num_steps != self._checked_at_step:
                    self._checked_at_step = self.num_steps
                    self.engine.check_idle()
            if self.engine.has_unfinished_requests():
                # Requests exist but none can run now: poll gently instead of spinning.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.01)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.idle_timeout)

    def _die(self, why: str, in_flight: deque) -> None:  # type: ignore[type-arg]
        """End every request with an error (the steps in flight already failed or will not
        be read), refuse new ones (EngineDeadError) and tell the daemon (`on_failure`: it
        exits non-zero for its supervisor to restart it; a replica exits for its front door
        to restart it); nothing more is scheduled."""
        self.failure = why
        log.error("engine cannot serve: %s; ending %d requests", why, len(self._streams))
        for _, future in in_flight:
            future.cancel()
        ids = list(self._streams)
        for rid in ids:
            self._streams.pop(rid).put(Delta.ending(rid, "error", why))
        with contextlib.suppress(Exception):  # the scheduler may be what broke
            self.engine.abort(ids)
        if self.on_failure is not None:
            self.on_failure(why)

    def _launcher(self) -> Callable[[SchedulerOutput], RunnerOutput | PendingOutput]:
        """With device-side ids (CUDA) a step returns before its ids reach the host; CPU
        steps run to the end."""
        on_device = self.engine.runner.device_tokens is not None
        return self.engine.launch if on_device else self.engine.execute

    def _dispatch(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.request_id]
            elif stream.pending() >= self.max_pending_deltas:
                self._overflow(stream)
                continue
            stream.put(delta)

    def _overflow(self, stream: QueuedDeltaStream) -> None:
        rid = stream.request_id
        log.warning("request %s: %d deltas not taken; ending it", rid, stream.pending())
        self._streams.pop(rid, None)
        self.engine.abort([rid])
        why = f"the client did not read its stream ({self.max_pending_deltas} chunks pending)"
        stream.put(Delta.ending(rid, "abort", why))
