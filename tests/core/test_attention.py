"""effattn.attention against the float64 oracle, for every backend usable here.

The suite is parametrized by backend (conftest.attention_backends): a new backend is tested by
registering it, nothing else. Low precision is judged by 'error at most 2x the error of the same
dense computation done naively in that dtype' (3x for gradients), plus a floor of one unit of the
dtype's precision for entries the naive computation happens to get exactly.
"""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import effattn
from effattn.layouts import BlockLayout
from effattn.testing.oracle import naive_attention
from tests.conftest import DEVICE, attention_backends, declared_dtypes, random_qkv

BACKENDS = attention_backends()

FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def dtypes_for(backend):
    return declared_dtypes("attention", backend)


def rand_layout(H, Lq, Lk, bs, per_head, seed):
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = math.ceil(Lq / bs), math.ceil(Lk / bs)
    mask = torch.rand(H if per_head else 1, nqb, nkb, generator=g) < 0.5
    mask[:, 0] = False                                       # a block row that sees nothing
    return BlockLayout(mask, bs)


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs); layouts and padding masks are drawn per test
CASES = {
    "dense-B2-H2-L40-D16": (2, 2, 2, 40, 40, 16, 16, {}),
    "causal-B1-H2-L67-D32": (1, 2, 2, 67, 67, 32, 32, dict(causal=True)),
    "causal-Lq<Lk-q19-k50": (1, 2, 2, 19, 50, 16, 16, dict(causal=True)),
    "causal-Lq>Lk-q50-k19-emptyrows": (1, 2, 2, 50, 19, 16, 16, dict(causal=True)),
    "noncausal-Lq>Lk-q33-k70": (2, 1, 1, 33, 70, 8, 8, {}),
    "window-int-noncausal-w5": (1, 2, 2, 48, 48, 16, 16, dict(window=5)),
    "window-int-causal-w7": (1, 2, 2, 48, 48, 16, 16, dict(causal=True, window=7)),
    "window-pair-3-9": (1, 2, 2, 41, 41, 16, 16, dict(window=(3, 9))),
    "window-causal-right-ignored-6-4": (1, 2, 2, 41, 41, 16, 16, dict(causal=True, window=(6, 4))),
    "window-Lq<Lk-decode": (1, 2, 2, 5, 60, 16, 16, dict(causal=True, window=(10, 0))),
    "gqa-H4-Hkv2-causal": (2, 4, 2, 35, 35, 16, 16, dict(causal=True)),
    "mqa-H4-Hkv1": (1, 4, 1, 30, 45, 16, 16, {}),
    "dv!=d-D24-Dv8": (1, 2, 2, 33, 33, 24, 8, dict(causal=True)),
    "headdim-odd-D5-Dv3": (1, 2, 2, 20, 20, 5, 3, {}),
    "headdim-1": (1, 1, 1, 9, 9, 1, 1, dict(causal=True)),
    "kpm-B2": (2, 2, 2, 37, 37, 16, 16, dict(kpm=0.3)),
    "layout-shared-bs16": (1, 2, 2, 64, 64, 16, 16, dict(layout=(16, False))),
    "layout-perhead-bs16-partial": (2, 2, 2, 50, 70, 16, 16, dict(layout=(16, True))),
    "layout-gqa-perhead-causal": (1, 4, 2, 64, 64, 16, 16, dict(layout=(16, True), causal=True)),
    "all-gqa-window-layout-kpm": (2, 4, 2, 45, 64, 16, 8, dict(layout=(16, True), causal=True, window=20, kpm=0.2)),
    "scale-custom": (1, 2, 2, 24, 24, 16, 16, dict(scale=0.37)),
}


def make_inputs(case, dtype, seed=0, transposed=False):
    B, H, Hkv, Lq, Lk, D, Dv, kw = case
    g = torch.Generator().manual_seed(seed)
    # transposed: (B, L, H, D) tensors seen as (B, H, L, D), non-contiguous
    q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, Dv, g, dtype, transposed=transposed)
    kwargs = {n: kw[n] for n in ("causal", "window", "scale") if n in kw}
    if "layout" in kw:
        bs, per_head = kw["layout"]
        kwargs["layout"] = rand_layout(H, Lq, Lk, bs, per_head, seed).to(DEVICE)
    if "kpm" in kw:
        kpm = torch.rand(B, Lk, generator=g) < kw["kpm"]
        kpm[-1] = True                                       # one batch entry fully padded
        kwargs["key_padding_mask"] = kpm.to(DEVICE)
    return q, k, v, kwargs


