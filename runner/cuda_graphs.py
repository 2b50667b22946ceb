"""CUDA graphs for decode-only steps (CUDA and the Triton backend only).

A decode step of a small model is hundreds of short kernel launches; replaying a captured
graph issues them all at once. A graph replays fixed shapes at fixed addresses, so:

```
ladder of batch sizes:  1 2 4 8 16 24 32 ... max_num_seqs      one graph each, one memory pool
static buffers (int32): [ input_ids | positions | slots | seq_lens | block tables ]  (max rows)
a step of n decodes:    padded to the next size b on the ladder; rows n..b-1 are padding:
                        token 0 at position 0, slot -1 (not written), seq_len 0 (output 0)
                        one host->device copy fills the buffers, then graph[b].replay()
```
Mixed steps (any request with more than one new token) run eagerly. The decode kernel's
split count is part of the graph, fixed per size from max_model_len.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from runner.triton_ops.metadata import TritonAttentionMetadata, decode_splits

log = logging.getLogger("headrace.runner")


def batch_ladder(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: powers of two to 8, then steps of 8 (as vLLM)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Captured decode forwards, one per ladder size, replayed with copied-in inputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.block_size = block_size
        self.sizes = batch_ladder(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        rows = self.sizes[-1]
        self.kv_heads = kv_caches[0].shape[3]
        # One int32 buffer so one copy fills every input: 4 columns + the block tables.
        self.static = torch.zeros(rows * (4 + self.max_blocks), dtype=torch.int32, device=device)
        # Two pinned staging buffers, alternated: with the batch queue the next step is filled
        # while this one's copy may still wait in the stream; an event says when it is done.
        self.hosts = [torch.zeros_like(self.static, device="cpu").pin_memory() for _ in "ab"]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.arange = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.empty = torch.zeros(0, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: object | None = None
        self.num_replays = 0

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        rows = self.sizes[-1]
        ids, pos, slots, lens, tables = self.static.split([rows] * 4 + [rows * self.max_blocks])
        return ids[:b], pos[:b], slots[:b], lens[:b], tables.view(rows, -1)[:b]

    def _meta(self, b: int) -> TritonAttentionMetadata:
        _, _, slots, lens, tables = self._views(b)
        return TritonAttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self.arange[: b + 1],
            seq_lens=lens,
            block_tables=tables,
            decode_seqs=self.arange[:b],
            prefill_seqs=self.empty,
            num_tokens=b,
            num_decodes=b,
            num_prefills=0,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decode_splits=decode_splits(b, self.kv_heads, self.max_model_len, self.num_sms),
        )

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every size, largest first (later ones reuse its pool). Returns the bytes
        the graphs' pool holds."""
        before = torch.cuda.memory_reserved(self.device)
        self.static.zero_()
        self._views(self.sizes[-1])[2].fill_(-1)  # capture runs write no KV
        for b in reversed(self.sizes):
            ids, pos, *_ = self._views(b)
            meta = self._meta(b)
            torch.cuda.synchronize(self.device)
            self.model(ids, pos, self.kv_caches, meta)  # warm-up: triton compiles outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(ids, pos, self.kv_caches, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        used = torch.cuda.memory_reserved(self.device) - before
        log.info("captured %d decode graphs (sizes %s), %.1f MiB", len(self.sizes), self.sizes,
                 used / 2**20)  # fmt: skip
        return used

    def fits(self, num_new: Sequence[int]) -> bool:
        return 0 < len(num_new) <= self.sizes[-1] and all(n == 1 for n in num_new)

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Replay the smallest graph that holds these decodes; [n, hidden] hidden states.
        `fill` patches the input ids on the device (tokens the last step is still sampling)."""
        n = len(input_ids)
        b = next(s for s in self.sizes if s >= n)
        rows = self.sizes[-1]
        self.turn ^= 1
        self.copied[self.turn].synchronize()  # its previous copy (two steps ago) is done
        staging = self.hosts[self.turn]
        host = staging.numpy()
        ids, pos, slots, lens = (host[i * rows : i * rows + b] for i in range(4))
        ids[:n], pos[:n] = input_ids, positions
        ids[n:], pos[n:], slots[n:], lens[n:] = 0, 0, -1, 0
        tables = host[4 * rows :].reshape(rows, self.max_blocks)
        for i, (p, blocks) in enumerate(zip(positions, block_tables)):
            slots[i] = blocks[p // self.block_size] * self.block_size + p % self.block_size
            lens[i] = p + 1
            tables[i, : len(blocks)] = blocks
        # Table rows past seq_lens are never read, so stale ids there are harmless.
        self.static.copy_(staging, non_blocking=True)
        self.copied[self.turn].record()
        if fill is not None:
            fill(self._views(b)[0])
        graph, out = self.graphs[b]
        graph.replay()
        self.num_replays += 1
        return out[:n]


def estimate_graph_memory(
    model: torch.nn.Module,
    kv_shape: tuple[int, ...],
    dtype: torch.dtype,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    """Bytes the decode graphs will hold, measured by capturing them on a throwaway cache of
    one sequence's worth of blocks, so the KV cache can be sized with them counted."""
    blocks = -(-max_model_len // kv_shape[2]) + 1
    shape = (kv_shape[0], blocks, *kv_shape[2:])
    layers = len(model.layers)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    graphs = DecodeGraphs(model, caches, max_num_seqs, max_model_len, kv_shape[2], device)
    used = graphs.capture()
    del graphs, caches
    torch.cuda.empty_cache()
    # The real capture's pool matches this one; a margin covers allocator rounding.
    return int(used * 1.2)
