"""The vector prompt-chunk kernel (runner/cpu_ops/vec_attention.cpp) against the torch
reference, its measured choice (runner/cpu_prefill.py), and greedy decoding through it.

These run in the native build and, through `test_the_avx2_build_passes_these_tests_too`, in
a build without AVX-512 (AVX2 paths) on the same machine.
"""

from __future__ import annotations

import logging
import platform
import subprocess
import sys

import pytest
import torch
from attention_fixtures import scattered_tables
from model_fixtures import engine_for, make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner import attention, cpu_prefill
from runner.attention_backends import CpuKernelAttentionBackend
from runner.cpu_ops import load_cpu_ops
from scheduling import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"


def _both(reqs, heads, kv_heads, head_dim, block_size, dtype, num_blocks=96):
    """(reference, kernel) outputs of one step of (cached, new) per request; the kernel
    takes the chunks and the reference the decode rows in both."""
    torch.manual_seed(len(reqs) * 7 + heads + head_dim)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    done, new = [d for d, _ in reqs], [n for _, n in reqs]
    tables = scattered_tables([d + n for d, n in reqs], block_size, num_blocks)
    # q as the model passes it: a view into a wider (fused QKV) output.
    qkv = torch.randn(sum(new), heads + 2 * kv_heads, head_dim).to(dtype)
    q = qkv[:, :heads]
    meta = attention.build_metadata(done, new, tables, block_size, CPU)
    scale = head_dim**-0.5
    want = attention.paged_attention(q, kv, meta, scale)
    kernel = torch.ops.headrace.paged_prefill_attention_vec_
    got = attention.paged_attention(q, kv, meta, scale, None, kernel)
    return want, got


