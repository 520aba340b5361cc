"""Score terms (softcap, sinks, bias: ALiBi, Relative tables, adaptive span, dense tensors) against
the float64 oracle (effattn/testing/oracle.py: score_attention), forward and backward including the terms'
parameter gradients, alone and combined with causal / window / layout / GQA / padding; their
determinism, validation and what `explain` says for backends that lack them."""
import math

import pytest
import torch

import effattn
from effattn import score as score_mod
from effattn.bias import ALiBi, Relative, Span, alibi_slopes, t5_bucket_index
from effattn.layouts import BlockLayout
from effattn.testing.oracle import score_attention
from tests.conftest import DEVICE, op_backends, random_qkv

FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _terms(kind, B, H, Lq, Lk, g):
    """(kwargs of attention, the leaf tensors whose gradients are checked) for a term kind."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    if kind == "softcap":
        return dict(softcap=1.5), {}
    if kind == "sinks":
        return dict(sinks=r(H)), {"sinks": None}
    if kind == "alibi":
        return dict(bias=ALiBi(alibi_slopes(H).double() + 0.05 * r(H))), {"slopes": None}
    if kind == "alibi-BH":
        return dict(bias=ALiBi(torch.rand(B, H, generator=g, dtype=torch.float64))), {"slopes": None}
    if kind == "relative":
        return dict(bias=Relative(r(H, 2 * 6 + 1), max_distance=6)), {"table": None}
    if kind == "relative-past":
        return dict(bias=Relative(r(H, 5 + 3), max_distance=5, bidirectional=False)), {"table": None}
    if kind == "span":
        z = torch.tensor([2.3, 7.6, 0.4, 11.1], dtype=torch.float64)[:H]
        return dict(bias=Span(z, ramp=4, max_span=12.0)), {"z": None}
    if kind == "span-per-head":     # spans far apart: each head's kernels skip different key tiles
        z = torch.tensor([14.5, 30.0, 3.0, 57.2], dtype=torch.float64)[:H]   # head 0: row 16 sees key 15 (d = 18)
        return dict(bias=Span(z, ramp=4, max_span=60.0)), {"z": None}
    if kind == "dense":
        return dict(bias=r(1, H, Lq, Lk)), {"dense": None}
    if kind == "dense-bcast":
        return dict(bias=r(Lk)), {"dense": None}
    if kind in ("all", "all-packed"):     # all-packed: no dense bias (refused with cu_seqlens)
        z = torch.full((H,), 5.5, dtype=torch.float64)
        return dict(softcap=3.0, sinks=r(H), bias=[ALiBi(0.1 * torch.rand(H, generator=g, dtype=torch.float64)),
                                                   Relative(r(H, 9), max_distance=4), Span(z, ramp=3, max_span=9)]
                    + ([r(B, 1, Lq, 1)] if kind == "all" else [])), {}
    raise KeyError(kind)


def _leaves(kw, dtype):
    """Detached copies of every tensor in kw (score terms rebuilt over them) that require grad, in
    float32 for the kernel call (the parameters' dtype) and float64 for the oracle."""
    def conv(x, dt, out):
        if isinstance(x, torch.Tensor):
            t = x.detach().to(dt).to(DEVICE).requires_grad_()
            out.append(t)
            return t
        if isinstance(x, (list, tuple)):
            return [conv(y, dt, out) for y in x]
        if hasattr(x, "params"):
            return x.with_params(*[conv(p, dt, out) for p in x.params()])
        return x
    a, b = [], []
    kw32 = {n: conv(x, torch.float32 if dtype != torch.float64 else torch.float64, a) for n, x in kw.items()}
    kw64 = {n: conv(x, torch.float64, b) for n, x in kw.items()}
    return kw32, a, kw64, b


def judge(got, ref, naive, mult, dtype, what):
    assert not torch.isnan(got).any(), f"{what}: NaN"
    err = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    nerr = (naive.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    assert err <= mult * nerr + FLOOR[dtype], f"{what}: error {err:.3g} > {mult}x naive {nerr:.3g} + floor"


def check(shape, kind, base_kw, dtype, backend="torch", seed=0, transposed=False):
    B, H, Hkv, Lq, Lk, D = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, D, g, dtype, transposed=transposed)
    terms, _ = _terms(kind, B, H, Lq, Lk, g)
    kw = dict(base_kw)
    if "key_padding_mask" in kw:
        kw["key_padding_mask"] = kw["key_padding_mask"].to(DEVICE)
    kw32, p32, kw64, p64 = _leaves(terms, dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, return_lse=True, backend=backend, **kw, **kw32)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = score_attention(*ref_leaves, **kw, **kw64)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    # a gradient into lse too (rows with a finite lse): it enters the backward as -dlse in Delta
    gl = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    fin_l = torch.isfinite(ref_lse)

    def loss(o, l, g_o):
        return (o * g_o).sum() + (torch.where(fin_l, l, torch.zeros_like(l)) * gl.to(l.dtype)).sum()

    grads = torch.autograd.grad(loss(out, lse, go), leaves + p32)
    ref_grads = torch.autograd.grad(loss(ref, ref_lse, go.double()), ref_leaves + p64)
    if dtype == torch.float64:
        for name, a, b in zip(["out", "dq", "dk", "dv"] + [f"dparam{i}" for i in range(len(p32))],
                              (out,) + grads, (ref,) + ref_grads):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=name)
    else:
        low_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        kwl, pl, _, _ = _leaves(terms, dtype)
        low, low_lse = score_attention(*low_leaves, dtype=dtype, **kw, **kwl)
        low_grads = torch.autograd.grad(loss(low, low_lse, go), low_leaves + pl)
        judge(out, ref, low, 2, dtype, "out")
        for i, (a, b, c) in enumerate(zip(grads, ref_grads, low_grads)):
            judge(a, b, c, 3, dtype, f"grad {i}")
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(ref_lse).cpu())
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= (1e-9 if dtype == torch.float64 else 1e-3)
    for p, gp in zip(p32, grads[3:]):
        assert gp.dtype == p.dtype and gp.shape == p.shape


