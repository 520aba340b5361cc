"""Relative-position keys: against the explicit (L, L) formula in float64 (forward and every
gradient), and Transformer-XL's own layer (u/v biases, pad-and-reshape relative shift, memory)
loaded from a Transformer-XL-style state dict."""
import math

import pytest
import torch
import torch.nn.functional as F

import effattn
from effattn.nn import RelPositionMultiheadAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def explicit_relative(q, k, v, r, query, max_distance, causal, window, kpm, scale):
    """Loops over (i, j) for the position term; dense masks from the conventions."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    pos_term = torch.zeros(B, H, Lq, Lk, dtype=q.dtype)
    n = r.shape[1]
    for i in range(Lq):
        for j in range(Lk):
            d = i + Lk - Lq - j
            m = min(max(d, 0), n - 1) if max_distance is None else min(max(d, -max_distance), max_distance) + max_distance
            pos_term[:, :, i, j] = (query[:, :, i] * r[:, m]).sum(-1)
    s = (q @ k.transpose(-1, -2) + pos_term) * scale
    i = torch.arange(Lq)[:, None] + Lk - Lq
    j = torch.arange(Lk)[None, :]
    vis = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    vis = vis[None, None].expand(B, H, Lq, Lk)
    if kpm is not None:
        vis = vis & ~kpm[:, None, None, :]
    return torch.softmax(s.masked_fill(~vis, -math.inf), -1) @ v


CASES = [  # (B, H, Hkv, Lq, Lk, D, max_distance, causal, window, padding); n_dist = 6 without max_distance
    (1, 2, 1, 20, 45, 5, None, True, (30, 0), True),          # several tiles of 16 and a window
    (1, 1, 1, 37, 37, 4, 20, False, None, False),
    (1, 2, 2, 3, 5, 4, 0, False, None, True),                 # one distance row: everything clamped
    (2, 2, 2, 5, 5, 4, 2, False, None, False),
    (1, 4, 2, 3, 7, 4, None, True, None, False),             # Transformer-XL with memory, GQA
    (2, 2, 1, 6, 6, 3, 8, False, (2, 1), True),               # M larger than every distance
    (1, 2, 2, 4, 9, 4, None, True, (3, 0), False),            # clamp at the last distance
]


@pytest.fixture(params=["one-block", "row-blocks", "triton"])
def row_blocks(request, monkeypatch):
    """The torch path in one block of rows and in blocks of 1 row; the Triton kernels (tiles of 16)."""
    if request.param == "row-blocks":
        monkeypatch.setattr(effattn.relative, "SCORE_BUDGET", 1)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}-Hkv{}-Lq{}-Lk{}-D{}-M{}".format(*c[:7]) +
                         ("-causal" if c[7] else "") + ("-window" if c[8] else "") + ("-pad" if c[9] else ""))
def test_relative_matches_explicit_formula(case, row_blocks):
    B, H, Hkv, Lq, Lk, D, M, causal, window, padded = case
    g = torch.Generator().manual_seed(Lq * Lk + D)
    f64 = dict(dtype=torch.float64, generator=g)
    q = torch.randn(B, H, Lq, D, **f64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, **f64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, D + 1, **f64, requires_grad=True)
    n = 2 * M + 1 if M is not None else 6
    r = torch.randn(H, n, D, **f64, requires_grad=True)
    query = torch.randn(B, H, Lq, D, **f64, requires_grad=True)
    kpm = None
    if padded:
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[-1, 1] = True
    kw = dict(query=query, max_distance=M, causal=causal, window=window, key_padding_mask=kpm, scale=0.7)
    ref = explicit_relative(q, k, v, r, query, M, causal, window, kpm, 0.7)
    inputs = (q, k, v, r, query)
    tol = dict(rtol=1e-10, atol=1e-10)
    if row_blocks == "triton":                 # float32 kernel, judged against the float64 formula
        inputs = tuple(t.detach().float().requires_grad_() for t in inputs)
        kw["query"] = inputs[4]
        assert "triton forward" in effattn.relative.explain_relative(inputs[0], backend="triton")
        out = effattn.relative_attention(*inputs[:4], backend="triton", **kw)
        tol = dict(rtol=2e-5, atol=2e-5)
    else:
        out = effattn.relative_attention(q, k, v, r, **kw)
    torch.testing.assert_close(out.double(), ref, **tol)
    dout = torch.randn(out.shape, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v, r, query), dout)
    grads = torch.autograd.grad(out, inputs, dout.to(out.dtype))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, **{k: 10 * x for k, x in tol.items()})
    if row_blocks == "triton":                 # no atomics: bitwise the same again
        again = effattn.relative_attention(*inputs[:4], backend="triton", **kw)
        assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(again, inputs, dout.to(out.dtype))))


def test_explain_lists_the_rows():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    r = torch.randn(2, 3, 4)
    rep = effattn.explain(q, k, v, op="relative_attention", r=r, max_distance=1, dropout_p=0.2)
    assert [x.path for x in rep.rows] == ["triton/relative", "cuda/relative", "torch/relative"]
    assert rep.chosen_path == "torch/relative"
    for row in ("triton/relative", "cuda/relative"):
        assert "does not support dropout" in "; ".join(rep.row(row).reasons)
    with pytest.raises(ValueError, match="relative_attention: backend 'triton' cannot serve this call: .*dropout"):
        effattn.relative_attention(q, k, v, r, max_distance=1, dropout_p=0.2, backend="triton")


def test_dropout_path_runs_and_is_reproducible():
    q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
    r = torch.randn(2, 6, 4, requires_grad=True)
    torch.manual_seed(0)
    a = effattn.relative_attention(q, k, v, r, causal=True, dropout_p=0.3)
    torch.manual_seed(0)
    b = effattn.relative_attention(q, k, v, r, causal=True, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.allclose(a, effattn.relative_attention(q, k, v, r, causal=True))
    a.sum().backward()
    assert torch.isfinite(r.grad).all()


def test_relative_keys_term():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=g) for _ in range(3))
    r = torch.randn(2, 3, 3, dtype=torch.float64, generator=g)
    term = effattn.bias.RelativeKeys(r, max_distance=1)
    assert effattn.relative.RelativeKeys is term.__class__          # one class, public in both modules
    s = (q @ k.transpose(-1, -2) + term.scores(q, 4)) / math.sqrt(3)
    torch.testing.assert_close(effattn.attention(q, k, v, bias=term), torch.softmax(s, -1) @ v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_bias_relative_keys_is_relative_attention(backend):
    """``attention(..., bias=RelativeKeys(r, query, M))`` runs the rows of relative_attention: the same
    output, lse and gradients bitwise (q, k, v, r, query), Transformer-XL's u / v form against the
    explicit formula, and explain lists those rows."""
    g = torch.Generator().manual_seed(11)
    dt = torch.float64 if backend == "torch" else torch.float32
    B, H, Hkv, Lq, Lk, D = 1, 4, 2, 9, 21, 4
    q, query = (torch.randn(B, H, Lq, D, dtype=dt, generator=g, requires_grad=True) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Lk, D, dtype=dt, generator=g, requires_grad=True) for _ in range(2))
    r = torch.randn(H, 7, D, dtype=dt, generator=g, requires_grad=True)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, 3] = True
    kw = dict(causal=True, window=(12, 0), key_padding_mask=kpm, scale=0.6, return_lse=True, backend=backend)
    out, lse = effattn.attention(q, k, v, bias=effattn.bias.RelativeKeys(r, query=query), **kw)
    out2, lse2 = effattn.relative_attention(q, k, v, r, query=query, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    inputs, dout = (q, k, v, r, query), torch.randn(out.shape, dtype=dt, generator=g)
    for a, b in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(out2, inputs, dout)):
        assert torch.equal(a, b)
    # Transformer-XL: (q + u) . k_j + (q + v) . R_{i-j}, against the (L, L) formula in float64
    u, vb = (torch.randn(H, 1, D, dtype=dt, generator=g) for _ in range(2))
    got = effattn.attention(q + u, k, v, bias=effattn.bias.RelativeKeys(r, query=q + vb), causal=True, scale=0.6,
                            backend=backend)
    d64 = [t.detach().double() for t in (q + u, k, v, r, q + vb)]
    ref = explicit_relative(*d64[:4], d64[4], None, True, None, None, 0.6)
    torch.testing.assert_close(got.double(), ref, **({} if backend == "torch" else dict(rtol=2e-5, atol=2e-5)))
    text = str(effattn.explain(q, k, v, bias=effattn.bias.RelativeKeys(r), causal=True, backend=backend))
    assert text.startswith("effattn.relative_attention:") and f"{backend}/relative" in text


def test_attention_bias_relative_keys_refusals():
    q = torch.randn(1, 2, 5, 4)
    term = effattn.bias.RelativeKeys(torch.randn(2, 3, 4), max_distance=1)
    for name, value in [("softcap", 2.0), ("sinks", torch.zeros(2)), ("positions", (0, 0)),
                        ("layout", effattn.layouts.local(8, 4, num_local_blocks=1)), ("out_dtype", torch.float32)]:
        with pytest.raises(ValueError, match=f"RelativeKeys.*got {name}"):
            effattn.attention(q, q, q, bias=term, **{name: value})
        with pytest.raises(ValueError, match=f"RelativeKeys.*got {name}"):
            effattn.explain(q, q, q, bias=term, **{name: value})
    with pytest.raises(ValueError, match="bias=RelativeKeys.*alone"):
        effattn.attention(q, q, q, bias=[term, effattn.bias.ALiBi(torch.ones(2))])
    with pytest.raises(ValueError, match="r must have shape"):
        effattn.attention(q, q, q, bias=effattn.bias.RelativeKeys(torch.randn(3, 3, 4), max_distance=1))


def test_query_defaults_to_q():
    q, k, v = (torch.randn(1, 2, 4, 4, dtype=torch.float64) for _ in range(3))
    r = torch.randn(2, 3, 4, dtype=torch.float64)
    a = effattn.relative_attention(q, k, v, r, max_distance=1)
    b = effattn.relative_attention(q, k, v, r, query=q.clone(), max_distance=1)
    torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ Transformer-XL's own formulation

def rel_shift(x):
    """Transformer-XL's relative shift of x (qlen, klen, B, H): prepend a zero column, reshape, drop."""
    pad = torch.zeros(x.shape[0], 1, *x.shape[2:], dtype=x.dtype)
    x = torch.cat([pad, x], dim=1).view(x.shape[1] + 1, x.shape[0], *x.shape[2:])
    return x[1:].reshape(x.shape[1], x.shape[0] - 1, *x.shape[2:])


