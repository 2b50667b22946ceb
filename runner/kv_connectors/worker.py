"""`StoreWorker`: the runner side over any BlockStore (disk tier, a producer's memory, a peer).

```
start_loads (loop thread) --> IO thread: store.get_many -> staged [n, L, 2, bs, H, D] (host)
poll_loads  (loop thread) <-- finished futures: req id -> n
commit      (runner thread, before the forward): staged -> kv_caches[l][:, block ids]
save        (runner thread, after the forward):  kv_caches -> host copy --> store.put
```
Loads never touch the paged cache off the runner thread: a request aborted mid-load frees
its blocks at once, and its staged copy is simply dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvcache.connectors import BlockStore, KVConnectorMeta, LoadSpec
from runner.kv_connectors.base import KVConnectorContext
from scheduling import SchedulerOutput

log = logging.getLogger("headrace.kv_connector")


class StoreWorker:
    """Loads through an IO thread; saves copied out on the runner thread, then stored.

    `sync_saves` stores on the runner thread too, so a block is in the store before the
    step's results go out (a P/D producer: the consumer asks right after).
    """

    def __init__(
        self, ctx: KVConnectorContext, store: BlockStore, sync_saves: bool = False
    ) -> None:
        self.ctx, self.store, self.sync_saves = ctx, store, sync_saves
        lay = ctx.layout
        # One block: [L, 2, bs, H, D]
        self.block_shape = (lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="headrace-kv-io")
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[LoadSpec, Future[torch.Tensor | None]]] = {}
        self._staged: dict[str, tuple[int, torch.Tensor]] = {}
        self._saves: list[Future[None]] = []
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    # -- loads ---------------------------------------------------------------------------

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        with self._lock:
            for spec in loads:
                self._inflight[spec.req_id] = (spec, self._io.submit(self._fetch, spec))

    def _fetch(self, spec: LoadSpec) -> torch.Tensor | None:
        payloads = self.store.get_many(spec.keys)
        if not payloads:
            return None
        raw = bytearray(b"".join(payloads))
        # [n, L, 2, bs, H, D]
        return torch.frombuffer(raw, dtype=self.ctx.dtype).view(len(payloads), *self.block_shape)

    def poll_loads(self) -> dict[str, int]:
        done: dict[str, int] = {}
        with self._lock:
            for rid, (spec, future) in list(self._inflight.items()):
                if not future.done():
                    continue
                del self._inflight[rid]
                try:
                    staged = future.result()
                except Exception:
                    log.exception("kv connector: loading %s failed; it recomputes", rid)
                    staged = None
                if staged is None:
                    done[rid] = 0
                    continue
                self._staged[rid] = (spec.first_block, staged)
                done[rid] = staged.shape[0]
        return done

    def has_inflight(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def wait_any(self, timeout: float) -> None:
        """Sleep until a load finishes or `timeout` passes (a script with nothing to step)."""
        with self._lock:
            futures = [f for _, f in self._inflight.values()]
        if futures:
            wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def discard(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in req_ids:
                self._inflight.pop(rid, None)
                self._staged.pop(rid, None)

    def num_staged(self) -> int:
        with self._lock:
            return len(self._staged)

    def commit(
        self,
        so: SchedulerOutput,
        block_ids: Mapping[str, list[int]],
        kv_caches: list[torch.Tensor],
    ) -> None:
        for new in so.scheduled_new_reqs:
            with self._lock:
                entry = self._staged.pop(new.req_id, None)
            if entry is None:
                continue
            first, staged = entry
            ids = block_ids[new.req_id][first : first + staged.shape[0]]
            index = torch.tensor(ids, device=kv_caches[0].device)
            data = staged.to(kv_caches[0].device)  # [n, L, 2, bs, H, D]
            for layer, cache in enumerate(kv_caches):
                # cache: [2, num_blocks, bs, H, D]; data[:, layer]: [n, 2, bs, H, D]
                cache[:, index] = data[:, layer].transpose(0, 1)
            self.num_loaded_blocks += len(ids)

    # -- saves ---------------------------------------------------------------------------

    def save(
        self,
        meta: KVConnectorMeta,
        block_ids: Mapping[str, list[int]],
        kv_caches: list[torch.Tensor],
    ) -> None:
        for spec in meta.saves:
            ids = block_ids[spec.req_id][spec.first_block : spec.first_block + len(spec.keys)]
            index = torch.tensor(ids, device=kv_caches[0].device)
            # [n, L, 2, bs, H, D], one contiguous block per row, on the host
            blocks = torch.stack([c[:, index].transpose(0, 1) for c in kv_caches], dim=1)
            host = blocks.contiguous().cpu()
            if self.sync_saves:
                self._store(spec.keys, host)
            else:
                self._saves = [f for f in self._saves if not f.done()]
                self._saves.append(self._io.submit(self._store, spec.keys, host))

    def _store(self, keys: list[str], host: torch.Tensor) -> None:
        raw = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
        for key, row in zip(keys, raw):
            self.store.put(key, memoryview(row))
        self.num_saved_blocks += len(keys)

    def flush(self, timeout: float | None = None) -> None:
        saves, self._saves = self._saves, []
        wait(saves, timeout=timeout)

    def close(self) -> None:
        self.flush()
        self._io.shutdown(wait=True)