def judge(got, ref, naive, mult, dtype, what):
    assert not torch.isnan(got).any(), f"{what}: NaN in output"
    err = (got.double() - ref.double()).abs().max().item()
    nerr = (naive.double() - ref.double()).abs().max().item()
    bound = mult * nerr + FLOOR[dtype]
    assert err <= bound, f"{what}: max error {err:.3g} > {mult}x naive {dtype} error {nerr:.3g} + floor"


def naive_in(dtype, q, k, v, kwargs):
    """The same dense computation done naively in `dtype` (tf32 matmuls where the GPU would use them)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32
    try:
        return naive_attention(q, k, v, dtype=dtype, **kwargs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d).replace('torch.', '')}") for b in BACKENDS
                  for d in dtypes_for(b)]


def check_against_oracle(q, k, v, kwargs, dtype, backend):
    """`backend`'s output, lse and three gradients against float64, by the low-precision rule."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, return_lse=True, backend=backend, **kwargs)
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_attention(*ref_leaves, **kwargs)
    low_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    low, _ = naive_in(dtype, *low_leaves, kwargs)
    judge(out, ref, low, 2, dtype, "out")
    # lse: -inf exactly where the oracle's is, close elsewhere
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(ref_lse).cpu())
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 if fin.any() else True
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    grads = torch.autograd.grad(out, leaves, go)
    ref_grads = torch.autograd.grad(ref, ref_leaves, go.double())
    low_grads = torch.autograd.grad(low, low_leaves, go)
    for name, g, rg, lg in zip("qkv", grads, ref_grads, low_grads):
        assert g.shape == rg.shape and g.dtype == dtype
        judge(g, rg, lg, 3, dtype, f"d{name}")