def txl_layer(w, mems, sd, n_head, d_head, pre_lnorm):
    """Transformer-XL's relative attention layer in its (L, B, E) layout, positions descending."""
    qlen, bsz, d_model = w.shape
    cat = torch.cat([mems, w], 0)
    klen, mlen = cat.shape[0], mems.shape[0]
    pos_seq = torch.arange(klen - 1, -1, -1.0, dtype=w.dtype)
    inv_freq = 1 / (10000 ** (torch.arange(0.0, d_model, 2.0, dtype=w.dtype) / d_model))
    pos_emb = torch.cat([torch.outer(pos_seq, inv_freq).sin(), torch.outer(pos_seq, inv_freq).cos()], -1)

    def ln(x):
        return F.layer_norm(x, (d_model,), sd["layer_norm.weight"], sd["layer_norm.bias"])

    heads = F.linear(ln(cat) if pre_lnorm else cat, sd["qkv_net.weight"])
    r_head_k = F.linear(pos_emb, sd["r_net.weight"]).view(klen, n_head, d_head)
    hq, hk, hv = heads.chunk(3, dim=-1)
    hq = hq[-qlen:].view(qlen, bsz, n_head, d_head)
    hk, hv = hk.view(klen, bsz, n_head, d_head), hv.view(klen, bsz, n_head, d_head)
    AC = torch.einsum("ibnd,jbnd->ijbn", hq + sd["r_w_bias"], hk)
    BD = rel_shift(torch.einsum("ibnd,jnd->ijbn", hq + sd["r_r_bias"], r_head_k))
    score = (AC + BD) / math.sqrt(d_head)
    mask = torch.triu(torch.ones(qlen, klen, dtype=torch.bool), diagonal=1 + mlen)[:, :, None, None]
    prob = torch.softmax(score.masked_fill(mask, -math.inf), dim=1)
    vec = torch.einsum("ijbn,jbnd->ibnd", prob, hv).reshape(qlen, bsz, n_head * d_head)
    out = F.linear(vec, sd["o_net.weight"])
    return w + out if pre_lnorm else ln(w + out)


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_loads_transformer_xl_state_dict_and_matches_it(pre_lnorm):
    g = torch.Generator().manual_seed(1)
    d_model, n_head, d_head, qlen, mlen, bsz = 12, 3, 5, 4, 6, 2
    f64 = dict(dtype=torch.float64, generator=g)
    sd = {"qkv_net.weight": torch.randn(3 * n_head * d_head, d_model, **f64) * 0.3,
          "r_net.weight": torch.randn(n_head * d_head, d_model, **f64) * 0.3,
          "o_net.weight": torch.randn(d_model, n_head * d_head, **f64) * 0.3,
          "layer_norm.weight": 1 + 0.1 * torch.randn(d_model, **f64),
          "layer_norm.bias": 0.1 * torch.randn(d_model, **f64),
          "r_w_bias": torch.randn(n_head, d_head, **f64), "r_r_bias": torch.randn(n_head, d_head, **f64)}
    m = RelPositionMultiheadAttention(d_model, n_head, head_dim=d_head, pre_lnorm=pre_lnorm, batch_first=False,
                                      dtype=torch.float64)
    m.load_state_dict(sd)                                         # strict: the names are Transformer-XL's
    w = torch.randn(qlen, bsz, d_model, **f64)
    mems = torch.randn(mlen, bsz, d_model, **f64)
    torch.testing.assert_close(m(w, memory=mems), txl_layer(w, mems, sd, n_head, d_head, pre_lnorm),
                               rtol=1e-10, atol=1e-10)
    # batch-first, no memory: the same as Transformer-XL with an empty memory
    mb = RelPositionMultiheadAttention(d_model, n_head, head_dim=d_head, pre_lnorm=pre_lnorm, dtype=torch.float64)
    mb.load_state_dict(sd)
    torch.testing.assert_close(mb(w.transpose(0, 1)).transpose(0, 1), txl_layer(w, mems[:0], sd, n_head, d_head,
                                                                                  pre_lnorm), rtol=1e-10, atol=1e-10)


