"""Reformer LSH attention: against an independent float64 (L, L) reference given the same buckets,
hashing reproducibility, bucket replay, and the argument errors."""
import dataclasses
import math

import pytest
import torch

import effattn
from effattn.lsh import SELF_SCORE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_lsh(qk, v, buckets, chunk_len, chunks_before, chunks_after, causal=False, key_padding_mask=None,
                  scale=None):
    """Written from the definition alone: per round, position t lands in chunk (rank of (bucket, t)) //
    chunk_len; query i sees key j in that round when chunk(j) - chunk(i) is one of the neighbour offsets
    (mod n_chunks). The rounds' lse merge equals one softmax over all keys, each weighted by the number
    of rounds that found it. s_ii = SELF_SCORE; padding and causal (j > i) removed."""
    B, H, L, D = qk.shape
    R = buckets.shape[2]
    nc = L // chunk_len
    scale = 1.0 if scale is None else scale
    offs = {o % nc for o in range(-chunks_before, chunks_after + 1)}
    k = qk / qk.norm(dim=-1, keepdim=True)
    s = torch.einsum("bhid,bhjd->bhij", qk, k) * scale
    eye = torch.eye(L, dtype=torch.bool)
    s = torch.where(eye, torch.full_like(s, SELF_SCORE), s)
    count = torch.zeros(B, H, L, L, dtype=qk.dtype)
    for b in range(B):
        for h in range(H):
            for r in range(R):
                order = sorted(range(L), key=lambda t: (int(buckets[b, h, r, t]), t))
                chunk = [0] * L
                for rank, t in enumerate(order):
                    chunk[t] = rank // chunk_len
                for i in range(L):
                    for j in range(L):
                        if (chunk[j] - chunk[i]) % nc in offs:
                            count[b, h, i, j] += 1
    vis = count > 0
    if causal:
        vis = vis & ~torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    if key_padding_mask is not None:
        vis = vis & ~key_padding_mask[:, None, None, :]
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = count * torch.exp(s - m)
    den = w.sum(-1, keepdim=True)
    return (w / torch.where(den > 0, den, torch.ones_like(den))) @ v


CASES = [  # (B, H, L, D, n_hashes, chunk_len, before, after, causal, padding)
    (1, 2, 16, 8, 2, 4, 1, 0, False, False),
    (2, 1, 24, 4, 3, 4, 1, 1, True, False),
    (2, 2, 16, 8, 2, 8, 1, 0, False, True),
    (1, 1, 16, 4, 2, 4, 2, 1, True, True),
    (1, 1, 8, 4, 1, 8, 1, 0, True, False),      # one chunk: the neighbourhood wraps onto itself
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}-L{}-D{}-R{}-cl{}-b{}a{}{}{}".format(
    *c[:8], "-causal" if c[8] else "", "-pad" if c[9] else ""))
def test_lsh_matches_float64_reference(case):
    B, H, L, D, R, cl, before, after, causal, padded = case
    g = torch.Generator().manual_seed(sum(case[:8]))
    qk = torch.randn(B, H, L, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, H, L, D + 1, dtype=torch.float64, generator=g, requires_grad=True)
    kpm = None
    if padded:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[0, L - 5:] = True
    nb = 4
    buckets = torch.randint(0, nb, (B, H, R, L), generator=g) + torch.arange(R).view(1, 1, R, 1) * nb
    out = effattn.lsh_attention(qk, v, n_hashes=R, chunk_len=cl, chunks_before=before, chunks_after=after,
                                causal=causal, key_padding_mask=kpm, buckets=buckets)
    ref = reference_lsh(qk, v, buckets, cl, before, after, causal, kpm)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qk, v), dout)
    ref_grads = torch.autograd.grad(ref, (qk, v), dout)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_default_scale_is_traxs_and_scale_is_honoured():
    # trax / Hugging Face: keys qk / rms(qk) / sqrt(D) (unit vectors), scores q . k not scaled again;
    # one chunk, so every key is visible and the result is a dense softmax with the self score
    g = torch.Generator().manual_seed(2)
    B, H, L, D = 1, 2, 8, 16
    qk = 3 * torch.randn(B, H, L, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, H, L, D, dtype=torch.float64, generator=g)
    buckets = torch.zeros(B, H, 1, L, dtype=torch.long)
    k = qk / qk.pow(2).mean(-1, keepdim=True).sqrt() / math.sqrt(D)
    s = (qk @ k.transpose(-1, -2)).masked_fill(torch.eye(L, dtype=torch.bool), SELF_SCORE)
    out = effattn.lsh_attention(qk, v, n_hashes=1, chunk_len=L, buckets=buckets)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)
    flat = effattn.lsh_attention(qk, v, n_hashes=1, chunk_len=L, buckets=buckets, scale=1 / math.sqrt(D))
    torch.testing.assert_close(flat, torch.softmax(s / math.sqrt(D), -1) @ v, rtol=1e-12, atol=1e-12)
    assert (flat - out).abs().max() > 0.1


