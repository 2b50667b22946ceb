"""Fused RMSNorm(+residual) and RoPE kernels against the model's torch modules.

Interpreted without a GPU (tests/conftest.py), compiled on one."""

from __future__ import annotations

import pytest
import torch

from runner.model_config import ModelConfig
from runner.models.decoder import RMSNorm
from runner.models.rope import RotaryEmbedding
from runner.triton_ops import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def ops():
    from runner.triton_ops import norm_rope

    return norm_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_module(ops, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(DEVICE, dtype)
    x = torch.randn(5, 96, dtype=dtype, device=DEVICE) * 3
    expected = norm(x)
    got = ops.rms_norm(x, norm.weight, norm.eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # one bf16 ulp at |x| ~ 4
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_rms_norm_adds_the_residual_in_place(ops) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    x, residual = torch.randn(4, 64, device=DEVICE), torch.randn(4, 64, device=DEVICE)
    total = x + residual
    got = ops.rms_norm(x, norm.weight, norm.eps, residual=residual)
    torch.testing.assert_close(residual, total)
    torch.testing.assert_close(got, norm(total), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_module(ops, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=9 * 24,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=24,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
    )
    rope = RotaryEmbedding(cfg, 300).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 299, 77, 1], device=DEVICE)
    q = torch.randn(5, 9, 24, dtype=dtype, device=DEVICE)
    k = torch.randn(5, 3, 24, dtype=dtype, device=DEVICE)
    q_ref, k_ref = rope(positions, q, k)
    ops.apply_rope_(q, positions, rope.cos, rope.sin)
    ops.apply_rope_(k, positions, rope.cos, rope.sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