KINDS = ["softcap", "sinks", "alibi", "alibi-BH", "relative", "relative-past", "span", "dense", "dense-bcast", "all"]
MODES = {
    "dense": ((2, 2, 2, 21, 21, 8), {}),
    "causal": ((1, 2, 2, 19, 19, 8), dict(causal=True)),
    "causal-Lq<Lk": ((1, 2, 2, 7, 23, 8), dict(causal=True)),
    "causal-Lq>Lk-empty": ((1, 2, 2, 20, 9, 8), dict(causal=True)),
    "window": ((1, 2, 2, 24, 24, 8), dict(window=(5, 3))),
    "gqa": ((2, 4, 2, 17, 17, 8), dict(causal=True)),
    "kpm": ((2, 2, 2, 16, 16, 8), dict(key_padding_mask=torch.tensor([[False] * 10 + [True] * 6, [True] * 16]))),
    "layout": ((1, 2, 2, 32, 32, 8), dict(layout=BlockLayout(torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0],
                                                                             [0, 0, 1, 0], [1, 0, 1, 1]]]).bool(),
                                                                8))),
}


# the kernels under test besides the float64 torch reference (Triton in its interpreter on the CPU)
KERNELS = [b for b in op_backends("attention") if b in ("triton",)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_torch_float64_matches_oracle(kind, mode):
    shape, kw = MODES[mode]
    check(shape, kind, kw, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["all", "relative", "span", "sinks"])
def test_torch_low_precision_rule(kind, dtype):
    check((2, 4, 2, 19, 23, 16), kind, dict(causal=True), dtype)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kind,mode", [(k, "causal") for k in KINDS] + [("all", m) for m in MODES if m != "causal"])
def test_kernels_match_oracle(backend, kind, mode):
    shape, kw = MODES[mode]
    check(shape, kind, kw, torch.float32, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("mode", [dict(causal=True), dict(window=(40, 5)), {}])
def test_span_per_head_tile_skipping(backend, mode):
    """Each head visits only the key tiles within its own span z[h] + ramp (the kernels tighten the
    call's horizon per head): heads whose spans end in different tiles, GQA (a dK/dV program walks
    each of its query heads' ranges), Lq < Lk (bottom-right offset), against the oracle incl. dz."""
    check((1, 4, 2, 53, 70, 8), "span-per-head", mode, torch.float32, backend=backend)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_transposed_views(backend):
    """(B, L, H, D) tensors seen as (B, H, L, D): non-contiguous q, k, v."""
    check((2, 4, 2, 18, 18, 8), "all", dict(causal=True), torch.float32, backend=backend, transposed=True)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_empty_shapes(backend):
    for Lq, Lk in ((0, 5), (5, 0)):
        q = torch.randn(1, 2, Lq, 4, device=DEVICE, requires_grad=True)
        k, v = (torch.randn(1, 2, Lk, 4, device=DEVICE, requires_grad=True) for _ in range(2))
        sinks = torch.zeros(2, device=DEVICE, requires_grad=True)
        tab = torch.zeros(2, 5, device=DEVICE, requires_grad=True)
        out, lse = effattn.attention(q, k, v, sinks=sinks, softcap=1.0, bias=Relative(tab, max_distance=2),
                                     return_lse=True, backend=backend)
        assert out.shape == (1, 2, Lq, 4) and torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.zeros_like(lse))                   # the sink logit, 0
        grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v, sinks, tab), allow_unused=True)
        assert all(g is None or not torch.isnan(g).any() for g in grads)
        assert torch.equal(grads[3], torch.full((2,), float(Lq), device=DEVICE))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_low_precision(backend, dtype):
    check((1, 4, 2, 19, 23, 16), "all", dict(causal=True), dtype, backend=backend)