def test_self_only_when_nothing_else():
    # causal: position 0 sees only itself, so its output is v[0] exactly
    qk = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 8, 3, dtype=torch.float64)
    out = effattn.lsh_attention(qk, v, n_hashes=2, chunk_len=4, causal=True)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])


def test_hashing_reproducible_and_replayable():
    qk, v = torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    kw = dict(n_hashes=2, chunk_len=8, return_buckets=True)
    out1, b1 = effattn.lsh_attention(qk, v, generator=torch.Generator().manual_seed(3), **kw)
    out2, b2 = effattn.lsh_attention(qk, v, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(b1, b2) and torch.equal(out1, out2)
    assert b1.shape == (2, 2, 2, 32)
    nb = 4                                                       # default: L // chunk_len, even
    assert int(b1[:, :, 0].min()) >= 0 and int(b1[:, :, 0].max()) < nb
    assert int(b1[:, :, 1].min()) >= nb and int(b1[:, :, 1].max()) < 2 * nb    # offset per round
    out3 = effattn.lsh_attention(qk, v, n_hashes=2, chunk_len=8, buckets=b1)
    assert torch.equal(out3, out1)
    out4, b4 = effattn.lsh_attention(qk, v, generator=torch.Generator().manual_seed(4), **kw)
    assert not torch.equal(b4, b1)


def test_float32_close_to_float64_and_finite():
    g = torch.Generator().manual_seed(0)
    qk = torch.randn(2, 2, 64, 16, generator=g)
    v = torch.randn(2, 2, 64, 16, generator=g)
    kpm = torch.zeros(2, 64, dtype=torch.bool)
    kpm[1, 40:] = True
    out, b = effattn.lsh_attention(qk, v, n_hashes=2, chunk_len=16, causal=True, key_padding_mask=kpm,
                                   return_buckets=True)
    ref = effattn.lsh_attention(qk.double(), v.double(), n_hashes=2, chunk_len=16, causal=True,
                                key_padding_mask=kpm, buckets=b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_fully_padded_rows_are_zero_with_finite_grads():
    qk = torch.randn(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    kpm = torch.ones(1, 8, dtype=torch.bool)
    out = effattn.lsh_attention(qk, v, n_hashes=2, chunk_len=4, key_padding_mask=kpm)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(qk.grad).all() and torch.isfinite(v.grad).all()


def test_layout_is_chunk_and_neighbours():
    lay = effattn.lsh.lsh_layout(32, 8, chunks_before=1, chunks_after=0)
    expected = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(lay.mask[0], expected)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(n_buckets=3), ValueError, "n_buckets must be an even"),
    (dict(chunk_len=5), ValueError, "chunk_len=5 must divide"),
    (dict(n_hashes=0), ValueError, "n_hashes"),
    (dict(chunks_before=-1), ValueError, "chunks_before"),
    (dict(buckets=torch.zeros(1, 2, 3, 16, dtype=torch.long)), ValueError, "buckets must have shape"),
    (dict(buckets=torch.zeros(1, 2, 2, 16)), TypeError, "buckets must be an integer"),
    (dict(key_padding_mask=torch.zeros(1, 15, dtype=torch.bool)), ValueError, "key_padding_mask"),
    (dict(backend="xformers"), ValueError, "backend must be"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
])
def test_errors_name_the_argument(kwargs, err, match):
    qk, v = torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)
    kw = dict(n_hashes=2, chunk_len=4)
    kw.update(kwargs)
    with pytest.raises(err, match=match):
        effattn.lsh_attention(qk, v, **kw)


