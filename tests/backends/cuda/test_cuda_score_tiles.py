"""The CUDA kernels' constant tiles (attention/common.cuh: const_bias): where a relative table is
beyond its clip or a span on its flat part over a whole tile, the forward, the dK/dV and the dQ
passes add the terms as one number instead of per element. Checked through the host emulation:
against the float64 oracle on shapes with such tiles, and bitwise against the per-element path,
which a dense bias of zeros forces (it is never constant and adds exactly 0), forward, backward and
the table's / span's gradients. csrc/emu/mutate.py holds mutations of the constant path that these
tests catch (the path is taken)."""
import shutil

import pytest
import torch

import effattn
from effattn.bias import Relative, Span
from tests.core.test_score import check

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]

# 64-row / 64-key tiles: at L = 200 the key tiles two behind a query tile are beyond a table's clip
# of 8, and for a span of 150 the tiles up to one behind are on its flat part
SHAPE = (1, 2, 1, 200, 200, 16)


def _terms(kind, g):
    if kind == "relative":
        return [Relative(torch.randn(2, 17, generator=g), max_distance=8)]
    if kind == "relative-past":
        return [Relative(torch.randn(2, 9, generator=g), max_distance=8, bidirectional=False)]
    if kind == "span":
        return [Span(torch.tensor([150.0, 20.5]), ramp=8, max_span=160.0)]
    return [Relative(torch.randn(2, 17, generator=g), max_distance=8), Span(torch.tensor([150.0, 140.0]), ramp=8,
                                                                              max_span=160.0)]


def _grads(q, k, v, terms, mode, zero_dense: bool):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    params = [p.detach().clone().requires_grad_() for t in terms for p in t.params()]
    it = iter(params)
    bias = [t.with_params(*[next(it) for _ in t.params()]) for t in terms]
    if zero_dense:
        bias.append(torch.zeros(1, 1, 1, 1))                    # never constant: every tile per element
    out, lse = effattn.attention(*leaves, return_lse=True, bias=bias, backend="cuda", **mode)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return (out, lse) + torch.autograd.grad((out * go).float().sum(), leaves + params)


@pytest.mark.parametrize("kind", ["relative", "relative-past", "span", "both"])
@pytest.mark.parametrize("mode", [dict(causal=True), {}], ids=["causal", "full"])
def test_constant_tiles_bitwise_equal_to_per_element(kind, mode):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Lq, Lk, D = SHAPE
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(torch.bfloat16) for h, n in ((H, Lq), (Hkv, Lk), (Hkv, Lk)))
    terms = _terms(kind, g)
    fast, slow = _grads(q, k, v, terms, mode, False), _grads(q, k, v, terms, mode, True)
    names = ["out", "lse", "dq", "dk", "dv"] + [f"dparam{i}" for i in range(len(fast) - 5)]
    for name, a, b in zip(names, fast, slow):
        assert torch.equal(a, b), f"{name}: the constant tiles differ from the per-element path"


@pytest.mark.parametrize("kind", ["relative", "span"])
def test_constant_tiles_against_float64(kind):
    check(SHAPE, kind if kind == "relative" else "span-far", dict(causal=True), torch.bfloat16, backend="cuda")


@pytest.fixture(autouse=True)
def _far_span(monkeypatch):
    """`check`'s "span-far": spans whose flat part covers whole 64 x 64 tiles."""
    from tests.core import test_score
    base = test_score._terms

    def terms(kind, *a):
        if kind == "span-far":
            return dict(bias=Span(torch.tensor([150.0, 20.5], dtype=torch.float64), ramp=8, max_span=160.0)), {}
        return base(kind, *a)
    monkeypatch.setattr(test_score, "_terms", terms)


def test_bidirectional_span_is_named_not_served():
    """The CUDA kernels bound a span on the past side only: a bidirectional span is a reason in
    explain, and auto dispatch goes elsewhere (never a silent wrong answer)."""
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    span = Span(torch.tensor([2.0, 3.0]), ramp=2, max_span=4.0, bidirectional=True)
    e = effattn.explain(q, q, q, backend="cuda", bias=span)
    assert any("bidirectional adaptive span" in r for r in e.reasons["cuda"])
    with pytest.raises((ValueError, RuntimeError), match="bidirectional adaptive span"):
        effattn.attention(q, q, q, backend="cuda", bias=span)
    one_sided = effattn.explain(q, q, q, backend="cuda", bias=Span(torch.tensor([2.0, 3.0]), ramp=2, max_span=4.0))
    assert not one_sided.reasons.get("cuda")
