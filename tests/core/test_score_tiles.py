"""The score-terms kernels' constant-tile path (tiles where every term is constant: beyond a relative
table's clip, inside an adaptive span's flat part) and the bidirectional adaptive span.

The constant path must be taken (`TileProbe.count`: the kernels count the tiles that took it) and
give the same bits as the elementwise path (`TileProbe.fast = False`), forward and backward,
parameter gradients included; the bidirectional span is checked against the float64 oracle."""
import pytest
import torch

import effattn
from effattn.bias import ALiBi, Relative, Span
from effattn.testing.oracle import score_attention
from tests.conftest import DEVICE, op_backends, random_qkv
from tests.core.test_score import _leaves

KERNELS = [b for b in op_backends("attention") if b in ("triton",)]
pytestmark = pytest.mark.skipif(not KERNELS, reason="no Triton")


@pytest.fixture
def probe():
    from effattn.backends.triton.attention.score import TileProbe
    saved = (TileProbe.fast, TileProbe.count)
    TileProbe.count, TileProbe.counts = True, {}
    yield TileProbe
    TileProbe.fast, TileProbe.count = saved
    TileProbe.counts = {}


def _run(shape, terms, kw, seed=0):
    """(out, lse, dq, dk, dv, *parameter gradients) of one call on the Triton kernels."""
    B, H, Hkv, Lq, Lk, D = shape
    torch.manual_seed(seed)                           # the dropout seed each call draws
    g = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, D, g, torch.float32)
    kw32, params, _, _ = _leaves(terms, torch.float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, return_lse=True, backend="triton", **kw, **kw32)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad((out * go).sum(), leaves + params)
    return (out, lse) + tuple(grads)


def _both_paths(probe, shape, terms, kw):
    """Runs the call with the constant-tile path and without; asserts the same bits everywhere and
    returns the per-program counts of constant tiles of the first run (fwd, bwd)."""
    probe.fast = True
    fast = _run(shape, terms, kw)
    counts = {n: c.clone() for n, c in probe.counts.items()}
    probe.fast = False
    slow = _run(shape, terms, kw)
    assert int(probe.counts["fwd"].sum()) == 0 and int(probe.counts["bwd"].sum()) == 0
    names = ["out", "lse", "dq", "dk", "dv"] + [f"dparam{i}" for i in range(len(fast) - 5)]
    for name, a, b in zip(names, fast, slow):
        assert torch.equal(a, b), f"{name}: the constant-tile path differs from the elementwise path"
    return counts


H = 2


