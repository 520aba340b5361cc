"""The CUDA C++ forward with relative keys (row ``cuda/relative``: relk_add in csrc/attention/fwd.cuh), run
on the CPU through the emulation (EFFATTN_CUDA_EMU=1): against the float64 dense formula with several query
and key tiles (the band of r and its skew crossing tile edges), past-only and bidirectional tables, distances
clamped at both ends, a separate query or q itself, windows, key padding, GQA, Lq != Lk, head-dim buckets
64 and 256 (key tiles of 32); bitwise determinism. The backward (csrc/attention/relkeys_bwd.cuh) against the
float64 formula's gradients (q, k, v, r, the term's query), bitwise repeatable; the refusal of gradients at
head dim 256.
"""
import math
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda import resources
from effattn.bias import RelativeKeys, relative_scores
from effattn.visibility import Rule, normalize_window
from tests.core.test_attention import judge

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)


def dense(q, k, v, r, query, M, causal, window, kpm, scale, dtype):
    """The explicit (Lq, Lk) formula computed in `dtype`: (out, lse)."""
    q, k, v, r, query = (t.to(dtype) for t in (q, k, v, r, query))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2) + relative_scores(query, r, k.shape[2], M)) * scale
    left, right = normalize_window(window, causal)
    vis = Rule(q.shape[2], k.shape[2], left, right).materialize(key_padding_mask=kpm)
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _inputs(B, H, Hkv, Lq, Lk, D, Dv, dist, kw, given, g):
    """q, k, v, r, the term's query (None: q itself), max_distance, the call's keywords, key padding and the
    generator of a case; dist = ("past", n_dist) or ("M", max_distance)."""
    kind, n = dist
    q, k = torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g)
    r = torch.randn(H, n if kind == "past" else 2 * n + 1, D, generator=g) * 0.5
    query = torch.randn(B, H, Lq, D, generator=g) if given else None
    kw = dict(kw)
    kpm = None
    if kw.pop("key_padding", False):
        kpm = torch.rand(B, Lk, generator=g) < 0.3
        kpm[-1, :Lk // 2] = True
    return q, k, v, r, query, None if kind == "past" else n, kw, kpm, g


# id -> (B, H, Hkv, Lq, Lk, D, Dv, n_dist or M, kwargs); "past": r holds n_dist past distances
CASES = {
    "txl-past-causal-query-mem": (1, 2, 1, 70, 150, 64, 64, ("past", 100), dict(causal=True), True),
    "shaw-M20-bidir-q-itself-kpm": (2, 2, 2, 66, 66, 32, 48, ("M", 20), dict(key_padding=True), False),
    "past-clamped-window-gqa": (1, 4, 2, 40, 90, 32, 32, ("past", 30), dict(causal=True, window=50), True),
    "M-larger-than-distances-two-sided": (1, 2, 2, 9, 20, 16, 16, ("M", 40), dict(window=(6, 3)), True),
    "D256-key-tiles-of-32": (1, 2, 2, 20, 70, 200, 200, ("past", 64), dict(causal=True), True),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_relative_forward_against_float64(case_id):
    dtype = torch.bfloat16 if len(case_id) % 2 else torch.float16
    q, k, v, r, query, M, kw, kpm, _ = _inputs(*CASES[case_id], torch.Generator().manual_seed(len(case_id)))
    q, k, v, r = (t.to(dtype) for t in (q, k, v, r))
    given = query is not None
    query_lp = query.to(dtype) if given else q
    scale = 0.6
    args = dict(query=query_lp if given else None, max_distance=M)
    with torch.no_grad():
        rep = effattn.explain(q, k, v, op="relative_attention", r=r, key_padding_mask=kpm, scale=scale, **args, **kw)
        assert rep.paths["cuda"].startswith("cuda/relative: CUDA C++ forward")
        out, lse = effattn.relative_attention(q, k, v, r, key_padding_mask=kpm, scale=scale, return_lse=True,
                                              backend="cuda", **args, **kw)
        out2, lse2 = effattn.relative_attention(q, k, v, r, key_padding_mask=kpm, scale=scale, return_lse=True,
                                                backend="cuda", **args, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "not bitwise deterministic"
    assert out.dtype == dtype and out.shape == (*q.shape[:3], v.shape[3])
    ref, ref_lse = dense(q, k, v, r, query_lp, M, kw.get("causal", False), kw.get("window"), kpm, scale, torch.float64)
    low, _ = dense(q, k, v, r, query_lp, M, kw.get("causal", False), kw.get("window"), kpm, scale, dtype)
    judge(out, ref, low, 2, dtype, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 2e-2 * max(1.0, ref_lse[fin].abs().max().item())
    assert bool((out[torch.isneginf(ref_lse)] == 0).all())


# id -> (B, H, Hkv, Lq, Lk, D, Dv, (kind, n), kwargs, query given, lse in the loss)
GRAD_CASES = {
    "txl-past-causal-query-gqa": (1, 2, 1, 70, 100, 32, 32, ("past", 60), dict(causal=True), True, False),
    "shaw-M20-bidir-q-itself-kpm-lse": (2, 1, 1, 66, 66, 32, 48, ("M", 20), dict(key_padding=True), False, True),
    "D128-window-two-sided-M-larger": (1, 1, 1, 20, 40, 72, 72, ("M", 45), dict(window=(6, 3)), True, False),
}


def _grads(fn, leaves, w_out, w_lse):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in leaves]
    out, lse = fn(*leaves)
    loss = (out.double() * w_out.double()).sum()
    if w_lse is not None:
        loss = loss + (lse.double() * w_lse.double()).sum()
    live = [t for t in leaves if t is not None]
    return torch.autograd.grad(loss, live)


@pytest.mark.parametrize("case_id", list(GRAD_CASES))
def test_relative_backward_against_float64(case_id):
    """Gradients of q, k, v, r and the term's query (or q itself, which then takes both parts) against the
    float64 dense formula, by the low-precision rule (twice the error of the same formula in the call's dtype);
    bitwise repeatable; `explain` names the row with its backward."""
    *case, with_lse = GRAD_CASES[case_id]
    q, k, v, r, query, M, kw, kpm, g = _inputs(*case, torch.Generator().manual_seed(len(case_id)))
    w_out = torch.randn(*q.shape[:3], v.shape[3], generator=g)
    w_lse = torch.randn(*q.shape[:3], generator=g) if with_lse else None
    dtype = torch.bfloat16 if len(case_id) % 2 else torch.float16
    q, k, v, r = (t.to(dtype) for t in (q, k, v, r))
    query = query.to(dtype) if query is not None else None
    scale = 0.4
    causal, window = kw.get("causal", False), kw.get("window")

    def ours(q_, k_, v_, r_, query_=None):
        return effattn.relative_attention(q_, k_, v_, r_, query=query_, max_distance=M, key_padding_mask=kpm,
                                          scale=scale, return_lse=True, backend="cuda", **kw)

    def dense_in(dt):
        def f(q_, k_, v_, r_, query_=None):
            return dense(q_, k_, v_, r_, q_ if query_ is None else query_, M, causal, window, kpm, scale, dt)
        return f

    leaves = (q, k, v, r, query)
    rep = effattn.explain(*[t.detach().requires_grad_() for t in (q, k, v)], op="relative_attention",
                          r=r.detach().requires_grad_(), query=query, max_distance=M, key_padding_mask=kpm,
                          scale=scale, **kw)
    assert rep.paths["cuda"].startswith("cuda/relative: CUDA C++ forward and backward"), rep.paths["cuda"]
    got = _grads(ours, leaves, w_out, w_lse)
    again = _grads(ours, leaves, w_out, w_lse)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "gradients not bitwise repeatable"
    ref = _grads(dense_in(torch.float64), leaves, w_out, w_lse)
    low = _grads(dense_in(dtype), leaves, w_out, w_lse)
    names = ["dq", "dk", "dv", "dr", "dquery"]
    for name, a, b, c, t in zip(names, got, ref, low, [x for x in leaves if x is not None]):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        judge(a, b, c, 2, dtype, name)


def test_the_position_term_matters_and_big_heads_refuse_gradients():
    """A kernel that dropped the term would match attention without it: it must not. Gradients at head dim
    256 are refused by name, and `explain` says why; `attention(bias=RelativeKeys)` takes the row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 32, generator=g).half() for _ in range(3))
    r = torch.randn(2, 70, 32, generator=g).half()
    with torch.no_grad():
        out = effattn.attention(q, k, v, bias=RelativeKeys(r), causal=True, backend="cuda")
        plain = effattn.attention(q, k, v, causal=True, backend="cuda")
    ref, _ = dense(q, k, v, r, q, None, True, None, None, 32 ** -0.5, torch.float64)
    assert (out.double() - ref).abs().max() < 2e-2 < (plain.double() - ref).abs().max()
    q2, r2 = torch.zeros(1, 1, 4, 200, dtype=torch.float16, requires_grad=True), torch.zeros(1, 3, 200).half()
    rep = effattn.explain(q2, q2, q2, op="relative_attention", r=r2, causal=True)
    assert "gradients at head dims above 128" in rep.row("cuda/relative").reasons[0]
    with pytest.raises(ValueError, match="backend 'cuda' cannot serve this call: gradients at head dims above 128"):
        effattn.relative_attention(q2, q2, q2, r2, causal=True, backend="cuda")


def test_shared_memory_is_what_the_launch_asks_for(emulation):
    """One byte of shared memory: the launch fails naming the size `resources.relk_smem` gives (the
    size the Python row checks a device against), at every head-dim bucket."""
    before = resources.set_emulated_smem(1)
    try:
        for hd in (32, 64, 128, 256):
            q = torch.zeros(1, 1, 4, hd, dtype=torch.bfloat16)
            r = torch.zeros(1, 3, hd, dtype=torch.bfloat16)
            with pytest.raises(RuntimeError, match=f"asks for {resources.relk_smem(hd)} bytes"):
                emulation.attention_fwd_relk(q, q, q, None, 0.25, -1, 0, r, None, -1)
    finally:
        resources.set_emulated_smem(before)