def test_many_blocks_match(monkeypatch):
    """Several query blocks (the relative table's diagonal sums and the dense gradient per block)."""
    monkeypatch.setattr(score_mod, "SCORE_BUDGET", 64)
    for kind in ("all", "relative", "relative-past", "dense", "span"):
        check((1, 2, 2, 37, 41, 8), kind, dict(window=(9, 2)), torch.float64, seed=3)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_parameter_gradients_bitwise_repeatable(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(1, 4, 2, 21, 21, 16, 16, g, torch.float32)
    terms, _ = _terms("all", 1, 4, 21, 21, g)

    def run():
        kw, ps, _, _ = _leaves(terms, torch.float32)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, causal=True, backend=backend, **kw)
        return torch.autograd.grad(out.square().sum(), leaves + ps)

    a, b = run(), run()
    assert len(a) == 3 + 5                   # q, k, v, sinks, slopes, table, z, dense
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert x.dtype == torch.float32


def test_sinks_rows_seeing_nothing():
    """With sinks a row that sees no key outputs 0 and its lse is its sink logit; sink gradients there."""
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, device=DEVICE) for _ in range(3))
    kpm = torch.ones(1, 6, dtype=torch.bool, device=DEVICE)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, device=DEVICE, requires_grad=True)
    out, lse = effattn.attention(q, k, v, key_padding_mask=kpm, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.detach()[None, :, None].expand(1, 2, 6))
    (gs,) = torch.autograd.grad(lse.sum(), sinks)
    assert torch.equal(gs, torch.full_like(gs, 6.0))


