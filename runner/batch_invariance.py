"""`--deterministic`: a row's linear output must not depend on how many rows share the call.

Each output row of a matmul is its own dot products, but the library picks its kernel by
the row count M: on an AVX2 EPYC, MKL's fp32 GEMM rounds one row (a GEMV), two or three
rows, and four or more rows three different ways (measured), so a request's greedy text
changed with its batch-mates. Within one kernel the reduction order over K is fixed and rows
never mix. So: find the smallest row count R from which every M gives each row the same
bits, and pad calls of fewer rows up to R (`Linear.min_rows`). R is measured on the model's
own layer shapes and formats at start-up (bf16 oneDNN needed 1 there, fp32 MKL 4).

```
rows:   1   2-3   4 .. 129          pad to R=4: every call runs the 4+ kernel
kernel  A    B       C       --->   rows 1-3 padded with zeros, the padding dropped after
```

Attention: a prompt chunk's rows go through the padded, blocked SDPA of its group, whose
kernel and key blocking follow the group's shape (the longest prompt in the step, whether a
chunk starts at 0). With `prompt_tokens_as_decode` every prompt token is computed by the
decode kernel instead, as the one-query row it would be when decoded: that kernel splits
work over (request, KV head) only and walks the keys in order, so a row is the same in any
batch and any chunking. Its price is reading the keys once per prompt token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from runner.layers.linear import Linear

log = logging.getLogger("headrace.platform")

CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# Row counts tried against each candidate: both sides of the usual kernel thresholds.
_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
# Columns kept per shape: the kernel choice follows M (and K); N only repeats the work.
_MAX_OUT = 2048


def padded(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int):
    """`layer(x)` with `x` [M, K] padded with zero rows up to `rows`; [M, N]."""
    m = x.shape[0]
    if m >= rows:
        return layer(x)
    pad = x.new_zeros(rows - m, x.shape[1])
    return layer(torch.cat([x, pad]))[:m]


def invariant_from(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int | None:
    """The smallest candidate R for which `layer` gives rows the same bits for every M >= R
    (first and last row of each call compared with that row computed alone, padded to R)."""
    for r in CANDIDATES:
        ok = True
        for m in (m for m in _ROWS if m <= x.shape[0]):
            y = padded(layer, x[:m], r)
            for i in {0, m - 1}:
                if not torch.equal(y[i], padded(layer, x[i : i + 1], r)[0]):
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return r
    return None


def measure_min_rows(model: torch.nn.Module, dtype: torch.dtype) -> int | None:
    """R for all of the model's linear layers (the largest of theirs); None if some layer
    is not batch-invariant at any candidate. Sets `min_rows` on every Linear when found."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = {(m.in_features, m.format): m for m in layers}
    torch.manual_seed(0)
    worst = 1
    with torch.inference_mode():
        for (k, fmt), layer in shapes.items():
            probe = _probe_layer(layer, k, fmt, dtype)
            x = torch.randn(max(_ROWS), k, dtype=dtype, device=_device(layer))
            r = invariant_from(probe, x)
            log.info("deterministic: %s linear K=%d is batch-invariant from %s rows", fmt, k, r)
            if r is None:
                return None
            worst = max(worst, r)
    for m in layers:
        m.min_rows = worst
    return worst


def _device(layer: Linear) -> torch.device:
    tensors: Sequence[torch.Tensor] = [p for p in layer.parameters()] + list(layer.buffers())
    return tensors[0].device if tensors else torch.device("cpu")


def _probe_layer(layer: Linear, k: int, fmt: str, dtype: torch.dtype) -> Linear:
    """A layer of the same K and format with at most _MAX_OUT random outputs."""
    n = min(layer.out_features, _MAX_OUT)
    probe = Linear(k, n, bias=False, int8_inputs=layer.int8_inputs)
    probe.weight.data = (torch.randn(n, k) * 0.05).to(dtype=dtype, device=_device(layer))
    probe.pack(fmt, float_format=fmt if fmt != "int8" else "float")
    return probe


def prompt_tokens_as_decode(decode: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """A prefill kernel (runner/attention.py's signature) that runs each prompt token as a
    one-query row of `decode`, attending to the keys up to and including its own."""

    def prefill(
        out: torch.Tensor,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        scale: float,
    ) -> None:
        lens = query_lens.long()  # [B]
        first = torch.cumsum(lens, 0) - lens  # [B] each request's first token among the N
        within = torch.arange(int(lens.sum()), device=lens.device)
        within -= torch.repeat_interleave(first, lens)  # [N] position in its chunk
        rows = torch.repeat_interleave(query_starts.long(), lens) + within  # [N]
        cached = torch.repeat_interleave(seq_lens.long() - lens, lens)  # [N]
        keys = (cached + within + 1).to(seq_lens.dtype)  # [N] keys each token attends
        tables = block_tables.repeat_interleave(lens, dim=0)  # [N, max_blocks]
        out[rows] = decode(q[rows], kv_cache, tables, keys, scale)

    return prefill


def make_attention_batch_invariant(backend: object) -> bool:
    """Route prompt chunks through the decode kernel (above); False where the backend has
    no such kernel (the torch reference, Triton): its prompts stay shape-dependent."""
    if hasattr(backend, "per_token_prompts"):
        backend.per_token_prompts = True
        return True
    log.warning("deterministic: attention backend %s is not batch-invariant for prompt "
                "chunks", getattr(backend, "name", backend))  # fmt: skip
    return False
