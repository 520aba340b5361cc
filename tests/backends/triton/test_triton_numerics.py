"""Triton's fp32 -> TF32 rounding (effattn.backends.triton.jit.round_tf32), run in the interpreter.

At TF32 precision the tensor cores truncate fp32 operands; the kernels round them to nearest first so
that their TF32 error is unbiased, as cuBLAS's is (the fp32-with-TF32 GPU tests compare against it).
"""
import pytest
import torch

from effattn.backends.triton.runtime import _available

pytestmark = pytest.mark.skipif(_available(torch.device("cpu")) is not None, reason="Triton cannot run here")


triton = pytest.importorskip("triton")
tl = triton.language
from effattn.backends.triton.jit import round_tf32  # noqa: E402


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, round_tf32(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def _rounded(x):
    y = torch.full_like(x, float("nan"))
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y


def test_round_tf32_gives_the_nearest_tf32_value():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    x = torch.cat([x, torch.tensor([1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11), 1.0 + 3 * 2.0 ** -12, 0.0, -0.0,
                                    float("inf"), float("-inf"), 3.0e38])])
    y = _rounded(x)
    bits = y.view(torch.int32)
    finite = torch.isfinite(x)
    assert torch.all((bits[finite] & 0x1FFF) == 0), "more than 10 mantissa bits left"
    lo = (x.view(torch.int32) & -8192).view(torch.float32).double()      # the truncation (toward zero)
    ulp = torch.ldexp(torch.ones_like(lo), torch.frexp(x.double())[1] - 11)
    hi = lo + torch.sign(x.double()) * ulp                                 # the next TF32 value away from zero
    err = (y.double() - x.double()).abs()
    best = torch.minimum((lo - x.double()).abs(), (hi - x.double()).abs())
    ok = finite & torch.isfinite(y)
    assert torch.all(err[ok] <= best[ok]), "not the nearest TF32 value"
    assert torch.equal(torch.sign(y[finite]), torch.sign(x[finite]))
    assert y[-3] == float("inf") and y[-2] == float("-inf") and torch.isnan(_rounded(torch.tensor([float("nan")]))).all()
    # unbiased where truncation is not: positive values (like softmax probabilities)
    p = torch.rand(1 << 16, generator=g) + 0.5
    bias_round = ((_rounded(p).double() - p.double()) / p.double()).mean().abs().item()
    bias_trunc = (((p.view(torch.int32) & -8192).view(torch.float32).double() - p.double()) / p.double()).mean().abs().item()
    assert bias_trunc > 2e-4 and bias_round < bias_trunc / 20