@pytest.mark.parametrize("case_id", list(CASES))
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
def test_matches_oracle(backend, case_id, dtype):
    q, k, v, kwargs = make_inputs(CASES[case_id], dtype, transposed=case_id.startswith("gqa"))
    check_against_oracle(q, k, v, kwargs, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_seeing_no_key_are_zero(backend):
    """Fully masked rows: output exactly 0, lse -inf, zero gradients, no NaN anywhere."""
    B, H, L, D = 2, 2, 32, 16
    q, k, v = (torch.randn(B, H, L, D, device=DEVICE, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(B, L, dtype=torch.bool, device=DEVICE)
    kpm[1] = True                                            # batch 1: every key is padding
    kpm[0, :20] = True                                       # batch 0: with causal, rows < 20 see nothing
    out, lse = effattn.attention(q, k, v, causal=True, key_padding_mask=kpm, return_lse=True, backend=backend)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, :20], torch.zeros_like(out[0, :, :20]))
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all() and torch.isfinite(lse[0, :, 20:]).all()
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1])) and torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_lse(backend):
    q, k, v = (torch.randn(1, 2, 24, 8, dtype=torch.float32, device=DEVICE) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, causal=True, return_lse=True, backend=backend)
    (out.square().sum() + 0.5 * lse.sum()).backward()
    rl = [t.double().requires_grad_() for t in (q, k, v)]
    ro, rlse = naive_attention(*rl, causal=True)
    (ro.square().sum() + 0.5 * rlse.sum()).backward()
    for a, b in zip(leaves, rl):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_bitwise_deterministic(backend):
    q, k, v = (torch.randn(2, 4, 40, 16, device=DEVICE) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    layout = rand_layout(4, 40, 40, 16, True, 3).to(DEVICE)
    go = torch.randn(2, 4, 40, 16, device=DEVICE)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, causal=True, layout=layout, backend=backend)
        runs.append(torch.autograd.grad(out, leaves, go))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout(backend):
    """With V = identity the output row is P*M/(1-p): the mask is visible, so the kept fraction,
    the kept values and the gradients can all be checked against the oracle with that mask."""
    B, H, L, p = 2, 2, 32, 0.3
    q, k = (torch.randn(B, H, L, 16, device=DEVICE) for _ in range(2))
    eye = torch.eye(L, device=DEVICE).expand(B, H, L, L).contiguous()
    torch.manual_seed(123)
    a = effattn.attention(q, k, eye, causal=True, dropout_p=p, backend=backend)
    torch.manual_seed(123)
    b = effattn.attention(q, k, eye, causal=True, dropout_p=p, backend=backend)
    assert torch.equal(a, b), "same torch seed must give the same dropout mask"
    c = effattn.attention(q, k, eye, causal=True, dropout_p=p, backend=backend)
    assert not torch.equal(a, c), "a new seed must give a new mask"
    probs, _ = naive_attention(q.double(), k.double(), eye.double(), causal=True)
    visible = probs > 0
    keep = a != 0
    frac = keep[visible].double().mean().item()
    assert abs(frac - (1 - p)) < 0.05, f"kept fraction {frac:.3f}, expected {1 - p}"
    torch.testing.assert_close(a[keep].double(), probs[keep] / (1 - p), atol=1e-5, rtol=1e-4)
    # gradients with the same mask (same seed) against the oracle using the recovered mask
    v = torch.randn(B, H, L, L, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(123)
    out = effattn.attention(*leaves, causal=True, dropout_p=p, backend=backend)
    rl = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*rl, causal=True, dropout_keep=keep, dropout_p=p)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    go = torch.randn_like(out)
    for g, rg in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double())):
        torch.testing.assert_close(g.double(), rg, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- errors

def _qkv(B=1, H=2, L=8, D=4, **over):
    t = {"q": torch.randn(B, H, L, D), "k": torch.randn(B, H, L, D), "v": torch.randn(B, H, L, D)}
    t.update(over)
    return t["q"], t["k"], t["v"]


BAD = {
    "batch-mismatch": (lambda: (_qkv(k=torch.randn(2, 2, 8, 4)), {}), ValueError, "batch size mismatch"),
    "heads-not-multiple": (lambda: (_qkv(H=3, k=torch.randn(1, 2, 8, 4), v=torch.randn(1, 2, 8, 4)), {}),
                           ValueError, "multiple of the key/value heads"),
    "kv-heads-differ": (lambda: (_qkv(v=torch.randn(1, 1, 8, 4)), {}), ValueError, "same number of heads"),
    "kv-length-differ": (lambda: (_qkv(v=torch.randn(1, 2, 9, 4)), {}), ValueError, "same sequence length"),
    "qk-headdim-differ": (lambda: (_qkv(k=torch.randn(1, 2, 8, 5)), {}), ValueError, "same head dim"),
    "headdim-too-large": (lambda: (_qkv(D=300), {}), ValueError, "out of range"),
    "mixed-dtypes": (lambda: (_qkv(k=torch.randn(1, 2, 8, 4).half()), {}), TypeError, "share one dtype"),
    "int-dtype": (lambda: (tuple(torch.ones(1, 2, 8, 4, dtype=torch.int32) for _ in range(3)), {}),
                  TypeError, "unsupported dtype"),
    "mixed-devices": (lambda: (_qkv(k=torch.randn(1, 2, 8, 4, device="meta")), {}), ValueError, "one device"),
    "3d-input": (lambda: ((torch.randn(2, 8, 4),) + _qkv()[1:], {}), ValueError, "must be 4-D"),
    "not-a-tensor": (lambda: (([1.0],) + _qkv()[1:], {}), TypeError, "q must be a torch.Tensor"),
    "negative-window": (lambda: (_qkv(), dict(window=-1)), ValueError, "window sizes must be non-negative"),
    "negative-window-pair": (lambda: (_qkv(), dict(window=(2, -3))), ValueError, "non-negative"),
    "window-bad-type": (lambda: (_qkv(), dict(window=(1, 2, 3))), TypeError, "window must be"),
    "causal-not-bool": (lambda: (_qkv(), dict(causal="yes")), TypeError, "causal must be a bool"),
    "layout-wrong-shape": (lambda: (_qkv(), dict(layout=BlockLayout(torch.ones(1, 3, 3, dtype=torch.bool), 4))),
                           ValueError, "layout has shape"),
    "layout-wrong-heads": (lambda: (_qkv(), dict(layout=BlockLayout(torch.ones(3, 2, 2, dtype=torch.bool), 4))),
                           ValueError, "layout has shape"),
    "layout-not-blocklayout": (lambda: (_qkv(), dict(layout=torch.ones(2, 2, dtype=torch.bool))), TypeError,
                               "BlockLayout"),
    "kpm-float": (lambda: (_qkv(), dict(key_padding_mask=torch.zeros(1, 8))), TypeError, "torch.bool"),
    "kpm-shape": (lambda: (_qkv(), dict(key_padding_mask=torch.zeros(1, 7, dtype=torch.bool))), ValueError,
                  r"key_padding_mask must have shape \(B, Lk\)"),
    "dropout-range": (lambda: (_qkv(), dict(dropout_p=1.0)), ValueError, "dropout_p"),
    "scale-nan": (lambda: (_qkv(), dict(scale=float("nan"))), TypeError, "scale"),
    "backend-unknown": (lambda: (_qkv(), dict(backend="xformers")), ValueError, "backend must be one of"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_errors(name):
    make, exc, msg = BAD[name]
    (q, k, v), kwargs = make()
    with pytest.raises(exc, match=msg):
        effattn.attention(q, k, v, **kwargs)


def test_named_backend_that_cannot_serve_says_why():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"'cuda' cannot serve this call: .*dtype float32 not served.*"
                                           r"Backends that can: .*torch"):
        effattn.attention(q, k, v, backend="cuda")
    if "triton" in BACKENDS:
        q64, k64, v64 = (t.double() for t in (q, k, v))
        with pytest.raises(RuntimeError, match=r"backend 'triton' cannot serve this call: dtype float64.*"
                                               r"Backends that can: torch"):
            effattn.attention(q64, k64, v64, backend="triton")


def test_explain_reports_every_backend():
    q, k, v = _qkv()
    ex = effattn.explain(q, k, v, causal=True)
    assert ex.chosen == "torch" and ex.can_serve("torch")
    assert set(ex.reasons) >= {"torch", "triton", "cuda"} and not ex.can_serve("cuda")
    text = str(ex)
    assert "picks torch" in text and "cuda" in text
    lin = effattn.explain(q, k, v, op="linear_attention", causal=True, feature_map="relu")
    assert lin.op == "linear_attention" and lin.chosen == "torch" and "linear_attention" in str(lin)
    with pytest.raises(ValueError, match="op must be"):
        effattn.explain(q, k, v, op="softmax")
    ex64 = effattn.explain(q.double(), k.double(), v.double())
    if "triton" in BACKENDS:
        assert not ex64.can_serve("triton") and any("float64" in r for r in ex64.reasons["triton"])


# ------------------------------------------------------------------------------- compile and opcheck

def test_opcheck_reference_ops():
    from effattn.backends.torch.attention.reference import ref_attention_bwd, ref_attention_fwd
    q = torch.randn(1, 4, 20, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 8, requires_grad=True) for _ in range(2))
    kpm = torch.rand(1, 20) < 0.2
    lm = torch.rand(4, 2, 2) < 0.7
    torch.library.opcheck(ref_attention_fwd, (q, k, v, lm, 16, kpm, None, 0.3, 0.0, 4, 0))
    torch.library.opcheck(ref_attention_fwd, (q, k, v, None, 0, None, torch.tensor([3, 4]), 0.3, 0.2, -1, -1))
    # non-contiguous (B, L, H, D) views: fake and real outputs must agree on strides too
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ref_attention_fwd, (qt, kt, vt, None, 0, None, None, 0.3, 0.0, -1, 0))
    out, lse = ref_attention_fwd(qt, kt, vt, None, 0, None, None, 0.3, 0.0, -1, 0)
    torch.library.opcheck(ref_attention_bwd, (torch.randn_like(out), None, qt.detach(), kt.detach(), vt.detach(),
                                              out.detach(), lse.detach(), None, 0, None, None, 0.3, 0.0, -1, 0))
    out, lse = ref_attention_fwd(q, k, v, None, 0, None, None, 0.3, 0.0, -1, 0)
    args = (torch.randn_like(out), None, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
            None, 0, None, None, 0.3, 0.0, -1, 0)
    torch.library.opcheck(ref_attention_bwd, args)


