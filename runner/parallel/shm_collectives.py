"""All-reduce and gather through shared memory, for CPU ranks on one host.

gloo goes through TCP loopback: ~0.5-1 ms a call, and a decode step makes two collectives a
layer. Here every rank owns two slots (even and odd collectives) and one sequence counter:

```
int64 words:  [seq_0 .. seq_{N-1}]                 seq_r = collectives rank r has published
slots:        rank r, parity p = [slot_bytes ...]   collective k lives in parity k % 2
```
Collective k: wait until every rank published k-1 (so every reader of my collective k-2,
which used this parity, is done with it), copy my part into my slot, publish seq = k, wait
until every rank published k, read. The all-reduce sums the slots in rank order on every
rank, so every rank holds bit-identical sums. Payloads over `slot_bytes` are not for this
module: the caller falls back to gloo (every rank sees the same shape, so all decide alike).

NOTE: as in ring.py, x86's total store order makes a payload visible before the counter
stored after it; a weakly ordered CPU would need fences here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import shared_memory

import torch

from runner.parallel.ring import RingTimeout, spin_wait

_COUNTERS = 64  # bytes reserved for the counters' cache line(s) of a small group


class ShmCollectives:
    """See the module docstring. `create` on rank 0, `attach(name, ...)` on the others."""

    def __init__(
        self, shm: shared_memory.SharedMemory, rank: int, world_size: int, slot_bytes: int
    ) -> None:
        if world_size < 2:
            raise ValueError(f"shared-memory collectives need >= 2 ranks, not {world_size}")
        self.shm, self.rank, self.world_size, self.slot_bytes = shm, rank, world_size, slot_bytes
        # A memoryview of int64s: reading one is ~10x cheaper than a numpy scalar, and the
        # waits below read them in a tight loop.
        self._seq = shm.buf[: 8 * world_size].cast("q")
        count = world_size * 2 * slot_bytes
        raw = torch.frombuffer(
            shm.buf, dtype=torch.uint8, count=count, offset=_header_bytes(world_size)
        )
        self._slots = raw.view(world_size, 2, slot_bytes)
        # Slicing costs microseconds a view, as much as the copy of a decode row: the views of
        # each (parity, shape, dtype) seen are kept (a step has a few shapes, a run a few dozen).
        self._cache: dict[tuple[int, torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self._k = 0  # collectives this rank has started
        self.timeout_s = 30.0
        self.alive: Callable[[], bool] = lambda: True

    @classmethod
    def create(cls, world_size: int, slot_bytes: int) -> ShmCollectives:
        size = _header_bytes(world_size) + world_size * 2 * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        group = cls(shm, 0, world_size, slot_bytes)
        for r in range(world_size):
            group._seq[r] = 0
        return group

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, slot_bytes: int) -> ShmCollectives:
        # NOTE: spawned ranks share the creator's resource tracker (see ring.py): the
        # creator alone unlinks the segment.
        return cls(shared_memory.SharedMemory(name=name), rank, world_size, slot_bytes)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def calls(self) -> int:
        """Collectives that went through shared memory so far."""
        return self._k

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x`, in place, added in rank order."""
        p = self._publish(x)
        self._wait_all(self._k)
        slots = self._views(p, x)
        torch.add(slots[0], slots[1], out=x)
        for r in range(2, self.world_size):
            x.add_(slots[r])
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape on all) on rank 0, copies in rank order; None elsewhere."""
        p = self._publish(x)
        if self.rank:
            return None  # the next collective's first wait keeps my slot until rank 0 read it
        self._wait_all(self._k)
        return [part.clone() for part in self._views(p, x)]

    def _publish(self, x: torch.Tensor) -> int:
        if not self.fits(x):
            raise ValueError(f"collective of {x.numel() * x.element_size()} bytes exceeds "
                             f"the shared slot's {self.slot_bytes}")  # fmt: skip
        self._wait_all(self._k)  # everyone is past collective k-1: parity k+1 is free again
        self._k += 1
        p = self._k % 2
        self._views(p, x)[self.rank].copy_(x)
        self._seq[self.rank] = self._k
        return p

    def _views(self, parity: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's part of this collective in its slot, shaped like `like`."""
        key = (parity, like.shape, like.dtype)
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) >= 256:
                self._cache.clear()
            flat = self._slots.view(like.dtype)[:, parity, : like.numel()]
            views = self._cache[key] = list(flat.view(self.world_size, *like.shape).unbind(0))
        return views

    def _wait_all(self, k: int) -> None:
        seq = self._seq
        if min(seq) >= k:  # the common case when the peers are ahead: no closure, no clock
            return
        try:
            spin_wait(lambda: min(seq) >= k, time.monotonic() + self.timeout_s, self.alive)
        except RingTimeout as e:
            raise RingTimeout(f"shared-memory collective {k}: {e}") from None

    def close(self, unlink: bool = False) -> None:
        # The numpy and torch views hold exports of the buffer: drop them before closing.
        self._seq.release()
        self._slots, self._cache = None, {}  # type: ignore[assignment]
        self.shm.close()
        if unlink:
            self.shm.unlink()


def _header_bytes(world_size: int) -> int:
    return max(_COUNTERS, 8 * world_size)