def test_span_hides_keys_and_softcap_bounds_scores():
    L = 40
    q, k, v = (torch.randn(1, 2, L, 8, device=DEVICE) for _ in range(3))
    z = torch.tensor([0.0, 3.0], device=DEVICE)
    v_eye = torch.eye(L, device=DEVICE).expand(1, 2, L, L)
    p = effattn.attention(q, k, v_eye, causal=True, bias=Span(z, ramp=2, max_span=10))
    d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    assert (p[0, 0][(d >= 2) | (d < 0)] == 0).all() and (p[0, 0][(d >= 0) & (d < 2)] > 0).all()
    assert (p[0, 1][(d >= 5) | (d < 0)] == 0).all() and (p[0, 1][(d >= 0) & (d < 5)] > 0).all()
    big = effattn.attention(q * 100, k * 100, v_eye, softcap=2.0)
    assert big.max() <= math.exp(4.0) / (math.exp(4.0) + (L - 1) * math.exp(-4.0)) + 1e-6


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_dropout_with_terms_matches_recovered_mask(backend):
    B, H, L, p = 1, 2, 24, 0.3
    dt = torch.float64 if backend == "torch" else torch.float32
    q, k = (torch.randn(B, H, L, 8, dtype=dt, device=DEVICE) for _ in range(2))
    eye = torch.eye(L, dtype=dt, device=DEVICE).expand(B, H, L, L).contiguous()
    kpm = torch.zeros(B, L, dtype=torch.bool, device=DEVICE)
    kpm[:, 3:5] = True
    r = lambda *shape: torch.randn(*shape, dtype=dt, device=DEVICE)
    kw = dict(causal=True, softcap=2.0, sinks=r(H), key_padding_mask=kpm, backend=backend,
              bias=[Relative(r(H, 9), max_distance=4), ALiBi(0.1 * r(H).abs()), r(1, H, L, L),
                    Span(torch.tensor([6.5, 20.0], dtype=dt, device=DEVICE), ramp=3, max_span=20)])
    torch.manual_seed(5)
    a = effattn.attention(q, k, eye, dropout_p=p, **kw)
    torch.manual_seed(5)
    assert torch.equal(a, effattn.attention(q, k, eye, dropout_p=p, **kw))
    okw = {n: x for n, x in kw.items() if n != "backend"}
    probs, _ = score_attention(q, k, eye, **okw)
    keep = a != 0
    assert 0.55 < keep[probs > 0].double().mean().item() < 0.85
    torch.testing.assert_close(a[keep].double(), probs[keep].double() / (1 - p), atol=1e-5, rtol=1e-4)
    v = torch.randn(B, H, L, 8, dtype=dt, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    out = effattn.attention(*leaves, dropout_p=p, **kw)
    rl = [t.clone().double().requires_grad_() for t in (q, k, v)]
    ref, _ = score_attention(*rl, dropout_keep=keep, dropout_p=p, **okw)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    go = torch.randn_like(out)
    for x, y in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double())):
        torch.testing.assert_close(x.double(), y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_in_unseen_key_with_every_term(backend, poison):
    """NaN / inf in the K and V rows of keys no query sees (beyond every head's span, padded) leave
    the output and every gradient (q, k, v, each term's tensor) as with finite values there, with
    every term on (softcap's tanh, the dense bias's and the table's gradients); those keys' own
    gradients are 0."""
    B, H, Lq, Lk, D = 1, 2, 6, 24, 8
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(DEVICE) for n in (Lq, Lk, Lk))
    terms, _ = _terms("all", B, H, Lq, Lk, g)                  # span 5.5 + ramp 3: keys 0..9 unseen
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=DEVICE)
    kpm[:, 20] = True
    bad = torch.zeros(Lk, dtype=torch.bool)
    bad[[5, 20]] = True
    kp, vp = k.clone(), v.clone()
    kp[:, :, bad], vp[:, :, bad] = poison, poison
    res = []
    for kk, vv in ((k, v), (kp, vp)):
        kw, ps, _, _ = _leaves(terms, torch.float32)
        leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
        out = effattn.attention(*leaves, causal=True, key_padding_mask=kpm, backend=backend, **kw)
        res.append((out,) + torch.autograd.grad(out.square().sum(), leaves + ps))
    assert len(res[1]) == 1 + 3 + 5
    for a, b in zip(*res):
        assert not b.isnan().any()
        assert torch.equal(a if a.shape[-2:] != (Lk, D) else a[:, :, ~bad], b if b.shape[-2:] != (Lk, D)
                           else b[:, :, ~bad])
    for gr in res[1][2:4]:
        assert bool((gr[:, :, bad] == 0).all())


