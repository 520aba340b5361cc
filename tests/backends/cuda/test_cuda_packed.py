"""Packed sequences (cu_seqlens), positions and fp32 outputs on the CUDA kernels, run through their host
emulation (EFFATTN_CUDA_EMU=1), against the float64 oracle (which masks every pair across segments):
forward, lse and the
three gradients; empty segments on either side, rows that see no key, a max_seqlen larger than needed;
dropout keep-masks drawn at the packed rows (the plain call's over the packed tensors)."""
import shutil

import pytest
import torch

import effattn
from effattn.testing.oracle import naive_attention, visibility
from tests.core.test_attention import judge

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)

# segments: (no keys), Lq > Lk (rows that see no key when causal), no queries, length 1, one longer than a
# query / key tile of 64 (Lq < Lk), an empty pair
OFFS_Q = [0, 3, 8, 8, 9, 79, 79]
OFFS_K = [0, 0, 5, 9, 10, 86, 86]


def _inputs(dtype, H=4, Hkv=2, D=16, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, OFFS_Q[-1], D, generator=g).to(dtype)
    k = torch.randn(1, Hkv, OFFS_K[-1], D, generator=g).to(dtype)
    v = torch.randn(1, Hkv, OFFS_K[-1], Dv, generator=g).to(dtype)
    return q, k, v, torch.tensor(OFFS_Q, dtype=torch.int32), torch.tensor(OFFS_K, dtype=torch.int32)


def _check(q, k, v, cu_q, cu_k, kw, dtype, max_seqlen=None, keep=None, p=0.0):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if p:
        torch.manual_seed(7)
    out, lse = effattn.attention(*leaves, cu_seqlens=(cu_q, cu_k), max_seqlen=max_seqlen, return_lse=True,
                                 dropout_p=p, backend="cuda", **kw)
    assert out.dtype == dtype and out.shape == q.shape[:3] + v.shape[3:]
    packed = dict(cu_seqlens=(cu_q, cu_k), dropout_keep=keep, dropout_p=p, **kw)
    rl = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_attention(*rl, **packed)
    ll = [t.detach().requires_grad_() for t in (q, k, v)]
    low, _ = naive_attention(*ll, dtype=dtype, **packed)
    judge(out, ref, low, 2, dtype, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))       # rows that see no key: -inf, exactly
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-3
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, leaves, go)
    for name, g, rg, lg in zip("qkv", grads, torch.autograd.grad(ref, rl, go.double()),
                               torch.autograd.grad(low, ll, go)):
        assert g.dtype == dtype and not torch.isnan(g).any()
        judge(g, rg, lg, 3, dtype, f"d{name}")
    return out, lse, grads


CASES = {"causal": dict(causal=True), "window": dict(window=(3, 2)), "causal-window": dict(causal=True, window=9),
         "dense": dict()}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_against_float64_per_segment(case):
    dtype = torch.bfloat16 if case in ("causal", "dense") else torch.float16
    q, k, v, cu_q, cu_k = _inputs(dtype, seed=len(case))
    out, _, grads = _check(q, k, v, cu_q, cu_k, CASES[case], dtype)
    # a segment without keys: output 0 and no gradient; keys without queries: no gradient
    assert torch.equal(out[:, :, 0:3], torch.zeros_like(out[:, :, 0:3]))
    assert torch.equal(grads[0][:, :, 0:3], torch.zeros_like(grads[0][:, :, 0:3]))
    assert torch.equal(grads[1][:, :, 5:9], torch.zeros_like(grads[1][:, :, 5:9]))


