"""How the paged KV cache stores a row: one token's keys (or values) for one KV head.

```
cache_dtype(setting, model_dtype, int8_auto) -> dtype     --kv-cache-dtype: auto, model, int8
row_width(head_dim, cache_dtype) -> int                     elements a row takes
allocate(layers, num_blocks, block_size, kv_heads, head_dim, cache_dtype, device)
quantize_rows(x [..., D]) -> [..., D + 4] int8              what the KV write stores
dequantize_rows(rows [..., D + 4], dtype) -> [..., D]       what the reference reads
```
`model` stores rows in the model's dtype; `auto` does too, except where the platform chose
int8 rows (runner/platform.py: a quantised checkpoint served under quantization auto on the
CPU kernels). `int8` stores each row as D int8 values followed by
their fp32 scale in the row's last four bytes (runner/cpu_ops/kv_rows.h is the C++ side):
scale = absmax / 127, value = round(x * (127 / absmax)). A row of keys or values is one token
and head, so the scale follows that token's own range, as llama.cpp's q8_0 cache does per 32
values; the error is at most scale / 2 per value. Keeping the scale inside its row keeps the
cache one tensor and a block one copy, so prefix caching, the block tables and the KV
connectors need nothing new (the connectors' layout names the dtype, so engines of
different formats never share blocks).

Why: decode attention reads every cached row each step. bf16 rows of 64 dims are 128 bytes,
int8 rows 68, so a batch's attention reads about half the bytes and a cache of the same
memory holds ~1.9x the tokens (3.8x against fp32, the dtype of CPUs without bf16).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "model", "int8")
SCALE_BYTES = 4


def cache_dtype(setting: str, model_dtype: torch.dtype, int8_auto: bool = False) -> torch.dtype:
    """The cache tensor's dtype for `--kv-cache-dtype`: the model's, or int8 (`auto`: int8
    where the platform chose it, `int8_auto`)."""
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {setting!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    int8 = setting == "int8" or (setting == "auto" and int8_auto)
    return torch.int8 if int8 else model_dtype


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements one row takes in a cache of `dtype` (int8 rows carry their scale)."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def allocate(
    layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, kv_heads, row_width]` cache per layer."""
    shape = (2, num_blocks, block_size, kv_heads, row_width(head_dim, dtype))
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] fp32/bf16 -> [..., D + 4] int8 rows: the values, then the scale's bytes.

    The formula of kv_write.cpp's quantize_row, bit for bit: a multiply by 127 / absmax and
    rounding to nearest even; an all-zero row gets scale 0.
    """
    xf = x.float()
    absmax = xf.abs().amax(-1, keepdim=True)
    # A tensor over a tensor: `127 / absmax` multiplies by absmax's reciprocal, a different
    # last bit from the kernel's division.
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
    values = (xf * inv).round().to(torch.int8)
    return torch.cat([values, (absmax / 127).view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values of `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)
