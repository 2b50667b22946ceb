"""Triton paged-attention kernels against the torch reference.

Without a GPU they run under triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which runs every program of the grid in Python: shapes are small. With one, the same tests
run the compiled kernels on it.
"""

from __future__ import annotations

import pytest
import torch

from runner import attention as ref
from runner.triton_ops import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 products run as tf32 on the GPU's tensor cores; the interpreter's are exact fp32.
TOL = 5e-3 if DEVICE.type == "cuda" else 2e-5


def _backend(kv_heads: int):
    from runner.triton_ops.backend import TritonAttentionBackend

    return TritonAttentionBackend(kv_heads)


def _tables(reqs: list[tuple[int, int]], block_size: int, num_blocks: int) -> list[list[int]]:
    """Distinct, shuffled blocks for each request (each needs ceil(total / block_size))."""
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for done, n in reqs:
        need = -(-(done + n) // block_size)
        tables.append(perm[used : used + need])
        used += need
    assert used <= num_blocks
    return tables


def _run_both(
    reqs: list[tuple[int, int]],
    tables: list[list[int]],
    kv: torch.Tensor,
    heads: int,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step through both backends on copies of kv: (out_ref, out_triton, kv_ref, kv_tri)."""
    _, _, block_size, kv_heads, head_dim = kv.shape
    done, new = [d for d, _ in reqs], [n for _, n in reqs]
    t = sum(new)
    kv = kv.to(DEVICE)
    # An int8 cache (runner/kv_format.py) takes fp32 rows of head_dim, 4 bytes fewer.
    dtype = torch.float32 if kv.dtype == torch.int8 else kv.dtype
    head_dim = head_dim - 4 if kv.dtype == torch.int8 else head_dim
    q = torch.randn(t, heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    kv_ref, kv_tri = kv.clone(), kv.clone()

    meta_ref = ref.build_metadata(done, new, tables, block_size, DEVICE)
    ref.write_kv(kv_ref, k, v, meta_ref.slot_mapping)
    out_ref = ref.paged_attention(q, kv_ref, meta_ref, scale)

    backend = _backend(kv_heads)
    meta = backend.build_metadata(done, new, tables, block_size, DEVICE)
    if splits is not None:
        meta.num_decode_splits = splits
    backend.write_kv(kv_tri, k, v, meta)
    out_tri = backend.forward(q, kv_tri, meta, scale)
    return out_ref, out_tri, kv_ref, kv_tri


# Fresh prompt, decodes of several lengths, a chunk after a prefix, a one-token prompt.
MIXED = [(0, 7), (20, 1), (33, 1), (16, 5), (0, 1), (45, 1)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 32, 16), (32, 8, 16, 32), (4, 2, 24, 16)],
)
def test_mixed_batch_matches_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(heads)
    num_blocks = 13  # odd, and more than the requests use: unused blocks stay untouched
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    tables = _tables(MIXED, block_size, num_blocks)
    out_ref, out_tri, kv_ref, kv_tri = _run_both(MIXED, tables, kv, heads)
    assert torch.equal(kv_tri, kv_ref)
    torch.testing.assert_close(out_tri, out_ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_splits_merge_exactly(splits: int) -> None:
    """Flash-decoding: any split count gives the reference result (8 leaves splits empty)."""
    torch.manual_seed(splits)
    reqs = [(70, 1), (5, 1), (31, 1)]
    kv = torch.randn(2, 11, 16, 2, 32)
    out_ref, out_tri, _, _ = _run_both(reqs, _tables(reqs, 16, 11), kv, 8, splits=splits)
    torch.testing.assert_close(out_tri, out_ref, atol=TOL, rtol=TOL)


def test_prefix_cache_hit_shares_blocks() -> None:
    """Request B reuses A's first two full blocks (a prefix-cache hit) and computes the rest."""
    torch.manual_seed(1)
    block_size, kv_heads, head_dim, heads = 16, 3, 16, 9
    kv = torch.zeros(2, 9, block_size, kv_heads, head_dim)
    a_blocks, b_own = [6, 2, 4], [7]
    # Step 1: A's whole 40-token prompt.
    out_ref, out_tri, kv_ref, kv_tri = _run_both([(0, 40)], [a_blocks], kv, heads)
    torch.testing.assert_close(out_tri, out_ref, atol=TOL, rtol=TOL)
    assert torch.equal(kv_tri, kv_ref)
    # Step 2: A decodes one token; B has 32 cached tokens (A's blocks 6, 2) and 6 new ones.
    reqs = [(40, 1), (32, 6)]
    tables = [a_blocks, a_blocks[:2] + b_own]
    out_ref, out_tri, kv_ref2, kv_tri2 = _run_both(reqs, tables, kv_ref, heads)
    assert torch.equal(kv_tri2, kv_ref2)
    torch.testing.assert_close(out_tri, out_ref, atol=TOL, rtol=TOL)
    # B's new tokens went to its own block only; the shared blocks are unchanged.
    assert torch.equal(kv_ref2[:, a_blocks[:2]], kv_ref[:, a_blocks[:2]].to(DEVICE))


def test_long_chunk_spans_several_query_tiles() -> None:
    """A 70-token chunk after a 19-token prefix: query tiles of 16 with a causal diagonal."""
    from runner.triton_ops import prefill_attention

    torch.manual_seed(2)
    reqs = [(19, 70)]
    kv = torch.randn(2, 7, 16, 1, 16, device=DEVICE)
    tables = _tables(reqs, 16, 7)
    done, new = [19], [70]
    q = torch.randn(70, 2, 16, device=DEVICE)
    backend = _backend(1)
    meta = backend.build_metadata(done, new, tables, 16, DEVICE)
    out = torch.empty_like(q)
    prefill_attention.prefill_attention(q, kv, meta, 0.25, out, block_m=16, block_n=16)
    meta_ref = ref.build_metadata(done, new, tables, 16, DEVICE)
    torch.testing.assert_close(out, ref.paged_attention(q, kv, meta_ref, 0.25), atol=TOL, rtol=TOL)


def test_padding_slots_are_not_written() -> None:
    """Slot -1 marks a padding row (CUDA graphs pad the batch): the cache stays unchanged."""
    from runner.triton_ops import kv_write

    kv = torch.zeros(2, 3, 16, 2, 16, device=DEVICE)
    k = torch.ones(3, 2, 16, device=DEVICE)
    kv_write.write_kv(kv, k, 2 * k, torch.tensor([5, -1, 40], dtype=torch.int32, device=DEVICE))
    written = kv.view(2, 48, 2, 16).abs().sum(dim=(2, 3)).nonzero()
    assert written.tolist() == [[0, 5], [0, 40], [1, 5], [1, 40]]


def test_bf16_matches_reference() -> None:
    torch.manual_seed(3)
    kv = torch.randn(2, 13, 16, 3, 32).to(torch.bfloat16)
    tables = _tables(MIXED, 16, 13)
    out_ref, out_tri, kv_ref, kv_tri = _run_both(MIXED, tables, kv, 9)
    assert torch.equal(kv_tri, kv_ref)
    torch.testing.assert_close(out_tri.float(), out_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_int8_rows_match_reference(splits: int) -> None:
    """int8 rows (--kv-cache-dtype int8): the write quantises as the reference does (bit for
    bit in the interpreter, whose division is IEEE like torch's), and both kernels read the
    rows times their scales; a head of 24 (padded to 32) and one of 32."""
    from runner import kv_format

    for head_dim, heads, kv_heads in ((32, 9, 3), (24, 4, 2)):
        torch.manual_seed(head_dim + splits)
        kv = kv_format.quantize_rows(torch.randn(2, 13, 16, kv_heads, head_dim))
        out_ref, out_tri, kv_ref, kv_tri = _run_both(MIXED, _tables(MIXED, 16, 13), kv, heads,
                                                     splits)  # fmt: skip
        if DEVICE.type == "cpu":
            assert torch.equal(kv_tri, kv_ref)
        torch.testing.assert_close(out_tri, out_ref, atol=TOL, rtol=TOL)