def test_explain_lsh_names_the_path():
    qk, v = torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)
    assert "torch path" in effattn.explain_lsh(qk, v, n_hashes=2, chunk_len=4)


TRITON_CASES = [  # (B, H, L, D, n_hashes, chunk_len, before, after, causal, padding)
    (1, 2, 64, 8, 2, 16, 1, 0, False, False),
    (2, 1, 48, 12, 2, 16, 1, 1, True, True),
    (1, 1, 64, 16, 3, 32, 1, 0, True, False),
    (1, 1, 64, 8, 2, 32, 1, 0, False, True),
    (1, 1, 128, 8, 2, 64, 1, 0, True, True),
    (1, 1, 64, 16, 2, 64, 1, 0, True, False),      # one chunk
    (1, 1, 32, 8, 2, 8, 1, 0, True, True),         # layout blocks smaller than the kernel tiles
]


def _triton_usable():
    rt = pytest.importorskip("effattn.backends.triton.runtime")
    if rt.triton is None or rt._available(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter is not usable here")


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "B{}-H{}-L{}-D{}-R{}-cl{}-b{}a{}{}{}".format(
    *c[:8], "-causal" if c[8] else "", "-pad" if c[9] else ""))
def test_triton_rows_on_the_block_sparse_kernels_match_reference(case):
    _triton_usable()
    B, H, L, D, R, cl, before, after, causal, padded = case
    g = torch.Generator().manual_seed(7 + sum(case[:8]))
    qk = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    v = torch.randn(B, H, L, D + 3, generator=g, requires_grad=True)
    kpm = None
    if padded:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[-1, L - 9:] = True
    nb = 4
    buckets = torch.randint(0, nb, (B, H, R, L), generator=g) + torch.arange(R).view(1, 1, R, 1) * nb
    kw = dict(n_hashes=R, chunk_len=cl, chunks_before=before, chunks_after=after, causal=causal, key_padding_mask=kpm,
              buckets=buckets)
    text = effattn.explain_lsh(qk, v, backend="triton", **kw)
    assert "block-sparse attention kernels with positions" in text and "tiles of 32 x 32 per head" in text
    out = effattn.lsh_attention(qk, v, backend="triton", **kw)
    q64, v64 = qk.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    ref = effattn.lsh_attention(q64, v64, backend="torch", **kw)                   # the float64 torch/lsh row
    torch.testing.assert_close(ref, reference_lsh(q64, v64, buckets, cl, before, after, causal, kpm))
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (qk, v), dout)
    ref_grads = torch.autograd.grad(ref, (q64, v64), dout.double())
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    again = torch.autograd.grad(effattn.lsh_attention(qk, v, backend="triton", **kw), (qk, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))        # deterministic, bit for bit