def _cases():
    r = lambda *s: torch.randn(*s, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    z = torch.tensor([9.0, 40.5], dtype=torch.float64)      # head 1: whole 16 x 16 tiles on the flat part
    return {
        "relative": dict(bias=Relative(r(H, 2 * 8 + 1), max_distance=8)),
        "relative-past": dict(bias=Relative(r(H, 6), max_distance=5, bidirectional=False)),
        "span": dict(bias=Span(z, ramp=4, max_span=48.0)),
        "span-bidirectional": dict(bias=Span(z, ramp=4, max_span=48.0, bidirectional=True)),
        "softcap-sinks": dict(softcap=2.0, sinks=r(H)),
        "all-constant-kinds": dict(softcap=2.0, sinks=r(H), bias=[Relative(r(H, 9), max_distance=4),
                                                                  Span(z, ramp=3, max_span=48.0)]),
    }


MODES = {"causal": dict(causal=True), "full": {}, "window": dict(window=(50, 20))}


@pytest.mark.parametrize("kind,mode", [("relative", "causal"), ("relative", "full"), ("relative-past", "window"),
                                       ("span", "causal"), ("span-bidirectional", "full"),
                                       ("span-bidirectional", "window"), ("softcap-sinks", "causal"),
                                       ("all-constant-kinds", "full")])
def test_constant_tiles_taken_and_bitwise_equal(probe, kind, mode):
    """GQA, Lq < Lk: the constant path is taken in the forward and in both backward program kinds,
    and changes no bit of the outputs or of any gradient."""
    counts = _both_paths(probe, (1, H, 1, 48, 64, 8), _cases()[kind], MODES[mode])
    assert int(counts["fwd"].sum()) > 0, "no forward tile took the constant path"
    n_kv = 64 // 16                                       # the interpreter's 16 x 16 tiles, one kv head
    assert int(counts["bwd"][:n_kv].sum()) > 0 and int(counts["bwd"][n_kv:].sum()) > 0


def test_constant_tiles_with_dropout(probe):
    _both_paths(probe, (1, H, 2, 64, 64, 8), dict(bias=Relative(torch.randn(H, 7, dtype=torch.float64),
                                                                max_distance=3)), dict(dropout_p=0.3))


def test_constant_tile_count_is_exact(probe):
    """Without a window every tile is whole: the forward's constant tiles are exactly the (query
    tile, key tile) pairs whose distances all clamp to one table entry."""
    M, L, T = 8, 64, 16
    counts = _both_paths(probe, (1, H, 2, L, L, 8), dict(bias=Relative(torch.randn(H, 2 * M + 1,
                                                                                   dtype=torch.float64),
                                                                       max_distance=M)), {})
    want = []
    for mt in range(L // T):
        d_hi = [mt * T + T - 1 - nt * T for nt in range(L // T)]
        d_lo = [mt * T - (nt * T + T - 1) for nt in range(L // T)]
        want.append(sum(min(max(a, -M), M) == min(max(b, -M), M) for a, b in zip(d_lo, d_hi)))
    assert counts["fwd"].tolist() == want * H



@pytest.mark.parametrize("kind,mode", [("relative", "full"), ("span-bidirectional", "window"),
                                       ("all-constant-kinds", "causal")])
def test_constant_tiles_on_packed_sequences(probe, kind, mode):
    """Packed sequences (cu_seqlens: the (segment, tile) work lists) take the constant path in each
    segment's coordinates, in the forward and both backward program kinds, with the same bits as the
    elementwise path."""
    cu = (torch.tensor([0, 40, 88], dtype=torch.int32, device=DEVICE),
          torch.tensor([0, 40, 96], dtype=torch.int32, device=DEVICE))
    counts = _both_paths(probe, (1, H, 1, 88, 96, 8), _cases()[kind], dict(MODES[mode], cu_seqlens=cu))
    assert int(counts["fwd"].sum()) > 0, "no forward tile took the constant path"
    n_kv = 3 + 4                                          # key work items of 16: 40 and 56 keys, one kv head
    assert int(counts["bwd"][:n_kv].sum()) > 0 and int(counts["bwd"][n_kv:].sum()) > 0

@pytest.mark.parametrize("kind", ["alibi", "dense"])
def test_terms_that_vary_take_no_constant_tile(probe, kind):
    bias = ALiBi(torch.rand(H, dtype=torch.float64)) if kind == "alibi" else torch.randn(64, dtype=torch.float64)
    _run((1, H, 2, 64, 64, 8), dict(bias=bias), dict(causal=True))
    assert int(probe.counts["fwd"].sum()) == 0 and int(probe.counts["bwd"].sum()) == 0


def test_explain_describes_the_constant_tiles():
    q = torch.randn(1, H, 32, 8, device=DEVICE)
    ok = effattn.explain(q, q, q, causal=True, bias=Relative(torch.zeros(H, 5, device=DEVICE), max_distance=2),
                         backend="triton")
    assert "unmasked with one scalar added" in str(ok)
    no = effattn.explain(q, q, q, causal=True, bias=ALiBi(torch.ones(H, device=DEVICE)), backend="triton")
    assert "masked elementwise (ALiBi)" in str(no)


# ----------------------------------------------------------------------------- bidirectional span

@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
@pytest.mark.parametrize("mode", [{}, dict(window=(30, 6)), dict(causal=True)], ids=["full", "window", "causal"])
def test_bidirectional_span_matches_oracle(backend, mode):
    """Keys on both sides beyond each head's span are invisible; dz from both sides' ramps."""
    B, Hh, Lq, Lk = 1, 4, 37, 45
    g = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(B, Hh, 2, Lq, Lk, 8, 8, g, torch.float32)
    z = torch.tensor([2.5, 7.0, 15.2, 30.0], dtype=torch.float64, device=DEVICE)
    zs = z.float().requires_grad_()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, return_lse=True, backend=backend, **mode,
                                 bias=Span(zs, ramp=4, max_span=32.0, bidirectional=True))
    z64 = z.clone().requires_grad_()
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = score_attention(*ref_leaves, **mode, bias=Span(z64, ramp=4, max_span=32.0, bidirectional=True))
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    gs = torch.autograd.grad((out * go).sum(), leaves + [zs])
    rs = torch.autograd.grad((ref * go.double()).sum(), ref_leaves + [z64])
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=2e-5, rtol=1e-4)
    for name, a, b in zip(["dq", "dk", "dv", "dz"], gs, rs):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)
    # the span is symmetric: a future key beyond it changes nothing
    one_sided, _ = score_attention(*[t.detach().double() for t in (q, k, v)], **mode,
                                   bias=Span(z, ramp=4, max_span=32.0))
    if not mode.get("causal"):
        assert not torch.allclose(one_sided, ref)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_bidirectional_span_gradient_bitwise_repeatable(backend):
    g = torch.Generator().manual_seed(3)
    q, k, v = random_qkv(1, 4, 4, 33, 33, 8, 8, g, torch.float32)

    def run():
        z = torch.tensor([1.0, 4.5, 9.0, 20.0], device=DEVICE, requires_grad=True)
        out = effattn.attention(q, k, v, bias=Span(z, ramp=4, max_span=24.0, bidirectional=True), backend=backend)
        return torch.autograd.grad(out.square().sum(), z)[0]
    assert torch.equal(run(), run())


def test_bidirectional_span_bounds_both_sides_of_the_window():
    """The launcher folds the span's horizon ceil(max_span + ramp) into both window bounds (the
    kernels tighten them per head), so key tiles beyond it on either side are never visited; a
    one-sided span bounds the past only."""
    from effattn.backends.triton.attention.score import _common
    from effattn.score import make_score_terms
    q = torch.randn(1, 2, 64, 8)
    for bidir, right in ((True, 7), (False, 0)):
        score = make_score_terms("attention", q, q, bias=Span(torch.tensor([3.0, 5.0]), ramp=2, max_span=6.0,
                                                               bidirectional=bidir))
        _, meta, args = _common(q, q, q, None, 0, None, 0.125, 0.0, -1, -1 if bidir else 0, score)
        assert (args["left"], args["right"], meta["HAS_LEFT"], meta["HAS_RIGHT"]) == (7, right, True, True)


def test_bidirectional_span_validation():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="Span.bidirectional"):
        effattn.attention(q, q, q, bias=Span(torch.zeros(2), ramp=2, max_span=4.0, bidirectional=1))