def test_packed_max_seqlen_larger_is_bitwise_the_same_and_head_dim_64():
    """max_seqlen sizes the grid only: a larger one adds blocks that exit, the result is bitwise equal.
    Head dim 40 / 56 (bucket 64, padded rows), MHA."""
    q, k, v, cu_q, cu_k = _inputs(torch.bfloat16, H=2, Hkv=2, D=40, Dv=56, seed=3)
    kw = dict(causal=True)
    out, lse, grads = _check(q, k, v, cu_q, cu_k, kw, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out2, lse2 = effattn.attention(*leaves, cu_seqlens=(cu_q, cu_k), max_seqlen=(140, 86), return_lse=True,
                                   backend="cuda", **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for a, b in zip(grads, torch.autograd.grad(out2, leaves, go)):
        assert torch.equal(a, b)


def test_packed_dropout_draws_at_the_packed_rows():
    """Packed dropout draws Philox at the packed rows (q0 + i, k0 + j) of head h: the keep-mask is the
    plain call's over the whole packed tensors (itself the Triton kernels', test_cuda_attention.py),
    restricted to the segments. With V = identity the mask is read off the output; the gradients with
    that mask match float64 per segment."""
    dt, p = torch.bfloat16, 0.3
    q, k, _, cu_q, cu_k = _inputs(dt, seed=5)
    Tk = OFFS_K[-1]
    eye = torch.eye(Tk).expand(1, 2, Tk, Tk).to(dt).contiguous()
    kw = dict(causal=True, window=40)
    torch.manual_seed(7)
    packed = effattn.attention(q, k, eye, cu_seqlens=(cu_q, cu_k), dropout_p=p, backend="cuda", **kw) != 0
    torch.manual_seed(7)
    plain = effattn.attention(q, k, eye, dropout_p=p, backend="cuda") != 0      # dense: every pair drawn
    visible = visibility(OFFS_Q[-1], Tk, cu_seqlens=(cu_q, cu_k), **kw)[0, 0]
    assert visible.any() and not visible.all()
    assert torch.equal(packed, plain & visible)
    frac = packed[visible.expand_as(packed)].double().mean().item()
    assert abs(frac - (1 - p)) < 0.06, frac
    v = torch.randn(1, 2, Tk, 8, generator=torch.Generator().manual_seed(9)).to(dt)
    keep = plain.expand(1, 4, -1, -1)
    _check(q, k, v, cu_q, cu_k, kw, dt, keep=keep, p=p)


def test_dropout_with_positions_and_a_head_shard_draws_the_whole_calls_pairs():
    """A chunk with positions (q_start, k_start) on heads 2..3 of 4 (a Ulysses head shard: drop_at)
    drops exactly the pairs the whole call drops there (V = identity reads the keep-mask off the
    output; the whole call's mask is the Triton kernels' stream, test_cuda_attention.py), and its
    gradients with that mask match float64."""
    from effattn.distributed import _chunk
    from effattn.numerics import draw_seed
    dt, p, L = torch.bfloat16, 0.3, 72
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, L, 16, generator=g).to(dt)
    k, v = (torch.randn(1, 2, L, 16, generator=g).to(dt) for _ in range(2))
    kw = dict(causal=True, window=30)
    torch.manual_seed(7)
    full = effattn.attention(q, k, torch.eye(L).expand(1, 2, L, L).to(dt).contiguous(), dropout_p=p,
                             backend="cuda", **kw) != 0
    qs, ks, n, m = 40, 16, 24, 32
    torch.manual_seed(7)
    seed = draw_seed()
    eye = torch.eye(m).expand(1, 1, m, m).to(dt).contiguous()
    qc, kc = q[:, 2:4, qs:qs + n], k[:, 1:2, ks:ks + m]
    out, _ = _chunk(qc, kc, eye, backend="cuda", seed=seed, positions=(qs, ks), heads=(2, 4), dropout_p=p, **kw)
    got = out != 0
    want = full[:, 2:4, qs:qs + n, ks:ks + m]
    assert want.any() and torch.equal(got, want)
    from effattn._call import make_attn_call
    from effattn.backends.cuda.attention import ops
    assert ops._admits(make_attn_call(qc, kc, eye, dropout_p=p, positions=(qs, ks), heads=(2, 4), **kw)) == []
    # the gradients with that keep-mask (the head shard's) against float64
    vc = v[:, 1:2, ks:ks + m]
    leaves = [t.clone().requires_grad_() for t in (qc, kc, vc)]
    out, _ = _chunk(*leaves, backend="cuda", seed=seed, positions=(qs, ks), heads=(2, 4), dropout_p=p, **kw)
    rl = [t.detach().double().requires_grad_() for t in (qc, kc, vc)]
    ref, _ = naive_attention(*rl, dropout_keep=want, dropout_p=p, positions=(qs, ks), **kw)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    go = torch.randn(out.shape, generator=g).to(dt)
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double())):
        torch.testing.assert_close(a.double(), b, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_positions_and_fp32_output(dtype):
    """A chunk pair with positions and an fp32 output: the whole sequence's rows against the chunk's keys."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 80, 16, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :1], v[:, :1]
    qs, ks, n = 40, 20, 24
    kw = dict(causal=True, window=30)
    qc, kc, vc = (t[:, :, s:s + n].clone().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
    out, lse = effattn.attention(qc, kc, vc, positions=(qs, ks), out_dtype=torch.float32, return_lse=True,
                                 backend="cuda", **kw)
    assert out.dtype == torch.float32
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qc, kc, vc))
    m = visibility(80, 80, **kw)[0, 0, qs:qs + n, ks:ks + n]
    s = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) / 4.0).masked_fill(~m, float("-inf"))
    ref = torch.nan_to_num(torch.softmax(s, -1)) @ v64.repeat_interleave(2, 1)
    tol = 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=tol, atol=tol)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (qc, kc, vc), dout.float()),
                    torch.autograd.grad(ref, (q64, k64, v64), dout)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=5 * tol, atol=5 * tol)


def test_explain_serves_packed_calls_and_the_op_checks():
    from effattn.backends.cuda.attention import ops
    q, k, v, cu_q, cu_k = _inputs(torch.bfloat16)
    e = effattn.explain(q, k, v, causal=True, cu_seqlens=(cu_q, cu_k), dropout_p=0.1, backend="cuda")
    assert e.paths["cuda"].startswith("cuda/prefill") and not e.reasons.get("cuda"), (e.paths, e.reasons)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ops.cuda_attention_fwd, (q, k, v, None, 0, None, None, cu_q, cu_k, 0.25, 0.0, -1, 0),
                          dict(max_seqlen_q=70, max_seqlen_k=76))
    with pytest.raises(RuntimeError, match="max_seqlen_q must be in"):
        ops.cuda_attention_fwd(q, k, v, None, 0, None, None, cu_q, cu_k, 0.25, 0.0, -1, 0, max_seqlen_q=-1,
                               max_seqlen_k=76)
    with pytest.raises(RuntimeError, match="cu_seqlens_q and cu_seqlens_k must have the same length"):
        ops.cuda_attention_fwd(q, k, v, None, 0, None, None, cu_q, cu_k[:-1], 0.25, 0.0, -1, 0, max_seqlen_q=70,
                               max_seqlen_k=76)


def test_packed_with_max_seqlen_reads_nothing_back(monkeypatch):
    """Given max_seqlen, a packed CUDA call (forward and backward, dropout included) reads no value of
    any tensor back to the host on its Python path: cu_seqlens is checked on the device and the
    kernels read the segments' bounds there."""
    from tests.core.test_packed import forbid_host_reads
    q, k, v, cu_q, cu_k = _inputs(torch.bfloat16, seed=4)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    go = torch.randn(q.shape[:3] + v.shape[3:]).to(torch.bfloat16)
    with monkeypatch.context() as m:
        forbid_host_reads(m)
        torch.manual_seed(3)
        out = effattn.attention(*leaves, cu_seqlens=(cu_q, cu_k), max_seqlen=(70, 76), causal=True, dropout_p=0.2,
                                backend="cuda")
        grads = torch.autograd.grad(out, leaves, go)
    torch.manual_seed(3)
    ref = effattn.attention(*leaves, cu_seqlens=(cu_q, cu_k), causal=True, dropout_p=0.2, backend="cuda")
    assert torch.equal(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, leaves, go)):
        assert torch.equal(a, b)


