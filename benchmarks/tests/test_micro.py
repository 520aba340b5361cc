"""Micro-benchmarks of the effattn kernels (pytest-benchmark): one small forward call each.

    python -m pytest benchmarks/tests/test_micro.py --benchmark-enable      # real timings
    python -m pytest benchmarks/tests/test_micro.py                         # each body once, as a test

CI runs them as plain tests (the project's pytest addopts carry --benchmark-disable). backend="auto": Triton or CUDA on a GPU, the torch
reference on CPU.
"""
import pytest
import torch

import effattn
from effattn import layouts

pytest.importorskip("pytest_benchmark")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
B, H, L, D = (2, 8, 1024, 64) if DEVICE.type == "cuda" else (1, 2, 256, 32)


def _inputs():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    return [torch.randn(B, H, L, D, generator=g, device=DEVICE, dtype=DTYPE) for _ in range(3)]


def _timed(fn):
    """``fn`` plus a device sync, so a GPU call is timed to completion."""
    if DEVICE.type != "cuda":
        return fn

    def synced():
        out = fn()
        torch.cuda.synchronize()
        return out
    return synced


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_micro_attention_fwd(benchmark, causal):
    q, k, v = _inputs()
    out = benchmark(_timed(lambda: effattn.attention(q, k, v, causal=causal)))
    assert out.shape == (B, H, L, D) and torch.isfinite(out).all()


def test_micro_attention_window_fwd(benchmark):
    q, k, v = _inputs()
    out = benchmark(_timed(lambda: effattn.attention(q, k, v, causal=True, window=L // 8)))
    assert torch.isfinite(out).all()


def test_micro_attention_layout_fwd(benchmark):
    q, k, v = _inputs()
    lay = layouts.sliding_and_summary(L, 64, local_blocks=2, every=4).to(DEVICE)
    out = benchmark(_timed(lambda: effattn.attention(q, k, v, causal=True, layout=lay)))
    assert torch.isfinite(out).all()


def test_micro_linear_attention_fwd(benchmark):
    q, k, v = _inputs()
    out = benchmark(_timed(lambda: effattn.linear_attention(q, k, v, causal=True)))
    assert out.shape == (B, H, L, D) and torch.isfinite(out).all()