def test_torch_compile_fullgraph():
    def f(q, k, v, layout):
        return effattn.attention(q, k, v, causal=True, window=6, layout=layout)

    q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
    layout = rand_layout(2, 32, 32, 16, True, 5)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, layout)
    ref = f(q, k, v, layout)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    rg = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------------- memory bound

def extra_peak_bytes_16k(attention_kwargs: str) -> int:
    """Extra peak RSS of ``effattn.attention(q, k, v, <attention_kwargs>)`` forward + backward at B=1,
    H=8, L=16384, D=64 fp32 on CPU, measured in a fresh process (ru_maxrss is its high-water mark)."""
    script = textwrap.dedent(f"""
        import resource, torch, effattn
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 8, 16384, 64, requires_grad=True) for _ in range(3))
        go = torch.randn(1, 8, 16384, 64)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = effattn.attention(q, k, v, {attention_kwargs})
        out.backward(go)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert torch.isfinite(q.grad).all() and torch.isfinite(out).all()
        print((after - before) * 1024)
    """)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return int(res.stdout.strip().splitlines()[-1])


def test_reference_backend_memory_is_bounded_at_16k():
    """The memory promise: B=1, H=8, L=16384, D=64 fp32 causal, forward + backward on CPU with < 1 GiB extra
    peak. A full score matrix would be 8.6 GB."""
    extra = extra_peak_bytes_16k('causal=True, backend="torch"')
    assert extra < 1 << 30, f"extra peak memory {extra / 2**20:.0f} MiB >= 1 GiB"