def test_t5_bucket_index_reproduces_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    for bidirectional in (True, False):
        for nb, M in ((32, 128), (8, 20)):
            idx = t5_bucket_index(nb, M, bidirectional)
            L = M + 30
            d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
            want = t5.T5Attention._relative_position_bucket(-d, bidirectional=bidirectional, num_buckets=nb,
                                                            max_distance=M)
            col = d.clamp(-M, M) + M if bidirectional else d.clamp(0, M)
            assert torch.equal(idx[col], want)


def test_alibi_slopes_are_the_papers():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for n in (1, 3, 6, 12):
        mask = torch.ones(1, 5)
        ref = bloom.build_alibi_tensor(mask, n, torch.float32).view(n, 5)[:, 1]
        assert torch.allclose(alibi_slopes(n), ref), n


def _err(match, **kw):
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    with pytest.raises((ValueError, TypeError), match=match):
        effattn.attention(q, k, v, **kw)


def test_validation_errors_name_the_argument():
    _err("softcap must be a finite float > 0", softcap=0.0)
    _err("softcap must be a finite float > 0", softcap=float("inf"))
    _err("softcap must be a float", softcap="1")
    _err(r"sinks must have shape \(H,\)=\(2,\)", sinks=torch.zeros(3))
    _err("sinks must be a floating-point tensor", sinks=torch.zeros(2, dtype=torch.long))
    _err("sinks must be a", sinks=[0.0, 1.0])
    _err(r"ALiBi.slopes must have shape", bias=ALiBi(torch.ones(3)))
    _err("Relative.table has 5 entries per head, shorter than 2 \\* max_distance \\+ 1 = 9",
         bias=Relative(torch.zeros(2, 5), max_distance=4))
    _err("Relative.table has 4 entries per head, shorter than max_distance \\+ 1 = 5",
         bias=Relative(torch.zeros(2, 4), max_distance=4, bidirectional=False))
    _err("does not broadcast to", bias=torch.zeros(3, 8))
    _err("does not broadcast to", bias=torch.zeros(1, 2, 2, 8, 8))
    _err(r"Span.z must lie in \[0, max_span=4", bias=Span(torch.tensor([1.0, 5.0]), ramp=2, max_span=4))
    _err(r"Span.z must lie in", bias=Span(torch.tensor([-0.5, 1.0]), ramp=2, max_span=4))
    _err("Span.ramp must be > 0", bias=Span(torch.tensor([1.0, 1.0]), ramp=0, max_span=4))
    _err("bias must be a tensor, an effattn.bias term", bias=3.0)
    _err("bias is an empty list", bias=[])


def test_explain_names_the_missing_term():
    """The CUDA backend declares every score term (one relative table, span and dense bias per call:
    tests/backends/cuda/test_cuda_score.py); the Triton backend takes one term of each kind and
    explain says so for two."""
    from effattn.backends import base
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    e = effattn.explain(q, k, v, softcap=1.0, bias=ALiBi(torch.ones(2)))
    assert e.can_serve("torch") and "score terms" in e.paths["torch"]
    cuda = base._REGISTRY["attention"].get("cuda")
    if cuda is not None:
        assert base.SCORE_FEATURES <= cuda.paths[0].caps.features
        assert "does not support" not in "; ".join(cuda.reasons(effattn._call.make_attn_call(
            q, k, v, softcap=1.0, bias=[ALiBi(torch.ones(2)), Span(torch.ones(2), ramp=2, max_span=4)])))
    if KERNELS:
        two = [ALiBi(torch.ones(2)), ALiBi(torch.ones(2))]
        e = effattn.explain(q, k, v, bias=two)
        assert any("2 bias terms of kind ALiBi" in r for r in e.reasons["triton"])
        with pytest.raises(RuntimeError, match="2 bias terms of kind ALiBi"):
            effattn.attention(q, k, v, bias=two, backend="triton")


