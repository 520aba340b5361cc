"""linear_attention, for every backend usable here, against an independent dense float64 oracle.

The oracle builds the explicit (Lq x Lk) weight matrix A = phi(q) phi(k)^T, masks it (bottom-right
causal), and computes A v / (A.sum(-1) + eps): nothing of the chunked/state form is shared with the
implementation. Low precision is judged against the error of the same naive computation done in that
dtype (2x for outputs, 3x for gradients).

The suite is parametrized by backend (conftest.op_backends): each runs in the first dtype it declares
(float64 for torch, float32 for Triton) against the oracle, and in its low-precision dtypes against
the naive baseline. Triton's interpreter (CPU) is slow, so there it runs a rotating subset of the
(causal, normalize, feature map, shape) combinations that still covers each value of each axis; on
a GPU every backend runs the full product.
"""
import zlib

import pytest
import torch
import torch.nn.functional as F

from effattn.feature_maps import FavorFeatures
from effattn.linear import LinearCall, linear_attention
from effattn.testing.oracle import feature_map
from tests.conftest import DEVICE, declared_dtypes, op_backends

torch.set_num_threads(2)
F64 = torch.float64
BACKENDS = op_backends("linear_attention")


def interpreted(backend):
    """Triton on the CPU runs in its interpreter, CUDA on the CPU in its emulation (EFFATTN_CUDA_EMU=1):
    correct, but ~1 s a launch at these shapes."""
    return backend in ("triton", "cuda") and DEVICE.type == "cpu"


def first_dtype(backend):
    return declared_dtypes("linear_attention", backend)[0]


# max error of a float32 result relative to the oracle's largest magnitude
REL_TOL = {F64: 1e-9, torch.float32: 2e-5}


def close_to(got, ref, dtype, what, grad=False):
    assert got.dtype == dtype and got.shape == ref.shape and not got.isnan().any(), what
    if dtype == F64:
        rtol, atol = (1e-8, 1e-9) if grad else (1e-9, 1e-10)
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
        return
    err = (got.double() - ref).abs().max().item()
    bound = REL_TOL[dtype] * (10 if grad else 1) * max(ref.abs().max().item(), 1e-2)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------------------------------ oracle

def oracle_phi(name, favor=None, fn=None):
    """Feature maps written independently of effattn.feature_maps (effattn/testing/oracle.py)."""
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
        i = torch.arange(Lq, device=A.device)[:, None]
        j = torch.arange(Lk, device=A.device)[None, :]
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
    x = x.to(dtype).to(DEVICE)
    if transposed and H > 1 and L > 1:
        assert not x.is_contiguous()
    return x


LAMBDA = lambda x: torch.cat([F.softplus(x), 0.5 * x * x], -1)  # noqa: E731  F = 2D, differentiable
FMAPS = ["elu", "relu", "identity", "favor", "lambda"]


def feature_map_args(name, D):
    """(argument for linear_attention, oracle phi)."""
    if name == "favor":
        m = FavorFeatures(D, 48, seed=3).to(DEVICE)
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


# ----------------------------------------------------------------------- first dtype vs oracle