def test_score_terms_with_packed_sequences_are_refused():
    """cuda/prefill serves score terms and packed sequences, not both in one call: explain says why."""
    q, k, v, cu_q, cu_k = _inputs(torch.bfloat16)
    e = effattn.explain(q, k, v, cu_seqlens=(cu_q, cu_k), softcap=5.0, backend="cuda")
    assert any("score terms" in r and "packed sequences" in r for r in e.reasons["cuda"])
    assert effattn.explain(q, k, v, cu_seqlens=(cu_q, cu_k), backend="cuda").paths["cuda"].startswith("cuda/prefill:")
    with pytest.raises(Exception, match="score terms"):
        effattn.attention(q, k, v, cu_seqlens=(cu_q, cu_k), softcap=5.0, backend="cuda")


def test_packed_calls_take_the_mma_sync_forward_under_the_hopper_emulation(monkeypatch):
    """With the Hopper forward on (its emulation), a packed call runs on the mma.sync forward (explain
    says so; the result matches float64 per segment) and the Hopper op itself refuses cu_seqlens by
    name; positions with an fp32 output (no segment view) stay on the Hopper forward."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    q, k, v, cu_q, cu_k = _inputs(torch.bfloat16, H=2, Hkv=2, D=40, Dv=40, seed=4)
    text = str(effattn.explain(q, k, v, causal=True, cu_seqlens=(cu_q, cu_k), backend="cuda"))
    assert "packed sequences (cu_seqlens) run on the mma.sync forward" in text, text
    _check(q, k, v, cu_q, cu_k, dict(causal=True), torch.bfloat16)
    from effattn.backends.cuda.attention import ops
    kops = ops.kernels(q.device)
    with pytest.raises(RuntimeError, match="Hopper forward does not serve packed sequences"):
        kops.attention_fwd_sm90(q, k, v, None, None, 0, 0, None, 0, None, 0.1, 0.0, -1, 0, 0.0, None, None,
                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=70, max_seqlen_k=76)
    qc, kc, vc = q[:, :, 10:40], k[:, :, 5:50], v[:, :, 5:50]
    text = str(effattn.explain(qc, kc, vc, causal=True, positions=(30, 5), out_dtype=torch.float32,
                               backend="cuda"))
    assert "Hopper wgmma kernel" in text, text
    out = effattn.attention(qc, kc, vc, causal=True, positions=(30, 5), out_dtype=torch.float32, backend="cuda")
    ref, _ = naive_attention(qc.double(), kc.double(), vc.double(), causal=True, positions=(30, 5))
    assert out.dtype == torch.float32 and (out.double() - ref).abs().max().item() < 2e-2