# ------------------------------------------------------------------------------ degenerate shapes

EDGE = {
    "Lk=0": (1, 2, 2, 5, 0, {}),
    "Lk=0-causal": (1, 2, 2, 5, 0, dict(causal=True)),
    "Lk=0-layout": (1, 2, 2, 5, 0, dict(layout=True)),
    "Lq=0": (1, 2, 2, 0, 5, {}),
    "Lq=0-layout": (1, 2, 2, 0, 5, dict(layout=True)),
    "B=0": (0, 2, 2, 5, 5, dict(causal=True)),
    "window-wider-than-L": (1, 2, 2, 7, 7, dict(window=100)),
    "causal-window-0-diagonal-only": (1, 2, 2, 7, 7, dict(causal=True, window=0)),
    "decode-Lq=1": (2, 4, 2, 1, 45, dict(causal=True, window=(8, 0))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EDGE))
def test_degenerate_shapes(backend, name):
    """Empty sequences and batches give empty or all-zero outputs (lse -inf) and zero gradients."""
    B, H, Hkv, Lq, Lk, kw = EDGE[name]
    D = 8
    q = torch.randn(B, H, Lq, D, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Lk, D, device=DEVICE, requires_grad=True) for _ in range(2))
    if kw.get("layout"):
        kw = dict(kw, layout=BlockLayout(torch.ones(1, math.ceil(Lq / 16), math.ceil(Lk / 16), dtype=torch.bool), 16))
    out, lse = effattn.attention(q, k, v, return_lse=True, backend=backend, **kw)
    assert out.shape == (B, H, Lq, D) and lse.shape == (B, H, Lq)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kw)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(ref_lse).cpu())
    if out.numel():
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad is None or torch.isfinite(t.grad).all()
        if Lk == 0:
            assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_kv_with_stride_zero(backend):
    """k/v broadcast with stride 0 along heads (expand) are read as they are."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    q = torch.randn(1, 4, 12, 8, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(1, 1, 12, 8, dtype=dtype, device=DEVICE).expand(1, 2, 12, 8) for _ in range(2))
    out = effattn.attention(q, k, v, causal=True, backend=backend)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