# ----------------------------------------------------------------------------------------- modules

def test_adaptive_span_trains_on_a_toy_task():
    """Copy the token `lag` positions back: the spans shrink from max_span under the span loss to
    about what the task needs, and the task is learned; the kernels honour the learned spans."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        L, H, D, lag, B = 32, 2, 8, 5, 4
        span = effattn.nn.AdaptiveSpan(H, max_span=24, ramp=4, init=1.0, loss_coeff=0.01)
        pos = torch.nn.Parameter(torch.randn(L, D) * 0.5)
        wq, wk = torch.nn.Linear(D, D * H), torch.nn.Linear(D, D * H)
        opt = torch.optim.Adam([pos, *wq.parameters(), *wk.parameters()], lr=0.03)
        opt_span = torch.optim.Adam(span.parameters(), lr=0.01)
        losses = []
        for _ in range(150):
            x = torch.randn(B, L, D)
            h = x + pos
            q = wq(h).view(B, L, H, D).transpose(1, 2)
            k = wk(h).view(B, L, H, D).transpose(1, 2)
            out = effattn.attention(q, k, x[:, None].expand(B, H, L, D), causal=True, bias=span())
            task = ((out.mean(1) - torch.roll(x, lag, 1))[:, lag:] ** 2).mean()
            opt.zero_grad()
            opt_span.zero_grad()
            (task + span.loss()).backward()
            opt.step()
            opt_span.step()
            span.clamp_()
            losses.append(task.item())
    finally:
        torch.set_num_threads(prev)
    spans = span.spans
    assert (spans < 8).all() and (spans + span.ramp > lag).all(), spans
    assert sum(losses[-10:]) / 10 < 0.3 * sum(losses[:10]) / 10
    # the learned spans are what the kernels apply: no weight beyond z + ramp
    eye = torch.eye(L).expand(1, H, L, L)
    with torch.no_grad():
        p = effattn.attention(torch.randn(1, H, L, D), torch.randn(1, H, L, D), eye, causal=True, bias=span())
    d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    for h in range(H):
        assert (p[0, h][d >= float(spans[h]) + span.ramp] == 0).all()


def test_t5_relative_bias_module_matches_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from transformers import T5Config
    cfg = T5Config(d_model=16, d_kv=4, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=20)
    for decoder in (False, True):
        cfg.is_decoder = decoder
        hf = t5.T5Attention(cfg, has_relative_attention_bias=True)
        mine = effattn.nn.T5RelativeBias(2, 8, 20, bidirectional=not decoder)
        mine.load_state_dict({"relative_attention_bias.weight": hf.relative_attention_bias.weight.detach()})
        L = 30
        want = hf.compute_bias(L, L)                                     # (1, H, L, L)
        term = mine()
        d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
        col = d.clamp(-20, 20) + 20 if not decoder else d.clamp(0, 20)
        torch.testing.assert_close(term.table[:, col][None], want)
        q, k, v = (torch.randn(1, 2, L, 4) for _ in range(3))
        out = effattn.attention(q, k, v, scale=1.0, causal=decoder, bias=term)
        vis = torch.ones(L, L, dtype=torch.bool) if not decoder else d >= 0
        ref = torch.softmax((q @ k.transpose(-1, -2) + want).masked_fill(~vis, -math.inf), -1) @ v
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        assert mine.relative_attention_bias.weight.grad is not None


def test_alibi_module():
    m = effattn.nn.ALiBi(4)
    assert not list(m.parameters()) and torch.equal(m().slopes, alibi_slopes(4))
    m = effattn.nn.ALiBi(4, learnable=True)
    assert list(m.parameters())[0].shape == (4,)


def test_score_kernels_compile_for_sm90_offline():
    """The interpreter skips Triton's compiler: compile the score-terms kernels with every term on
    for an H100 target (tools/triton/score_kernel_resources.py), plain and on packed sequences' work
    lists, so a GPU-only compile error fails CI."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(effattn.__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = ("from tools.triton.score_kernel_resources import compile_score_kernel\n"
            "for kind in ('fwd', 'bwd'):\n"
            "    for varlen in (False, True):\n"
            "        k = compile_score_kernel(90, kind, 64, 'bf16', 'all', varlen=varlen)\n"
            "    print(kind, k.metadata.shared)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1200)
    if "ASTSource" in proc.stderr and "unexpected keyword" in proc.stderr:
        pytest.skip("offline compilation not available with this triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("fwd ") and "\nbwd " in proc.stdout


def test_multihead_attention_position_bias():
    """MultiheadAttention(position_bias=...): the fused path (score terms) equals the dense reference
    path (need_weights=True, the terms' values materialized); the terms' parameters train; decoding
    with a cache token by token equals the full call (bottom-right positions)."""
    torch.manual_seed(0)
    E, H, L = 16, 4, 12
    pb = torch.nn.ModuleList([effattn.nn.ALiBi(H, learnable=True), effattn.nn.T5RelativeBias(H, 8, 10, False)])
    mha = effattn.nn.MultiheadAttention(E, H, batch_first=True, position_bias=pb).double()
    x = torch.randn(2, L, E, dtype=torch.float64)
    fused, _ = mha(x, x, x, is_causal=True, need_weights=False, attn_mask=None)
    assert mha.last_path == "fused"
    mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    ref, w = mha(x, x, x, attn_mask=mask, need_weights=True)
    assert mha.last_path.startswith("reference")
    torch.testing.assert_close(fused, ref)
    fused.sum().backward()
    assert pb[0].slopes.grad is not None and pb[1].relative_attention_bias.weight.grad.abs().sum() > 0
    cache = effattn.KVCache()
    with torch.no_grad():
        steps = [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, need_weights=False, cache=cache)[0]
                 for t in range(L)]
    torch.testing.assert_close(torch.cat(steps, 1), fused.detach())
    with pytest.raises(TypeError, match="position_bias must be an nn.Module"):
        effattn.nn.MultiheadAttention(E, H, position_bias=effattn.bias.ALiBi(torch.ones(H)))


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_strided_term_tensors(backend):
    """Term tensors that are strided views (a column of a matrix, a transposed table) give the
    results of their contiguous copies."""
    g = torch.Generator().manual_seed(4)
    q, k, v = random_qkv(1, 2, 2, 10, 10, 8, 8, g, torch.float32)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)
    sinks, slopes, z = r(2, 3)[:, 1], r(2, 2)[:, 0].abs(), (r(2, 2)[:, 1].abs() * 3)
    table = r(9, 2).t()
    dense = r(10, 1, 10).transpose(0, 1)                                 # (1, 10, 10), strided
    def run(c):
        t = (lambda x: x.contiguous()) if c else (lambda x: x)
        return effattn.attention(q, k, v, causal=True, sinks=t(sinks), backend=backend,
                                 bias=[ALiBi(t(slopes)), Relative(t(table), max_distance=4),
                                       Span(t(z), ramp=2, max_span=8), t(dense)])
    assert not sinks.is_contiguous() and not table.is_contiguous()
    torch.testing.assert_close(run(False), run(True), atol=0, rtol=0)