def test_module_trains_and_non_causal_runs():
    torch.manual_seed(0)
    m = RelPositionMultiheadAttention(16, 2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    m(x, memory=torch.randn(2, 3, 16)).sum().backward()
    assert m.r_r_bias.grad is not None and m.r_net.weight.grad is not None and torch.isfinite(x.grad).all()
    bi = RelPositionMultiheadAttention(16, 2, causal=False)
    assert bi(x).shape == x.shape
    assert "not fused" in m.explain()


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(r=torch.randn(3, 5, 4)), ValueError, r"r must have shape \(H=2, n_dist, D=4\)"),
    (dict(r=torch.randn(2, 4, 4), max_distance=2), ValueError, "2 \\* max_distance \\+ 1 = 5"),
    (dict(r=torch.randn(2, 4, 4)), ValueError, "past distances only"),
    (dict(r=torch.randn(2, 5, 4), max_distance=2, query=torch.randn(1, 2, 3, 4)), ValueError, "query must be"),
    (dict(r=torch.randn(2, 5, 4, dtype=torch.float64), max_distance=2), TypeError, "r must share"),
])
def test_relative_errors_name_the_argument(kwargs, err, match):
    q, k, v = (torch.randn(1, 2, 4, 4) for _ in range(3))
    r = kwargs.pop("r")
    with pytest.raises(err, match=match):
        effattn.relative_attention(q, k, v, r, **kwargs)