def _rotate(backend, combos, shapes=None):
    """All of `combos` x `shapes` for a compiled backend; for the interpreter one shape per combo,
    the shapes taken in turn, and half of the combos: of each group of four (one value of the last
    axis, the first two axes' four pairs) alternately the even and the odd ones, so every value of
    every axis still appears."""
    out = []
    for i, combo in enumerate(combos):
        if not interpreted(backend):
            out += [(backend, *combo, shape) for shape in shapes] if shapes else [(backend, *combo)]
        elif (i + i // 4) % 2 == 0:
            out.append((backend, *combo, shapes[(i // 2) % len(shapes)]) if shapes else (backend, *combo))
    return out


def _id(params):
    return "-".join(shape_id(p) if isinstance(p, tuple) else (p if isinstance(p, str) else
                    {True: "T", False: "F"}.get(p, str(p))) for p in params)


# (causal, normalize, feature map) in an order where every other one still covers each value
ORACLE_COMBOS = [(c, n, f) for f in FMAPS for c, n in ((False, True), (True, False), (True, True), (False, False))]
ORACLE_PARAMS = [p for b in BACKENDS for p in _rotate(b, ORACLE_COMBOS, SHAPES)]


@pytest.mark.parametrize("backend,causal,normalize,fmap,shape", ORACLE_PARAMS, ids=[_id(p) for p in ORACLE_PARAMS])
def test_matches_dense_oracle(backend, causal, normalize, fmap, shape):
    """The backend in its most precise dtype against the float64 oracle, forward and backward."""
    torch.manual_seed(zlib.crc32(repr((causal, normalize, fmap, shape)).encode()))
    D, dtype = shape[5], first_dtype(backend)
    # identity features can be negative: keep the normalized denominator away from 0
    q, k, v = make_qkv(shape, positive=(fmap == "identity" and normalize), scale=0.5 if fmap == "favor" else 1.0)
    arg, phi = feature_map_args(fmap, D)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = linear_attention(*leaves, causal=causal, feature_map=arg, normalize=normalize, backend=backend)
    ref = oracle(q, k, v, phi, causal=causal, normalize=normalize)
    close_to(out, ref, dtype, "out")
    dout = torch.randn_like(ref)
    for g, gr, name in zip(grads(out, leaves, dout.to(dtype)), grads(ref, (q, k, v), dout), "qkv"):
        close_to(g, gr, dtype, f"d{name}", grad=True)


# --------------------------------------------------------------------------- low precision vs naive

FLOORS = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
LOW_SHAPE = (2, 4, 2, 130, 130, 16, 24, True)


LOW_COMBOS = [(c, n, f) for f in ("elu", "favor")
              for c, n in ((False, True), (True, False), (True, True), (False, False))]
# the interpreter: a smaller shape
INTERP_LOW_SHAPE = (1, 4, 2, 100, 100, 16, 24, True)


def _low_params(backends=BACKENDS):
    out = []
    for b in backends:
        for dtype in declared_dtypes("linear_attention", b):
            if dtype == F64 or (interpreted(b) and dtype == torch.float32):
                continue
            params = [(b, dtype, *p[1:]) for p in _rotate(b, LOW_COMBOS)]
            if interpreted(b):   # fp16: (causal, norm, elu), (full, nonorm, favor); bf16: the first
                params = params[1::2] if dtype == torch.float16 else params[1:2]
            out += params
    return out


LOW_PARAMS = _low_params()


@pytest.mark.parametrize("backend,dtype,causal,normalize,fmap", LOW_PARAMS, ids=[_id(p) for p in LOW_PARAMS])
def test_low_precision_within_2x_of_naive(backend, dtype, causal, normalize, fmap):
    torch.manual_seed(7)
    shape = INTERP_LOW_SHAPE if interpreted(backend) else LOW_SHAPE
    q, k, v = make_qkv(shape, dtype=dtype, scale=0.5 if fmap == "favor" else 1.0)
    arg, phi = feature_map_args(fmap, q.shape[-1])
    q64, k64, v64 = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))

    out = linear_attention(ql, kl, vl, causal=causal, feature_map=arg, normalize=normalize, backend=backend)
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

SEG_COMBOS = [(c, h, f) for f in ("elu", "favor") for c, h in ((False, 2), (True, 1), (True, 2), (False, 1))]
SEG_PARAMS = [p for b in BACKENDS for p in _rotate(b, SEG_COMBOS)]


@pytest.mark.parametrize("backend,causal,Hkv,fmap", SEG_PARAMS, ids=[_id(p) for p in SEG_PARAMS])
def test_segments_with_state_equal_one_call(backend, causal, Hkv, fmap):
    torch.manual_seed(11)
    dtype = first_dtype(backend)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == F64 else dict(rtol=1e-4, atol=1e-4)
    B, H, L, D, Dv = (1 if interpreted(backend) else 2), 4, 130, 16, 8
    q, k, v = make_qkv((B, H, Hkv, L, L, D, Dv, True), scale=0.5)
    arg, phi = feature_map_args(fmap, D)
    full, (S_full, z_full) = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, feature_map=arg,
                                              return_state=True, backend=backend)
    S_ref, z_ref = oracle_state(k, v, phi, H)
    assert S_full.dtype == z_full.dtype == (F64 if dtype == F64 else torch.float32)
    torch.testing.assert_close(S_full.double(), S_ref, **tol)
    torch.testing.assert_close(z_full.double(), z_ref, **tol)

    state, outs, start = None, [], 0
    for n in (40, 1, 89):  # crosses a chunk boundary inside a segment, and a length-1 segment
        sl = slice(start, start + n)
        o, state = linear_attention(q[:, :, sl].to(dtype), k[:, :, sl].to(dtype), v[:, :, sl].to(dtype),
                                    causal=causal, feature_map=arg, initial_state=state, return_state=True,
                                    backend=backend)
        if not causal:  # a non-causal segment sees every key so far, its own included
            e = start + n
            torch.testing.assert_close(o.double(), oracle(q[:, :, sl], k[:, :, :e], v[:, :, :e], phi, causal=False,
                                                          normalize=True), **tol)
        outs.append(o)
        start += n
    if causal:
        torch.testing.assert_close(torch.cat(outs, 2), full, **tol)
    torch.testing.assert_close(state[0], S_full, **tol)
    torch.testing.assert_close(state[1], z_full, **tol)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_initial_state_per_query_head_and_its_gradient(backend, causal):
    """Within a GQA group the query heads may carry different states: each is honored, and gradients
    reach S0 and z0. The oracle: per query head, attention over (its own previous keys + the
    current keys)."""
    torch.manual_seed(5)
    B, H, Hkv, L, Lp, D, Dv = 2, 4, 2, 37, 20, 8, 6
    phi = oracle_phi("elu")
    q, k, v = make_qkv((B, H, Hkv, L, L, D, Dv, False))
    kp, vp = (torch.randn(B, H, Lp, d, dtype=F64, device=DEVICE) for d in (D, Dv))
    S0 = (phi(kp).transpose(-1, -2) @ vp).requires_grad_()           # (B, H, F, Dv): differs per head
    z0 = phi(kp).sum(-2).requires_grad_()
    q.requires_grad_()
    dtype = first_dtype(backend)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == F64 else dict(rtol=1e-4, atol=1e-4)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, S0, z0)]
    out, (S, z) = linear_attention(leaves[0], k.to(dtype), v.to(dtype), causal=causal,
                                   initial_state=tuple(leaves[1:]), return_state=True, backend=backend)
    ref = oracle(q, k, v, phi, causal=causal, normalize=True, S0=S0, z0=z0)
    close_to(out, ref, dtype, "out")
    # the same thing spelled as one dense call per query head over [previous keys; current keys]
    kk = torch.cat([kp, k.repeat_interleave(2, 1)], 2)
    vv = torch.cat([vp, v.repeat_interleave(2, 1)], 2)
    # causal: bottom-right alignment with Lk = Lp + L makes the previous keys visible to every query
    ref2 = oracle(q, kk, vv, phi, causal=causal, normalize=True)
    close_to(out, ref2, dtype, "out vs previous keys")
    S_ref, z_ref = oracle_state(k, v, phi, H, S0, z0)
    torch.testing.assert_close(S.double(), S_ref, **tol)
    torch.testing.assert_close(z.double(), z_ref, **tol)

    douts = (torch.randn_like(ref), torch.randn_like(S_ref), torch.randn_like(z_ref))
    g = torch.autograd.grad((out, S, z), leaves, [d.to(dtype) for d in douts])
    g_ref = torch.autograd.grad((ref, S_ref, z_ref), (q, S0, z0), douts)
    for a, b, name in zip(g, g_ref, ("q", "S0", "z0")):
        close_to(a, b, dtype, f"d{name}", grad=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dtype_and_low_precision_state_passing(backend):
    torch.manual_seed(2)
    q, k, v = make_qkv((1, 2, 1, 100, 100, 16, 16, False), dtype=torch.bfloat16)
    full = linear_attention(q, k, v, causal=True, backend=backend)
    o1, st = linear_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], causal=True, return_state=True,
                              backend=backend)
    assert st[0].dtype == torch.float32 and st[1].dtype == torch.float32
    o2 = linear_attention(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], causal=True, initial_state=st, backend=backend)
    # same fp32 sums in another order: at most one bf16 rounding step apart
    torch.testing.assert_close(torch.cat([o1, o2], 2).float(), full.float(), rtol=1e-2, atol=1e-2)
    ref = oracle(q.double(), k.double(), v.double(), oracle_phi("elu"), causal=True, normalize=True)
    assert (full.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_100_tokens_one_at_a_time(backend):
    """100 one-token calls passing the state (Triton: its step kernel, under no_grad) equal one causal
    call, and so do calls on segments of odd lengths; the final states agree too."""
    torch.manual_seed(3)
    dtype = first_dtype(backend)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == F64 else dict(rtol=1e-4, atol=1e-5)
    B, H, Hkv, L, D, Dv = 1, 2, 1, 100, 8, 6
    q, k, v = make_qkv((B, H, Hkv, L, L, D, Dv, False), dtype=dtype)
    full, (S_full, z_full) = linear_attention(q, k, v, causal=True, return_state=True, backend=backend)
    close_to(full, oracle(q.double(), k.double(), v.double(), oracle_phi("elu"), causal=True, normalize=True),
             dtype, "one call")
    for sizes in ([1] * L, [1, 7, 33, 2, 57]):
        state, outs, start = None, [], 0
        with torch.no_grad():
            for n in sizes:
                sl = slice(start, start + n)
                o, state = linear_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, initial_state=state,
                                            return_state=True, backend=backend)
                outs.append(o)
                start += n
        assert start == L
        torch.testing.assert_close(torch.cat(outs, 2), full, **tol)
        torch.testing.assert_close(state[0], S_full, **tol)
        torch.testing.assert_close(state[1], z_full, **tol)


