"""A tensor-parallel worker process (ranks 1..N-1): its shard, its KV cache, one loop.

```
spawn -> pin to its cores -> join the group -> load its shard -> CacheSpec from the ring
loop:  StepInput from the ring -> the same forward as rank 0 -> [LM head: logits to rank 0]
```
It keeps no request state: each step carries the block tables. Any error ends the process
(exit 1): the other ranks' next collective then fails, where a worker that carried on would
leave them waiting for a collective it skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runner import kv_format
from runner.attention_backends import BACKENDS, select_attention_backend
from runner.device_queue import to_device
from runner.heap import trim_heap
from runner.model_source import ModelSource
from runner.parallel.group import TensorParallel
from runner.parallel.ring import ShmRing
from runner.parallel.shm_collectives import ShmCollectives
from runner.parallel.step import STOP, CacheSpec, StepInput, message_kind
from runner.platform import Platform

log = logging.getLogger("headrace.tp")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs, pickled once at spawn."""

    rank: int
    world_size: int
    init_method: str
    backend: str
    timeout_s: float
    cores: tuple[int, ...]
    threads: int
    source: ModelSource
    platform: Platform
    lookup: Callable[[str], type] | None
    ring_name: str
    ring_slots: int
    ring_slot_bytes: int
    parent_pid: int
    shm_name: str | None = None  # the shared collectives' segment (CPU ranks), else gloo/NCCL
    shm_slot_bytes: int = 0


class ShardRunner:
    """One rank's forward: metadata from the step's tables, the model on its shard."""

    def __init__(self, model: Any, cache: CacheSpec, device: torch.device, dtype: torch.dtype):
        local = model.local_config
        self.model, self.device, self.block_size = model, device, cache.block_size
        self.kv_caches = kv_format.allocate(
            local.num_hidden_layers, cache.num_blocks, cache.block_size,
            local.num_key_value_heads, local.head_dim,
            torch.int8 if cache.kv_int8 else dtype, device,
        )  # fmt: skip
        self.backend = select_attention_backend(device, local.num_key_value_heads, cache.backend)
        model.set_attention_backend(self.backend)
        if cache.deterministic:
            from runner.batch_invariance import make_attention_batch_invariant

            make_attention_batch_invariant(self.backend)

    @torch.inference_mode()
    def run(self, step: StepInput) -> None:
        meta = self.backend.build_metadata(
            step.num_computed, step.num_new, step.block_tables, self.block_size, self.device
        )
        ids = to_device(step.input_ids, self.device)
        positions = to_device(step.positions, self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if step.sample_rows:
            self.model.compute_logits(hidden[to_device(step.sample_rows, self.device)])


def worker_main(spec: WorkerSpec) -> None:
    """The worker process's entry point (multiprocessing spawn)."""
    logging.basicConfig(level=logging.INFO, format=f"tp{spec.rank} %(levelname)s %(message)s")
    try:
        _serve(spec)
    except Exception:
        log.exception("tensor-parallel worker %d failed", spec.rank)
        os._exit(1)
    os._exit(0)  # no interpreter teardown: the group and the ring are the parent's


def _serve(spec: WorkerSpec) -> None:
    from runner.loader import load_model

    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
    torch.set_num_threads(spec.threads)
    device = spec.platform.device
    if device.type == "cuda":
        device = torch.device("cuda", spec.rank)
        torch.cuda.set_device(device)

    def parent_alive() -> bool:
        return os.getppid() == spec.parent_pid

    shm = None
    if spec.shm_name is not None:
        shm = ShmCollectives.attach(spec.shm_name, spec.rank, spec.world_size,
                                    spec.shm_slot_bytes)  # fmt: skip
        shm.alive = parent_alive
    tp = TensorParallel.init(
        spec.rank, spec.world_size, spec.init_method, spec.backend, spec.timeout_s, shm
    )
    model, _ = load_model(spec.source, device, spec.platform.dtype, spec.lookup, tp=tp)
    ring = ShmRing.attach(spec.ring_name, spec.world_size - 1, spec.ring_slots,
                          spec.ring_slot_bytes)  # fmt: skip

    cache = CacheSpec.decode(ring.read(spec.rank, parent_alive), BACKENDS)
    spec.platform.prepare_as(model, cache.small_rows, cache.min_rows, cache.q4_rows)
    trim_heap()  # the shard's load temporaries (runner/heap.py)
    shard = ShardRunner(model, cache, device, spec.platform.dtype)
    log.info("rank %d (pid %d) ready on cores %s (%d threads)", spec.rank, os.getpid(),
             spec.cores, spec.threads)  # fmt: skip
    while True:
        words = ring.read(spec.rank, parent_alive)
        if message_kind(words) == STOP:
            if shm is not None:  # before the frame's locals go in any order (BufferError)
                shm.close()
            return
        shard.run(StepInput.decode(words))
