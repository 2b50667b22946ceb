"""Cache rows in the Triton kernels: as stored, or the int8 rows of runner/kv_format.py.

```
load_rows(ptr, row, offs_d, n_mask, d_mask, HEAD_DIM, KV_INT8, dtype)  -> [N, D] of dtype
store_int8_rows(ptr, base, x, offs_d, mask, live, HEAD_DIM)            quantise [H, D] rows
```
An int8 row is HEAD_DIM int8 values, then their fp32 scale in the row's last four bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2^23: adding and taking it away leaves an fp32 of magnitude under 2^22 rounded to an
# integer, to nearest even (the reference's `round`); libdevice's rint has no interpreter form.
ROUNDER = 12582912.0


@triton.jit
def load_rows(ptr, row, offs_d, n_mask, d_mask, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr,
              dtype: tl.constexpr):  # fmt: skip
    """[N, D] cache rows starting at the element offsets `row` [N]: an int8 row widened times
    its scale, either converted to `dtype`."""
    x = tl.load(ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                other=0)  # fmt: skip
    if KV_INT8:
        scale = tl.load((ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=n_mask,
                        other=0.0)  # fmt: skip
        return (x.to(tl.float32) * scale[:, None]).to(dtype)
    return x.to(dtype)


@triton.jit
def store_int8_rows(ptr, base, x, offs_d, mask, live, HEAD_DIM: tl.constexpr):
    """x [H, D] as int8 rows at the element offsets `base` [H] (`mask`: the real values,
    `live`: the rows to write): scale = absmax / 127, values round(x * (127 / absmax))."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    absmax = tl.max(tl.abs(xf), 1)
    inv = tl.where(absmax > 0, 127.0 / tl.where(absmax > 0, absmax, 1.0), 0.0)
    values = ((xf * inv[:, None] + ROUNDER) - ROUNDER).to(tl.int8)
    tl.store(ptr + base[:, None] + offs_d[None, :], values, mask=mask)
    tl.store((ptr + base + HEAD_DIM).to(tl.pointer_type(tl.float32)), absmax / 127.0, mask=live)