# --------------------------------------------------------------------------------- edge behaviour

@pytest.mark.parametrize("backend", BACKENDS)
def test_relu_query_that_sees_nothing_outputs_zero_not_nan(backend):
    dt = first_dtype(backend)
    q = -torch.rand(1, 1, 3, 4, dtype=dt, device=DEVICE) - 0.1                      # relu(q) == 0
    k, v = torch.randn(1, 1, 3, 4, dtype=dt, device=DEVICE), torch.randn(1, 1, 3, 2, dtype=dt, device=DEVICE)
    for eps in (1e-6, 0.0):
        out = linear_attention(q.requires_grad_(), k, v, feature_map="relu", eps=eps, backend=backend)
        assert (out == 0).all()
        (g,) = torch.autograd.grad(out.sum(), q)
        assert not g.isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_lq_gt_lk_leading_queries_output_zero(backend):
    q, k, v = (torch.randn(1, 2, n, 8, device=DEVICE) for n in (10, 4, 4))
    out = linear_attention(q, k, v, causal=True, backend=backend)
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


@pytest.mark.parametrize("backend,causal", [pytest.param(b, c, id=f"{b}-{'causal' if c else 'full'}")
                                            for b in BACKENDS for c in (False, True) if not (interpreted(b) and not c)])
def test_compiles_without_graph_breaks(backend, causal):
    """The public function, FAVOR+ features and state included, traces as one graph (no .item(), no
    data-dependent Python branches). Triton's interpreter: the causal case only (time)."""
    torch._dynamo.reset()
    m = FavorFeatures(8, 16, seed=0).to(DEVICE)
    q, k, v = (torch.randn(1, h, 70, d, device=DEVICE) for h, d in ((4, 8), (2, 8), (2, 6)))
    S0, z0 = torch.rand(1, 4, 16, 6, device=DEVICE), torch.rand(1, 4, 16, device=DEVICE)

    def fn(q, k, v, S0, z0):
        return linear_attention(q, k, v, causal=causal, feature_map=m, initial_state=(S0, z0), return_state=True,
                                backend=backend)

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
