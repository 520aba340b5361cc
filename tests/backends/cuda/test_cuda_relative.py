"""The CUDA C++ forward with relative keys (row ``cuda/relative``: relk_add in csrc/attention/fwd.cuh), run
on the CPU through the emulation (EFFATTN_CUDA_EMU=1): against the float64 dense formula with several query
and key tiles (the band of r and its skew crossing tile edges), past-only and bidirectional tables, distances
clamped at both ends, a separate query or q itself, windows, key padding, GQA, Lq != Lk, head-dim buckets
64 and 256 (key tiles of 32); bitwise determinism; the refusal of calls that need gradients.
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
    B, H, Hkv, Lq, Lk, D, Dv, (kind, n), kw, given = CASES[case_id]
    dtype = torch.bfloat16 if len(case_id) % 2 else torch.float16
    g = torch.Generator().manual_seed(len(case_id))
    q, k = torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g)
    M = None if kind == "past" else n
    r = torch.randn(H, n if kind == "past" else 2 * n + 1, D, generator=g) * 0.5
    query = torch.randn(B, H, Lq, D, generator=g) if given else q
    kw = dict(kw)
    kpm = None
    if kw.pop("key_padding", False):
        kpm = torch.rand(B, Lk, generator=g) < 0.3
        kpm[-1, :Lk // 2] = True
    q, k, v, r, query_lp = (t.to(dtype) for t in (q, k, v, r, query))
    query_lp = query_lp if given else q
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
    assert out.dtype == dtype and out.shape == (B, H, Lq, Dv)
    ref, ref_lse = dense(q, k, v, r, query_lp, M, kw.get("causal", False), kw.get("window"), kpm, scale, torch.float64)
    low, _ = dense(q, k, v, r, query_lp, M, kw.get("causal", False), kw.get("window"), kpm, scale, dtype)
    judge(out, ref, low, 2, dtype, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 2e-2 * max(1.0, ref_lse[fin].abs().max().item())
    assert bool((out[torch.isneginf(ref_lse)] == 0).all())


def test_the_position_term_matters_and_gradients_are_refused():
    """A kernel that dropped the term would match attention without it: it must not. A call that needs
    gradients is refused by name, and `explain` says why; `attention(bias=RelativeKeys)` takes the row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 32, generator=g).half() for _ in range(3))
    r = torch.randn(2, 70, 32, generator=g).half()
    with torch.no_grad():
        out = effattn.attention(q, k, v, bias=RelativeKeys(r), causal=True, backend="cuda")
        plain = effattn.attention(q, k, v, causal=True, backend="cuda")
    ref, _ = dense(q, k, v, r, q, None, True, None, None, 32 ** -0.5, torch.float64)
    assert (out.double() - ref).abs().max() < 2e-2 < (plain.double() - ref).abs().max()
    qg = q.clone().requires_grad_()
    rep = effattn.explain(qg, k, v, op="relative_attention", r=r, causal=True)
    assert "forward only: the CUDA C++ backward of relative keys is not written yet" in rep.row("cuda/relative").reasons[0]
    with pytest.raises(ValueError, match="backend 'cuda' cannot serve this call: forward only"):
        effattn.relative_attention(qg, k, v, r, causal=True, backend="cuda")


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
