"""The Triton backend inside the engine (interpreter on CPU) and the backend choice."""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import engine_for, make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.attention_backends import TorchAttentionBackend, select_attention_backend
from runner.triton_ops import triton_available
from scheduling import SamplingParams

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def test_torch_reference_by_name_and_bad_names() -> None:
    # auto on the CPU takes the C++ kernels when they build (tests/test_cpu_ops.py).
    assert isinstance(
        select_attention_backend(torch.device("cpu"), 2, "torch"), TorchAttentionBackend
    )
    with pytest.raises(ValueError, match="attention_backend: 'flash'"):
        select_attention_backend(torch.device("cpu"), 2, "flash")


@needs_triton
def test_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention_backend(torch.device("cpu"), 2, "triton")


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["model", "int8"])
def test_engine_on_triton_backend_matches_torch_backend(tmp_path, kv_cache_dtype) -> None:
    """Greedy output of a tiny Qwen3 (head_dim 24, GQA 4/2) with chunked prefill, a prefix-
    cache hit and mixed steps: identical through the Triton kernels (interpreted on CPU)
    and the reference, on rows of the model's dtype and on int8 rows."""
    make_tiny_hf_model("qwen3", tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = LoadedModel.load(EngineConfig(model=str(tmp_path), device=device, dtype="float32"))
    rng = random.Random(0)
    shared = [rng.randrange(3, 320) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 1)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cfg = dict(block_size=16, max_num_batched_tokens=16, kv_cache_memory=1 << 20,
               kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    reference = engine_for(loaded, attention_backend="torch", **cfg)
    expected = [c.token_ids for c in reference.generate(prompts, params)]
    engine = engine_for(loaded, attention_backend="triton", **cfg)
    assert engine.runner.attn_backend.name == "triton"
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    loaded.model.set_attention_backend(TorchAttentionBackend())  # the model is shared
    assert got == expected
