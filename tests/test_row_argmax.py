"""The kernels' row_argmax against torch.argmax: ties, NaN, -inf, tails, bf16."""

import pytest
import torch

from runner.cpu_ops import load_cpu_ops
from runner.sampler import row_argmax


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"


def op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.headrace.row_argmax(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1, 7, 8, 15, 16, 17, 33, 1000, 49152])
def test_random_rows_match_argmax(dtype, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(9, width, generator=g) * 4).to(dtype)
    assert torch.equal(op(x), x.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ties_nan_and_infinities_as_argmax(dtype):
    x = torch.randn(10, 100)
    x[0, :] = 0.0  # all tied: index 0
    x[1, 40] = x[1, 90] = 50.0  # a tie in different lanes: the first
    x[2, 33] = x[2, 49] = 50.0  # a tie in the same lane of two vectors: the first
    x[3, 97] = 50.0  # the maximum in the tail past the last whole vector
    x[4, 5] = float("nan")  # a NaN wins over any number
    x[5, 60] = float("nan")
    x[5, 20] = float("nan")  # the first NaN, in another lane
    x[5, 3] = float("inf")
    x[6, :] = float("-inf")  # a grammar that masked everything: index 0
    x[7, :] = float("-inf")
    x[7, 77] = -1e30
    x[8, 99] = float("nan")  # NaN only in the tail
    x[9, 0] = float("inf")
    x = x.to(dtype)
    got = op(x)
    assert torch.equal(got, x.float().argmax(-1))
    assert got[:6].tolist() == [0, 40, 33, 97, 5, 20] and got[8].item() == 99


def test_strided_rows_and_refusals():
    x = torch.randn(6, 300)[:, ::3]  # not contiguous
    assert torch.equal(op(x), x.argmax(-1))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op(torch.randn(2, 10, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[N, V\]"):
        op(torch.randn(10))
    with pytest.raises(RuntimeError, match=r"\[N, V\]"):
        op(torch.randn(3, 0))


def test_the_sampler_takes_the_kernel_and_keeps_argmax_order():
    x = torch.randn(32, 49152)
    x[3, 100] = x[3, 20_000] = x.max() + 1
    assert torch.equal(row_argmax(x), x.argmax(-1)) and row_argmax(x)[3].item() == 100
    # Where the kernel does not apply (fp64, one row as a vector), torch's max answers.
    assert torch.equal(row_argmax(x.double()), x.argmax(-1))
    assert row_argmax(x[3]).item() == 100
