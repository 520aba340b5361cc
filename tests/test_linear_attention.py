"""linear_attention (torch reference) against an independent dense float64 oracle.

The oracle builds the explicit (Lq x Lk) weight matrix A = phi(q) phi(k)^T, masks it (bottom-right
causal), and computes A v / (A.sum(-1) + eps): nothing of the chunked/state form is shared with the
implementation. Low precision is judged against the error of the same naive computation done in that
dtype (2x for outputs, 3x for gradients).
"""
import zlib

import pytest
import torch
import torch.nn.functional as F

from effattn.feature_maps import FavorFeatures
from effattn.linear import LinearCall, linear_attention
from oracle import feature_map

torch.set_num_threads(2)
F64 = torch.float64


# ------------------------------------------------------------------------------------------ oracle

def oracle_phi(name, favor=None, fn=None):
    """Feature maps written independently of effattn.feature_maps (tests/oracle.py)."""
    return feature_map(name, favor, fn)


def oracle(q, k, v, phi, *, causal, normalize, eps=1e-6, S0=None, z0=None, dtype=F64):
    """Dense linear attention in `dtype` (float64: the oracle; low precision: the naive baseline)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    fq, fk = phi(q).to(dtype), phi(k).to(dtype)
    A = fq @ fk.transpose(-1, -2)                                     # (B, H, Lq, Lk)
    Lq, Lk = A.shape[-2:]
    if causal:
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        A = A * (j <= i + (Lk - Lq))
    num, den = A @ v, A.sum(-1)
    if S0 is not None:
        num = num + fq @ S0.to(dtype)
        den = den + (fq * z0.to(dtype)[:, :, None, :]).sum(-1)
    return num / (den + eps)[..., None] if normalize else num


def oracle_state(k, v, phi, H, S0=None, z0=None):
    G = H // k.shape[1]
    fk = phi(k.to(F64)).repeat_interleave(G, 1)
    S = fk.transpose(-1, -2) @ v.to(F64).repeat_interleave(G, 1)
    z = fk.sum(-2)
    if S0 is not None:
        S, z = S + S0, z + z0
    return S, z


# ------------------------------------------------------------------------------------------ inputs

def rand(shape, dtype=F64, transposed=False, positive=False, scale=1.0):
    """Fresh random tensor; `transposed` makes the (B, H, L, D) tensor a view of a (B, L, H, D) one."""
    B, H, L, D = shape
    x = torch.randn(B, L, H, D, dtype=F64).transpose(1, 2) if transposed else torch.randn(shape, dtype=F64)
    x = x * scale
    if positive:
        x = x.abs() + 0.1
    x = x.to(dtype)
    if transposed and H > 1 and L > 1:
        assert not x.is_contiguous()
    return x


LAMBDA = lambda x: torch.cat([F.softplus(x), 0.5 * x * x], -1)  # noqa: E731  F = 2D, differentiable
FMAPS = ["elu", "relu", "identity", "favor", "lambda"]


def feature_map_args(name, D):
    """(argument for linear_attention, oracle phi)."""
    if name == "favor":
        m = FavorFeatures(D, 48, seed=3)
        return m, oracle_phi("favor", favor=m)
    if name == "lambda":
        return LAMBDA, LAMBDA
    return name, oracle_phi(name)


# (B, H, Hkv, Lq, Lk, D, Dv, transposed)
SHAPES = [
    (2, 4, 2, 37, 37, 16, 24, False),
    (1, 4, 1, 130, 130, 8, 5, True),     # MQA, two chunks + a partial one, non-contiguous
    (2, 2, 2, 1, 1, 16, 16, False),
    (1, 2, 1, 64, 64, 12, 12, True),     # exactly one chunk
    (1, 4, 2, 23, 50, 16, 8, False),     # Lq < Lk: a prefix every query sees
    (1, 2, 2, 50, 23, 16, 8, False),     # Lq > Lk: leading queries see no key
    (2, 2, 1, 1, 77, 8, 8, True),        # a decoding step
]


def shape_id(s):
    B, H, Hkv, Lq, Lk, D, Dv, tr = s
    L = f"L{Lq}" if Lq == Lk else f"Lq{Lq}-Lk{Lk}"
    return f"B{B}-H{H}-Hkv{Hkv}-{L}-D{D}-Dv{Dv}" + ("-noncontig" if tr else "")


def make_qkv(shape, dtype=F64, positive=False, scale=1.0):
    B, H, Hkv, Lq, Lk, D, Dv, tr = shape
    q = rand((B, H, Lq, D), dtype, tr, positive, scale)
    k = rand((B, Hkv, Lk, D), dtype, tr, positive, scale)
    v = rand((B, Hkv, Lk, Dv), dtype, tr)
    return q, k, v


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


# ------------------------------------------------------------------------------- float64 vs oracle

@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("fmap", FMAPS)
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_dense_oracle_fp64(causal, normalize, fmap, shape):
    torch.manual_seed(zlib.crc32(repr((causal, normalize, fmap, shape)).encode()))
    D = shape[5]
    # identity features can be negative: keep the normalized denominator away from 0
    q, k, v = make_qkv(shape, positive=(fmap == "identity" and normalize), scale=0.5 if fmap == "favor" else 1.0)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    arg, phi = feature_map_args(fmap, D)
    out = linear_attention(q, k, v, causal=causal, feature_map=arg, normalize=normalize)
    ref = oracle(q, k, v, phi, causal=causal, normalize=normalize)
    assert out.dtype == F64 and out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    dout = torch.randn_like(out)
    for g, gr, name in zip(grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout), "qkv"):
        torch.testing.assert_close(g, gr, rtol=1e-8, atol=1e-9, msg=lambda m: f"d{name}: {m}")


# --------------------------------------------------------------------------- low precision vs naive

FLOORS = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
LOW_SHAPE = (2, 4, 2, 130, 130, 16, 24, True)


@pytest.mark.parametrize("fmap", ["elu", "favor"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_low_precision_within_2x_of_naive(dtype, causal, normalize, fmap):
    torch.manual_seed(7)
    q, k, v = make_qkv(LOW_SHAPE, dtype=dtype, scale=0.5 if fmap == "favor" else 1.0)
    arg, phi = feature_map_args(fmap, q.shape[-1])
    q64, k64, v64 = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))

    out = linear_attention(ql, kl, vl, causal=causal, feature_map=arg, normalize=normalize)
    ref = oracle(q64, k64, v64, phi, causal=causal, normalize=normalize)
    naive = oracle(ql, kl, vl, phi, causal=causal, normalize=normalize, dtype=dtype)
    assert out.dtype == dtype and not out.isnan().any()
    floor = FLOORS[dtype] * ref.abs().max().item()
    err, err_naive = (out.double() - ref).abs().max().item(), (naive.double() - ref).abs().max().item()
    assert err <= 2 * err_naive + floor, f"out: err {err:.3g} vs naive {err_naive:.3g}"

    dout = torch.randn_like(ref)
    g_out = grads(out, (ql, kl, vl), dout.to(dtype))
    g_ref = grads(ref, (q64, k64, v64), dout)
    g_naive = grads(naive, (ql, kl, vl), dout.to(dtype))
    for name, g, gr, gn in zip("qkv", g_out, g_ref, g_naive):
        assert not g.isnan().any()
        e, en = (g.double() - gr).abs().max().item(), (gn.double() - gr).abs().max().item()
        assert e <= 3 * en + FLOORS[dtype] * gr.abs().max().item(), f"d{name}: err {e:.3g} vs naive {en:.3g}"


# -------------------------------------------------------------------------------- state passing

@pytest.mark.parametrize("fmap", ["elu", "favor"])
@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_segments_with_state_equal_one_call(causal, Hkv, fmap):
    torch.manual_seed(11)
    B, H, L, D, Dv = 2, 4, 130, 16, 8
    q, k, v = make_qkv((B, H, Hkv, L, L, D, Dv, True), scale=0.5)
    arg, phi = feature_map_args(fmap, D)
    full, (S_full, z_full) = linear_attention(q, k, v, causal=causal, feature_map=arg, return_state=True)
    S_ref, z_ref = oracle_state(k, v, phi, H)
    torch.testing.assert_close(S_full, S_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(z_full, z_ref, rtol=1e-10, atol=1e-10)

    state, outs, start = None, [], 0
    for n in (40, 1, 89):  # crosses a chunk boundary inside a segment, and a length-1 segment
        sl = slice(start, start + n)
        o, state = linear_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=causal, feature_map=arg,
                                    initial_state=state, return_state=True)
        if not causal:  # a non-causal segment sees every key so far, its own included
            e = start + n
            torch.testing.assert_close(o, oracle(q[:, :, sl], k[:, :, :e], v[:, :, :e], phi, causal=False,
                                                 normalize=True), rtol=1e-9, atol=1e-10)
        outs.append(o)
        start += n
    if causal:
        torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state[0], S_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state[1], z_full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_initial_state_per_query_head_and_its_gradient(causal):
    """Within a GQA group the query heads may carry different states: each is honored, and gradients
    reach S0 and z0. The oracle: per query head, attention over (its own previous keys + the
    current keys)."""
    torch.manual_seed(5)
    B, H, Hkv, L, Lp, D, Dv = 2, 4, 2, 37, 20, 8, 6
    phi = oracle_phi("elu")
    q, k, v = make_qkv((B, H, Hkv, L, L, D, Dv, False))
    kp, vp = torch.randn(B, H, Lp, D, dtype=F64), torch.randn(B, H, Lp, Dv, dtype=F64)
    S0 = (phi(kp).transpose(-1, -2) @ vp).requires_grad_()           # (B, H, F, Dv): differs per head
    z0 = phi(kp).sum(-2).requires_grad_()
    q.requires_grad_()
    out, (S, z) = linear_attention(q, k, v, causal=causal, initial_state=(S0, z0), return_state=True)
    ref = oracle(q, k, v, phi, causal=causal, normalize=True, S0=S0, z0=z0)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    # the same thing spelled as one dense call per query head over [previous keys; current keys]
    kk = torch.cat([kp, k.repeat_interleave(2, 1)], 2)
    vv = torch.cat([vp, v.repeat_interleave(2, 1)], 2)
    # causal: bottom-right alignment with Lk = Lp + L makes the previous keys visible to every query
    ref2 = oracle(q, kk, vv, phi, causal=causal, normalize=True)
    torch.testing.assert_close(out, ref2, rtol=1e-9, atol=1e-10)
    S_ref, z_ref = oracle_state(k, v, phi, H, S0, z0)
    torch.testing.assert_close(S, S_ref)
    torch.testing.assert_close(z, z_ref)

    douts = (torch.randn_like(out), torch.randn_like(S), torch.randn_like(z))
    g = torch.autograd.grad((out, S, z), (q, S0, z0), douts)
    g_ref = torch.autograd.grad((ref, S_ref, z_ref), (q, S0, z0), douts)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_state_dtype_and_low_precision_state_passing():
    torch.manual_seed(2)
    q, k, v = make_qkv((1, 2, 1, 100, 100, 16, 16, False), dtype=torch.bfloat16)
    full = linear_attention(q, k, v, causal=True)
    o1, st = linear_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], causal=True, return_state=True)
    assert st[0].dtype == torch.float32 and st[1].dtype == torch.float32
    o2 = linear_attention(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], causal=True, initial_state=st)
    # same fp32 sums in another order: at most one bf16 rounding step apart
    torch.testing.assert_close(torch.cat([o1, o2], 2).float(), full.float(), rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------------- edge behaviour

def test_relu_query_that_sees_nothing_outputs_zero_not_nan():
    q = -torch.rand(1, 1, 3, 4, dtype=F64) - 0.1                      # relu(q) == 0
    k, v = torch.randn(1, 1, 3, 4, dtype=F64), torch.randn(1, 1, 3, 2, dtype=F64)
    for eps in (1e-6, 0.0):
        out = linear_attention(q.requires_grad_(), k, v, feature_map="relu", eps=eps)
        assert (out == 0).all()
        (g,) = torch.autograd.grad(out.sum(), q)
        assert not g.isnan().any()


def test_causal_lq_gt_lk_leading_queries_output_zero():
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = linear_attention(q, k, v, causal=True)
    assert (out[:, :, :6] == 0).all() and (out[:, :, 6:] != 0).all()


def test_call_record_features_and_explicit_torch_backend():
    from effattn.linear import make_linear_call
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    call = make_linear_call(q, k, v, causal=True, normalize=False, return_state=True)
    assert isinstance(call, LinearCall)
    assert call.features() == {"causal", "gqa", "state", "no_normalize", "feature_map=elu"}
    assert "feature_map=relu" in make_linear_call(q, k, v, feature_map="relu").features()
    assert "feature_map=callable" in make_linear_call(q, k, v, feature_map=LAMBDA).features()
    assert call.num_features == 8 and call.feature_map_name == "elu"
    assert make_linear_call(q, k, v, feature_map=LAMBDA).num_features == 16
    torch.testing.assert_close(linear_attention(q, k, v, backend="torch"), linear_attention(q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiles_without_graph_breaks(causal):
    """The public function, FAVOR+ features and state included, traces as one graph (no .item(), no
    data-dependent Python branches)."""
    torch._dynamo.reset()
    m = FavorFeatures(8, 16, seed=0)
    q, k, v = torch.randn(1, 4, 70, 8), torch.randn(1, 2, 70, 8), torch.randn(1, 2, 70, 6)
    S0, z0 = torch.rand(1, 4, 16, 6), torch.rand(1, 4, 16)

    def fn(q, k, v, S0, z0):
        return linear_attention(q, k, v, causal=causal, feature_map=m, initial_state=(S0, z0), return_state=True)

    got = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v, S0, z0)
    want = fn(q, k, v, S0, z0)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# ------------------------------------------------------------------------------------------ errors

def _qkv():
    return torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 5)


BAD = [
    ("feature_map-name", dict(feature_map="softmax"), ValueError, r"feature_map.*'elu', 'relu', 'identity'"),
    ("feature_map-type", dict(feature_map=3), TypeError, r"feature_map must be"),
    ("feature_map-shape", dict(feature_map=lambda x: x.sum(-1)), ValueError, r"feature_map must map"),
    ("favor-head-dim", dict(feature_map=FavorFeatures(16, 8, seed=0)), ValueError, r"head_dim=16.*D=8"),
    ("eps-negative", dict(eps=-1e-3), ValueError, r"eps must be"),
    ("eps-type", dict(eps="1e-6"), TypeError, r"eps must be"),
    ("causal-type", dict(causal=1), TypeError, r"causal must be a bool"),
    ("normalize-type", dict(normalize=None), TypeError, r"normalize must be a bool"),
    ("state-type", dict(initial_state=torch.zeros(2, 4, 8, 5)), TypeError, r"initial_state must be a pair"),
    ("state-S0-shape", dict(initial_state=(torch.zeros(2, 2, 8, 5), torch.zeros(2, 4, 8))), ValueError,
     r"initial_state S0 must have shape \(2, 4, 8, 5\)"),
    ("state-z0-shape", dict(initial_state=(torch.zeros(2, 4, 8, 5), torch.zeros(2, 4, 7))), ValueError,
     r"initial_state z0 must have shape \(2, 4, 8\)"),
    ("state-F-of-map", dict(feature_map=LAMBDA, initial_state=(torch.zeros(2, 4, 8, 5), torch.zeros(2, 4, 8))),
     ValueError, r"S0 must have shape \(2, 4, 16, 5\)"),
    ("state-int", dict(initial_state=(torch.zeros(2, 4, 8, 5, dtype=torch.long), torch.zeros(2, 4, 8))),
     TypeError, r"S0 must be a floating"),
    ("backend-name", dict(backend="fast"), ValueError, r"backend must be one of"),
]


@pytest.mark.parametrize("kwargs,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments(kwargs, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        linear_attention(q, k, v, **kwargs)


BAD_QKV = [
    ("heads-not-multiple", lambda q, k, v: (q[:, :3], k, v), ValueError, r"multiple of the key/value heads"),
    ("mixed-dtype", lambda q, k, v: (q, k.double(), v), TypeError, r"share one dtype"),
    ("batch", lambda q, k, v: (q[:1], k, v), ValueError, r"batch size mismatch"),
    ("not-4d", lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D"),
    ("int-dtype", lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, r"unsupported dtype"),
]


@pytest.mark.parametrize("mutate,exc,match", [b[1:] for b in BAD_QKV], ids=[b[0] for b in BAD_QKV])
def test_bad_qkv(mutate, exc, match):
    with pytest.raises(exc, match=match):
        linear_attention(*mutate(*_qkv()))


def test_backend_without_a_kernel_says_so(monkeypatch):
    """A backend that exists but registers no linear-attention kernel says exactly that."""
    from effattn.backends import base
    q, k, v = _qkv()
    monkeypatch.delitem(base._REGISTRY["linear_attention"], "torch")
    with pytest.raises(RuntimeError, match=r"backend 'torch' has no linear_attention kernel"):
        linear_attention(q, k, v, backend="torch")
