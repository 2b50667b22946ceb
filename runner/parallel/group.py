"""The tensor-parallel process group one rank belongs to, and its two collectives.

Every rank calls the same collectives in the same order (the same forward on its shard);
a rank that dies or hangs makes the others' collective fail within `timeout` seconds
(gloo: at once when the peer's socket closes, else at the timeout), never a silent hang.
CPU ranks on one host pass their collectives through shared memory (shm_collectives.py);
gloo then only forms the group and carries collectives too large for the shared slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from runner.parallel.sharding import vocab_per_rank
from runner.parallel.shm_collectives import ShmCollectives

# Forming the group waits for every worker to spawn, import torch and load its shard: on a
# busy 2-core machine that alone can pass a short collective timeout, so joining gets its own
# (rank 0 stops waiting at once when a worker has died: see _wait_for_ranks).
JOIN_TIMEOUT_S = 180.0


def _wait_for_ranks(store: dist.FileStore, world_size: int, alive: Callable[[], bool]) -> None:
    """Rank 0, before gloo's own join (which no dead peer can cut short): every rank has
    checked in, or the first dead worker fails the join now rather than at the timeout."""
    keys = [f"headrace/joining/{r}" for r in range(world_size)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not store.check(keys):
        if not alive():
            raise RuntimeError("a worker exited before it joined")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not join within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


@dataclass(slots=True)
class TensorParallel:
    """This rank's place in the group: what the model layers need to split and combine."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    shm: ShmCollectives | None = None
    # Seconds spent in collectives (waiting for the slowest rank included) and their count:
    # benchmarks/tensor_parallel.py reads them per step.
    comm_s: float = 0.0
    comm_calls: int = 0

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str,
        timeout_s: float,
        shm: ShmCollectives | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> TensorParallel:
        """Join the group (blocks until every rank has joined, up to JOIN_TIMEOUT_S); `shm`:
        every rank's shared slots, when all ranks are CPU processes on this host. Collectives
        then run on a group of the same ranks whose timeout is `timeout_s`. `alive`: rank 0's
        check that its workers still run."""
        store = dist.FileStore(init_method.removeprefix("file://"), world_size)
        store.set(f"headrace/joining/{rank}", "1")
        if alive is not None:
            _wait_for_ranks(store, world_size, alive)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)),
        )
        group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s))
        if shm is not None:
            shm.timeout_s = timeout_s
        return cls(rank, world_size, group, shm)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x` (the row-parallel layers' partial products), in place."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.comm_s += time.perf_counter() - start
        self.comm_calls += 1
        return x

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[N, V_local] logits of every rank -> [N, V] on rank 0 (None on the others)."""
        per = vocab_per_rank(vocab, self.world_size)
        if local.shape[-1] < per:  # the last rank's shard is short: pad to a common shape
            local = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
        local = local.contiguous()
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(local):
            parts = self.shm.gather(local)
        else:
            parts = (
                [torch.empty_like(local) for _ in range(self.world_size)] if not self.rank else None
            )
            dist.gather(local, parts, dst=0, group=self.group)
        self.comm_s += time.perf_counter() - start
        self.comm_calls += 1
        return None if parts is None else torch.cat(parts, dim=-1)[..., :vocab]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
