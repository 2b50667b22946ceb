"""Rank 0's side of tensor parallelism: starts the workers, feeds them, watches them.

```
engine process (rank 0)                        worker r (1..N-1, spawned)
  scheduler, sampler, ModelRunner                ShardRunner (runner/parallel/worker.py)
  ModelRunner._forward:
    driver.publish(StepInput) --shm ring-->      ring.read -> StepInput
    model(...) on its shard   <--all-reduce-->   model(...) on its shard
    compute_logits            <--gather------    compute_logits
```
A worker that exits is seen at once (its process sentinel); one that hangs is seen by the
next collective's timeout. Either way `failure` says why, `on_failure` callbacks run, and
every later `publish` raises WorkerFailure: the group cannot be trusted again.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from runner.attention_backends import BACKENDS
from runner.model_source import ModelSource
from runner.parallel.group import TensorParallel
from runner.parallel.ring import ShmRing
from runner.parallel.sharding import cores_of_rank
from runner.parallel.shm_collectives import ShmCollectives
from runner.parallel.step import CacheSpec, StepInput, stop_message
from runner.parallel.worker import WorkerSpec, worker_main
from runner.platform import Platform

log = logging.getLogger("headrace.tp")


# Each rank's shared slot for one collective: [rows, hidden] activations up to this size go
# through shared memory, larger ones (long prefill chunks of wide models) through gloo.
SHM_SLOT_BYTES = 8 << 20


class WorkerFailure(RuntimeError):
    """The tensor-parallel group lost a rank; nothing more runs on it."""


def ring_slot_bytes(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """The largest step message (see runner/parallel/step.py): tokens, tables, rows."""
    return 4 * (8 + 3 * max_tokens + 3 * max_seqs + max_seqs * max_blocks_per_seq)


class TensorParallelDriver:
    """Rank 0's handle on the group: `tp` for its own model, `publish` for each step."""

    def __init__(
        self,
        world_size: int,
        source: ModelSource,
        platform: Platform,
        lookup: Callable[[str], type] | None = None,
        timeout_s: float = 30.0,
        slot_bytes: int = 1 << 20,
        pin: bool = True,
        threads: int | None = None,
    ) -> None:
        """Spawns the workers and joins the group (returns once every rank has joined).
        Each rank runs `threads` torch threads (default: one per core of its share)."""
        if world_size < 2:
            raise ValueError(f"tensor_parallel_size: {world_size} needs no driver (>= 2)")
        self.world_size, self.timeout_s = world_size, timeout_s
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self._closing = False
        backend = "nccl" if platform.device.type == "cuda" else "gloo"
        self.ring = ShmRing.create(world_size - 1, slot_bytes)
        self.shm = ShmCollectives.create(world_size, SHM_SLOT_BYTES) if backend == "gloo" else None
        if self.shm is not None:
            self.shm.alive = self.alive
        self._store = tempfile.mkdtemp(prefix="headrace-tp-")
        init_method = f"file://{self._store}/rendezvous"
        cores = sorted(os.sched_getaffinity(0))
        self._old_affinity = set(cores)
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(1, world_size):
            mine = tuple(cores_of_rank(cores, rank, world_size))
            spec = WorkerSpec(rank, world_size, init_method, backend, timeout_s, mine,
                              threads or len(mine), source, platform, lookup, self.ring.name,
                              self.ring.slots, self.ring.slot_bytes, os.getpid(),
                              self.shm.name if self.shm else None, SHM_SLOT_BYTES)  # fmt: skip
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"headrace-tp{rank}")
            proc.daemon = True
            proc.start()
            self.procs.append(proc)
        # NOTE: affinity is per thread on Linux: this pins the thread that will run the
        # forward (the runner thread builds the engine), and the OpenMP team it starts.
        self.cores = cores_of_rank(cores, 0, world_size)
        if pin:
            os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(threads or len(self.cores))
        threading.Thread(target=self._watch, name="headrace-tp-watch", daemon=True).start()
        try:
            self.tp = TensorParallel.init(
                0, world_size, init_method, backend, timeout_s, self.shm, self.alive
            )
        except Exception as e:
            self.close()
            raise WorkerFailure(f"tensor-parallel group did not form: {e}") from e
        log.info("tensor parallel: %d ranks over %s, rank 0 on cores %s", world_size,
                 backend, self.cores)  # fmt: skip

    def _watch(self) -> None:
        """Waits on the workers' sentinels; the first to exit fails the group."""
        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels))
        if self._closing:
            return
        proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1)
        self.fail(f"tensor-parallel worker {proc.name} exited with code {proc.exitcode}")

    def fail(self, why: str) -> None:
        """Mark the group broken (first reason wins) and tell whoever listens."""
        if self.failure is not None or self._closing:
            return
        self.failure = why
        log.error("%s", why)
        for callback in self.on_failure:
            callback(why)

    def alive(self) -> bool:
        return self.failure is None and all(p.is_alive() for p in self.procs)

    def send_cache(self, spec: CacheSpec) -> None:
        """Once, after rank 0 sized its KV cache: the workers allocate theirs."""
        self._write(spec.encode(BACKENDS))

    def publish(self, step: StepInput) -> None:
        """Hand the workers this step's input; rank 0 then runs the same forward."""
        self._write(step.encode())

    def _write(self, words) -> None:  # type: ignore[no-untyped-def]
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        try:
            self.ring.write(words, self.timeout_s, self.alive)
        except TimeoutError as e:
            self.fail(f"tensor-parallel workers stopped reading steps: {e}")
            raise WorkerFailure(self.failure or str(e)) from e

    def close(self) -> None:
        """Stop the workers (a STOP message, then terminate stragglers), leave the group."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None:
            with contextlib.suppress(TimeoutError, ValueError):
                self.ring.write(stop_message(), 2.0, self.alive)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        if hasattr(self, "tp"):
            self.tp.close()
        self.ring.close(unlink=True)
        if self.shm is not None:
            self.shm.close(unlink=True)
        shutil.rmtree(self._store, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, self._old_affinity)