# (heads, kv_heads, head_dim, block_size): SmolLM2 (9 / 3 x 64), a Llama-1B head (32 / 8 x 64)
# in 32-token blocks, 128-wide heads with GQA, MHA (one head a group), MQA (16 heads on one
# KV head: 4 positions a tile), and SmolLM2 in 8-token blocks (a 32-key chunk spans four).
SHAPES = [
    (9, 3, 64, 16), (32, 8, 64, 32), (8, 2, 128, 16), (4, 4, 128, 16), (16, 1, 64, 16),
    (9, 3, 64, 8),
]  # fmt: skip
# Whole prompts of odd lengths, chunks that start mid-block after a cached prefix (and end
# mid-block), a 2-token chunk, and a decode row beside them.
REQS = [(0, 40), (50, 37), (3, 1), (0, 17), (129, 64), (31, 2), (16, 5)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_chunks_match_the_reference(heads, kv_heads, head_dim, block_size, dtype):
    want, got = _both(REQS, heads, kv_heads, head_dim, block_size, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_fresh_prompts_only_and_a_long_chunk_match_too():
    # All from position 0 (the reference's is_causal path); then one chunk of 300 tokens
    # after 200 cached, far past one tile and many blocks.
    for reqs in ([(0, 5), (0, 100), (0, 33)], [(200, 300)]):
        want, got = _both(reqs, 9, 3, 64, 16, torch.float32)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_kernel_refuses_what_it_cannot_do():
    op = torch.ops.headrace.paged_prefill_attention_vec_
    q = torch.zeros(4, 2, 64)
    kv = torch.zeros(2, 4, 16, 1, 64)
    one = torch.ones(1, dtype=torch.long)
    table = one.view(1, 1) * 0

    def call(q=q, kv=kv, table=table, lens=one * 4, starts=one * 0, counts=one * 4):
        op(torch.empty_like(q), q, kv, table, lens, starts, counts, 0.125)

    call()  # the well-formed call runs
    with pytest.raises(RuntimeError, match="fp32 or bf16, kv_cache the same or int8"):
        call(q=q.bfloat16())
    with pytest.raises(RuntimeError, match="fp32 or bf16, kv_cache the same or int8"):
        call(q=q.half(), kv=kv.half())
    with pytest.raises(RuntimeError, match="head dim 64 or 128"):
        call(q=torch.zeros(4, 2, 32), kv=torch.zeros(2, 4, 16, 1, 32))
    with pytest.raises(RuntimeError, match="query rows out of range"):
        call(starts=one * 2)
    with pytest.raises(RuntimeError, match="block id out of range"):
        call(table=table + 9)
    with pytest.raises(RuntimeError, match="query count or seq_len out of range"):
        call(lens=one * 17)


def test_the_choice_is_measured_once_per_shape_and_logged(caplog):
    caplog.set_level(logging.INFO, "headrace.cpu_prefill")
    cpu_prefill.choose_vec_prefill.cache_clear()
    first = cpu_prefill.choose_vec_prefill(9, 3, 64, torch.float32, 16, rounds=1)
    again = cpu_prefill.choose_vec_prefill(9, 3, 64, torch.float32, 16, rounds=1)
    assert first is again
    assert caplog.text.count("prompt attention (9/3 heads x 64, float32)") == 1
    assert "kernel" in caplog.text and "SDPA" in caplog.text
    # A shape the kernel has no path for is SDPA without timing anything.
    none = cpu_prefill.choose_vec_prefill(6, 3, 24, torch.float32, 16)
    assert none == cpu_prefill.PrefillChoice(False, False)


def test_the_backend_follows_the_choice_per_kind_of_step(monkeypatch):
    choice = cpu_prefill.PrefillChoice(fresh=True, continued=False)
    monkeypatch.setattr(cpu_prefill, "choose_vec_prefill", lambda *args: choice)
    q, kv = torch.zeros(10, 9, 64), torch.zeros(2, 8, 16, 3, 64)
    fresh = attention.build_metadata([0, 4], [5, 1], [[0], [1]], 16, CPU)
    later = attention.build_metadata([3], [5], [[0]], 16, CPU)
    decode = attention.build_metadata([3, 4], [1, 1], [[0], [1]], 16, CPU)
    wants = cpu_prefill.wants_vec_prefill
    assert wants(None, q, kv, fresh) and not wants(None, q, kv, later)
    assert not wants(None, q, kv, decode)
    assert wants(True, q, kv, later) and not wants(False, q, kv, fresh)
    # Forced on, a shape it cannot take still goes to the reference.
    assert not wants(True, torch.zeros(10, 6, 24), torch.zeros(2, 8, 16, 3, 24), fresh)
    assert not wants(True, q.half(), kv.half(), fresh)


def test_greedy_with_the_kernel_equals_the_reference(tmp_path):
    # A tiny random Llama with 64-wide heads (GQA 4 / 2), fp32: prompts chunked mid-block
    # beside decode rows, and prefix-cache hits (chunks that start after cached blocks).
    make_tiny_hf_model("llama-plain", tmp_path, hidden_size=256, num_attention_heads=4)
    loaded = LoadedModel.load(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    assert loaded.config.head_dim == 64
    torch.manual_seed(1)
    shared = torch.randint(3, 320, (40,)).tolist()
    prompts = [shared + torch.randint(3, 320, (n,)).tolist() for n in (3, 29, 51, 18)]
    prompts.append(torch.randint(3, 320, (70,)).tolist())
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = {}
    for name in ("torch", "cpu"):
        engine = engine_for(
            loaded,
            attention_backend=name,
            block_size=16,
            max_num_batched_tokens=48,
            long_prefill_token_threshold=23,
        )
        backend = engine.runner.attn_backend
        if name == "cpu":
            assert isinstance(backend, CpuKernelAttentionBackend)
            backend.vec_prefill = True
            backend.amx = False  # the vector kernel, on AMX machines too
        engine.generate(prompts[:1], params)  # fills the prefix cache with `shared`
        outs[name] = [c.token_ids for c in engine.generate(prompts, params)]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert outs["cpu"] == outs["torch"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX flags exist only on x86-64")
def test_the_avx2_build_passes_these_tests_too(isa_build):
    # The same tests in a fresh process on a build without AVX-512 (the 8-lane paths).
    if (built := isa_build("-mno-avx512f")) is None:
        return  # this CPU has nothing to narrow: the suite's own build is that one (checked)
    env, cache = built
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "not avx2_build"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert any(cache.glob("cpu_ops/*/built.ok"))  # the build it loaded