def test_triton_token_alone_in_its_chunk_sees_itself():
    """The self penalty: chunks see only themselves and the chunk of sorted positions 0..15 is padding
    but token 0, so token 0 attends to itself alone (out = v[0]) in every round; the rest as torch/lsh."""
    _triton_usable()
    B, H, L, D, R, cl = 1, 1, 32, 8, 2, 16
    g = torch.Generator().manual_seed(21)
    qk = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    v = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    buckets = (torch.arange(L) >= cl).long().view(1, 1, 1, L).repeat(1, 1, R, 1) + torch.arange(R).view(1, 1, R, 1) * 2
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, 1:cl] = True
    kw = dict(n_hashes=R, chunk_len=cl, chunks_before=0, chunks_after=0, key_padding_mask=kpm, buckets=buckets)
    out = effattn.lsh_attention(qk, v, backend="triton", **kw)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0].detach())
    q64, v64 = qk.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    ref = effattn.lsh_attention(q64, v64, backend="torch", **kw)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    dout = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, (qk, v), dout), torch.autograd.grad(ref, (q64, v64), dout.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_triton_dropout_matches_reference_with_the_kernels_mask():
    """Dropout draws from the block-sparse kernels' Philox stream at (rows folded as heads, sorted row,
    sorted key): the mask read off a plain attention call with V = identity and the same seed, then the
    float64 rule on the sorted rows (`positions_reference`) un-sorted and merged must give the row's output
    and gradients. Also its statistics: the kept fraction is about 1 - p."""
    _triton_usable()
    from effattn.backends.triton.attention import launch
    from effattn.lsh import lsh_layout, make_lsh_call, merge_rounds, sorted_rounds, unsorted
    from effattn.numerics import draw_seed
    from effattn.testing.oracle import positions_reference
    B, H, L, D, R, cl, p = 1, 2, 32, 8, 2, 16, 0.25
    g = torch.Generator().manual_seed(11)
    qk = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    v = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -3:] = True
    buckets = torch.randint(0, 4, (B, H, R, L), generator=g) + torch.arange(R).view(1, 1, R, 1) * 4
    torch.manual_seed(5)
    seed = draw_seed()
    N = B * H * R
    x = torch.randn(1, N, L, 4, generator=g)
    eye = torch.eye(L).expand(1, N, L, L).contiguous()
    keep = (launch.fwd(x, x, eye, None, 0, None, seed, 1.0, p, -1, -1)[0] != 0)[0]      # (N, sorted i, sorted j)
    assert abs(keep.float().mean() - (1 - p)) < 0.05
    kw = dict(n_hashes=R, chunk_len=cl, causal=True, key_padding_mask=kpm, buckets=buckets, dropout_p=p)
    torch.manual_seed(5)
    out = effattn.lsh_attention(qk, v, backend="triton", **kw)
    q64, v64 = qk.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    call = make_lsh_call(q64, v64, **{a: b for a, b in kw.items() if a != "buckets"})
    perm = torch.argsort(buckets * L + torch.arange(L), dim=-1)
    call = dataclasses.replace(call, perm=perm, inv=torch.argsort(perm, dim=-1))
    rows = sorted_rounds(call, torch.float64)
    ref_s, lse_s = positions_reference(rows.q[None], rows.k[None], rows.v[None], lsh_layout(L, cl).mask, cl,
                                       rows.pos, rows.key_positions(), True, call.scale, keep=keep, dropout_p=p)
    ref, _ = merge_rounds(*unsorted(ref_s[0], lse_s[0], call), dim=2)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    dout = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, (qk, v), dout), torch.autograd.grad(ref, (q64, v64), dout.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    torch.manual_seed(6)
    assert not torch.equal(effattn.lsh_attention(qk, v, backend="triton", **kw), out)    # another seed, another mask


def test_auto_takes_torch_on_cpu_and_says_why():
    qk, v = torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    text = effattn.explain_lsh(qk, v, n_hashes=2, chunk_len=16)
    assert "torch path" in text and "when asked for by name" in text
    rep = effattn.explain(qk, qk, v, op="lsh_attention", n_hashes=2, chunk_len=16, dropout_p=0.1)
    assert [r.path for r in rep.rows] == ["triton/lsh", "cuda/lsh", "torch/lsh"] and rep.chosen_path == "torch/lsh"
    rep = effattn.explain(qk.double(), None, v.double(), op="lsh_attention", n_hashes=2, chunk_len=16)
    assert "dtype float64 not served" in "; ".join(rep.row("triton/lsh").reasons)


def test_lsh_layout_is_cached_per_length_chunk_and_offsets():
    """One layout object per (L, chunk_len, offsets): the kernels' tile lists, cached on it, are built once."""
    a = effattn.lsh.lsh_layout(64, 16, 1, 0)
    assert effattn.lsh.lsh_layout(64, 16, 1, 0) is a
    assert effattn.lsh.lsh_layout(64, 16, 4, 0) is not a
    assert effattn.lsh.cached_lsh_layout(64, 16, [0, 3]) is a
