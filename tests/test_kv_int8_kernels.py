"""The int8 KV cache (runner/kv_format.py) in the C++ kernels, against the torch reference.

The reference dequantises the gathered rows and runs SDPA; the kernels read the int8 rows in
place (decode: integer dot products against int16 queries; prompts: rows widened times their
scales, or packed into bf16 AMX tiles). test_cpu_ops.py's AVX2 build runs this file too.
"""

from __future__ import annotations

import pytest
import torch
from attention_fixtures import scattered_tables

from runner import kv_format
from runner.attention_backends import CpuKernelAttentionBackend, TorchAttentionBackend
from runner.cpu_ops import load_cpu_ops

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"


def _int8_step(reqs, heads, kv_heads, head_dim, block_size, dtype, vec=False):
    """One step (done, new) per request on an int8 cache through both backends:
    (reference, kernel). `vec`: prompt chunks on the vector kernel, not AMX or SDPA."""
    torch.manual_seed(len(reqs) * 131 + heads + head_dim)
    num_blocks = sum(-(-(d + n) // block_size) for d, n in reqs) + 8
    rows = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    cache0 = kv_format.quantize_rows(rows)
    done, new = [d for d, _ in reqs], [n for _, n in reqs]
    tables = scattered_tables([d + n for d, n in reqs], block_size, num_blocks)
    q = torch.randn(sum(new), heads, head_dim).to(dtype)
    k = torch.randn(sum(new), kv_heads, head_dim).to(dtype)
    v = torch.randn(sum(new), kv_heads, head_dim).to(dtype)
    kernel = CpuKernelAttentionBackend()
    if vec:
        kernel.amx, kernel.vec_prefill = False, True
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), kernel):
        cache = cache0.clone()
        meta = backend.build_metadata(done, new, tables, block_size, CPU)
        backend.write_kv(cache, k, v, meta)
        outs.append(backend.forward(q, cache, meta, head_dim**-0.5))
        caches.append(cache)
    # The C++ write quantises as the reference does, bit for bit.
    assert torch.equal(caches[0], caches[1])
    return outs


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: the kernels' int16 query rounding (~2e-5 relative) is all that differs; bf16: the
    # reference rounds the dequantised rows to bf16, the kernels multiply in fp32.
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# SmolLM2's heads, a Llama-1B head, a 128-wide head, a width with no vector path (the
# generic loop), and blocks of 6 tokens.
SHAPES = [(9, 3, 64, 16), (32, 8, 64, 32), (8, 2, 128, 16), (6, 3, 24, 16), (9, 3, 64, 6)]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@DTYPES
def test_decode_rows_on_int8_rows_match_the_reference(heads, kv_heads, head_dim, block_size, dtype):
    # Lengths 1, one block exactly, odd block counts, past 512 keys (splits merged).
    reqs = [(0, 1), (block_size - 1, 1), (2 * block_size, 1), (37, 1), (600, 1)]
    want, got = _int8_step(reqs, heads, kv_heads, head_dim, block_size, dtype)
    _close(got, want, dtype)


@pytest.mark.parametrize("vec", [False, True], ids=["default", "vector"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES[:3])
@DTYPES
def test_prompt_chunks_on_int8_rows_match_the_reference(
    heads, kv_heads, head_dim, block_size, dtype, vec
):
    # Whole prompts, chunks after a cached prefix and a decode row: the default takes AMX
    # for bf16 where the CPU has it (else the measured choice), `vector` the vector kernel.
    reqs = [(0, 40), (0, 100), (50, 37), (3, 1), (0, 17), (129, 64), (700, 20)]
    want, got = _int8_step(reqs, heads, kv_heads, head_dim, block_size, dtype, vec)
    _close(got, want, dtype)


def test_quantised_rows_are_within_half_a_step_and_carry_their_scale():
    torch.manual_seed(3)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    x[7] = 0.0
    rows = kv_format.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)  # [50, 3, 1]
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    back = kv_format.dequantize_rows(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[7], torch.zeros(3, 64)) and torch.equal(scale[7], torch.zeros(3, 1))
    assert rows[..., :64].abs().max() == 127  # each row's largest value takes the full range


@DTYPES
def test_write_kv_quantises_strided_views_like_the_reference(dtype):
    # k and v as the layer passes them: strided views into one QKV row.
    torch.manual_seed(1)
    qkv = torch.randn(13, (9 + 2 * 3) * 64).to(dtype)
    k = qkv[:, 9 * 64 : 12 * 64].view(13, 3, 64)
    v = qkv[:, 12 * 64 :].view(13, 3, 64)
    slots = torch.randperm(8 * 16)[:13]
    want = torch.zeros(2, 8, 16, 3, 68, dtype=torch.int8)
    got = want.clone()
    TorchAttentionBackend().write_kv(want, k, v, type("M", (), {"slot_mapping": slots}))
    torch.ops.headrace.write_kv_(got, k, v, slots)
    assert torch.equal(got, want)


def test_kernels_refuse_int8_rows_of_the_wrong_width():
    q = torch.zeros(1, 9, 64)
    narrow = torch.zeros(2, 4, 16, 3, 64, dtype=torch.int8)  # no room for the scales
    one_block, five = torch.tensor([[0]]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="needs 68"):
        torch.ops.headrace.paged_decode_attention(q, narrow, one_block, five, 1.0)
    with pytest.raises(RuntimeError, match="needs 68"):
        torch.ops.headrace.write_kv_(
            narrow, torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), torch.tensor([0])
        )
    with pytest.raises(RuntimeError, match="fp32 or bf16 into an int8 cache"):
        k = torch.zeros(1, 3, 64, dtype=torch.float16)
        torch.ops.headrace.write_kv_(
            torch.zeros(2, 4, 16, 3, 68, dtype=torch.int8), k, k, torch.tensor([0])
        )
