"""Score terms (softcap, sinks, ALiBi, Relative, Span, dense) with packed sequences (``cu_seqlens``:
segment-local distances, nothing crosses a segment) and with ``positions`` (a context-parallel chunk:
absolute distances and dropout draws), forward and backward including the terms' parameter
gradients, against the float64 oracle and against each segment alone; bitwise repeatable."""
import pytest
import torch

import effattn
from effattn.bias import ALiBi
from effattn.distributed import _chunk
from effattn.numerics import draw_seed
from effattn.testing.oracle import score_attention
from tests.conftest import DEVICE
from tests.core.test_score import KERNELS, _leaves, _terms, check

# segments: no keys, Lq > Lk (rows that see no key when causal), no queries, length 1, a longer pair
OFFS_Q = [0, 3, 8, 8, 9, 27]
OFFS_K = [0, 0, 5, 9, 10, 31]
PACKED_KINDS = ["softcap", "sinks", "alibi", "relative", "relative-past", "span", "span-per-head"]


def _cu():
    return (torch.tensor(OFFS_Q, dtype=torch.int32, device=DEVICE),
            torch.tensor(OFFS_K, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("kind", PACKED_KINDS)
@pytest.mark.parametrize("mode", [dict(causal=True), dict(window=(3, 2)), dict()], ids=["causal", "window", "dense"])
def test_packed_terms_match_the_oracle(kind, mode):
    """The oracle masks every pair across segments and measures the terms' distances inside them."""
    B, H, Hkv = 1, 4, 2
    shape = (B, H, Hkv, OFFS_Q[-1], OFFS_K[-1], 8)
    check(shape, kind, dict(mode, cu_seqlens=_cu()), torch.float64)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kind,mode", [("all-packed", dict(causal=True)), ("relative-past", dict(window=(3, 2))),
                                       ("span-per-head", dict()), ("sinks", dict(causal=True))],
                         ids=["all-causal", "relative-past-window", "span-dense", "sinks-causal"])
def test_kernels_packed_terms_match_the_oracle(backend, kind, mode):
    """The kernels' (segment, tile) work lists with terms, forward and backward with the parameters'
    gradients and a gradient into lse, against the float64 oracle."""
    check((1, 4, 2, OFFS_Q[-1], OFFS_K[-1], 8), kind, dict(mode, cu_seqlens=_cu()), torch.float32, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_packed_terms_dropout(backend):
    """Dropout with terms on packed sequences: the kernels drop the pairs the plain call over the packed
    tensors drops (draws at the packed rows; V = identity reads the keep-mask off the output); with
    that mask the outputs and the gradients (of q, k, v and the slopes) are the float64 oracle's, and
    bitwise repeatable."""
    g = torch.Generator().manual_seed(5)
    H, D, p, Tq, Tk = 2, 8, 0.3, OFFS_Q[-1], OFFS_K[-1]
    q = torch.randn(1, H, Tq, D, generator=g).to(DEVICE)
    k, v = (torch.randn(1, H, Tk, D, generator=g).to(DEVICE) for _ in range(2))
    slopes = torch.tensor([0.5, 0.125], device=DEVICE)
    kw = dict(causal=True, softcap=3.0)
    eye = torch.eye(Tk, device=DEVICE).expand(1, H, Tk, Tk).contiguous()
    torch.manual_seed(11)
    keep = effattn.attention(q, k, eye, cu_seqlens=_cu(), dropout_p=p, bias=ALiBi(slopes), backend=backend,
                             **kw) != 0
    torch.manual_seed(11)
    plain = effattn.attention(q, k, eye, dropout_p=p, backend=backend) != 0      # every pair visible
    inside = torch.zeros_like(keep)
    for a, b, c, d in zip(OFFS_Q, OFFS_Q[1:], OFFS_K, OFFS_K[1:]):
        inside[:, :, a:b, c:d] = True
    assert torch.equal(keep, keep & inside) and keep.any()
    probs, _ = score_attention(q.double(), k.double(), eye.double(), cu_seqlens=_cu(), bias=ALiBi(slopes.double()),
                               **kw)
    assert torch.equal(keep, plain & (probs > 0))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
        torch.manual_seed(11)
        out = effattn.attention(*leaves[:3], cu_seqlens=_cu(), dropout_p=p, bias=ALiBi(leaves[3]), backend=backend,
                                **kw)
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    got, again = run(), run()
    rl = [t.clone().double().requires_grad_() for t in (q, k, v, slopes)]
    ref, _ = score_attention(*rl[:3], cu_seqlens=_cu(), bias=ALiBi(rl[3]), dropout_keep=keep, dropout_p=p, **kw)
    want = (ref, *torch.autograd.grad(ref, rl, torch.ones_like(ref)))
    for name, x, y, z in zip(["out", "dq", "dk", "dv", "dslopes"], got, want, again):
        torch.testing.assert_close(x.double(), y, atol=1e-4, rtol=1e-4, msg=name)
        assert torch.equal(x, z), f"{name} differs between two runs"


def _segment_grads(q, k, v, kw, terms, go, packed, backend="torch"):
    """(out, dq, dk, dv, *parameter gradients) of the packed call or of each segment alone (outputs and
    gradients of q, k, v put back at the segments' rows; parameter gradients summed over segments)."""
    kw_t, params, _, _ = _leaves(terms, q.dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if packed:
        out = effattn.attention(*leaves, cu_seqlens=_cu(), backend=backend, **kw, **kw_t)
    else:
        parts = []
        for a, b, c, d in zip(OFFS_Q, OFFS_Q[1:], OFFS_K, OFFS_K[1:]):
            parts.append(effattn.attention(leaves[0][:, :, a:b], leaves[1][:, :, c:d], leaves[2][:, :, c:d],
                                           backend=backend, **kw, **kw_t))
        out = torch.cat(parts, 2)
    grads = torch.autograd.grad(out, leaves + params, go, allow_unused=True)
    return (out,) + tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves + params))


@pytest.mark.parametrize("backend,kind", [("torch", k) for k in ("all-packed", "relative", "span-per-head")]
                         + [(b, "all-packed") for b in KERNELS])
def test_packed_terms_equal_each_segment_alone(backend, kind):
    """A packed call with terms is each segment's own call with those terms (GQA, causal window),
    forward and backward with the parameters' gradients; the packed call is bitwise repeatable. The
    kernels (float32) work in each segment's coordinates: the same tiles as the segment alone, so the
    gradients of q, k, v are bitwise the segments'."""
    g = torch.Generator().manual_seed(3)
    H, Hkv, D = 4, 2, 8
    dt = torch.float64 if backend == "torch" else torch.float32
    q = torch.randn(1, H, OFFS_Q[-1], D, generator=g, dtype=torch.float64).to(dt).to(DEVICE)
    k, v = (torch.randn(1, Hkv, OFFS_K[-1], D, generator=g, dtype=torch.float64).to(dt).to(DEVICE) for _ in range(2))
    terms, _ = _terms(kind, 1, H, OFFS_Q[-1], OFFS_K[-1], g)
    kw = dict(causal=True, window=12)
    go = torch.randn(1, H, OFFS_Q[-1], D, generator=g, dtype=torch.float64).to(dt).to(DEVICE)
    packed = _segment_grads(q, k, v, kw, terms, go, True, backend)
    alone = _segment_grads(q, k, v, kw, terms, go, False, backend)
    names = ["out", "dq", "dk", "dv"] + [f"dparam{i}" for i in range(len(packed) - 4)]
    assert len(packed) > 4
    tol = 1e-12 if dt == torch.float64 else 2e-6     # float32: the parameters' sums in another order
    for name, a, b in zip(names, packed, alone):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    if backend != "torch":
        for name, a, b in zip(names[:4], packed, alone):
            assert torch.equal(a, b), name
    again = _segment_grads(q, k, v, kw, terms, go, True, backend)
    for name, a, b in zip(names, packed, again):
        assert torch.equal(a, b), f"{name} differs between two runs"


POS_KINDS = ["all", "alibi", "relative", "span-per-head", "dense", "sinks"]


@pytest.mark.parametrize("kind", POS_KINDS)
@pytest.mark.parametrize("mode", [dict(causal=True, positions=(30, 14)), dict(window=(6, 2), positions=(5, 9)),
                                  dict(positions=(0, 7))], ids=["causal", "window", "dense"])
def test_positions_terms_match_the_oracle(kind, mode):
    """A chunk at absolute positions: the terms read ``(q_start + i) - (k_start + j)``."""
    check((2, 4, 2, 12, 20, 8), kind, mode, torch.float64)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kind", ["all", "relative", "span-per-head"])
def test_kernels_positions_terms_match_the_oracle(backend, kind):
    check((1, 4, 2, 12, 20, 8), kind, dict(causal=True, positions=(30, 14)), torch.float32, backend=backend)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_terms_dropout_at_positions_and_head_shards_draws_the_whole_calls_pairs(backend):
    """With terms, a chunk at positions on heads 2..3 of 4 (a Ulysses head shard) drops exactly the
    pairs the whole call drops there (V = identity reads the keep-mask off the output)."""
    check_terms_dropout_mask(backend, torch.float64 if backend == "torch" else torch.float32)


def check_terms_dropout_mask(backend, dt):
    """`test_terms_dropout_at_positions_and_head_shards_draws_the_whole_calls_pairs` on ``backend`` in ``dt``
    (the CUDA emulation's test calls it in bf16)."""
    p, L = 0.3, 40
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, L, 8, generator=g).to(dt)
    k = torch.randn(1, 2, L, 8, generator=g).to(dt)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=dt)
    kw = dict(causal=True, window=20, softcap=4.0)
    torch.manual_seed(7)
    full = effattn.attention(q, k, torch.eye(L, dtype=dt).expand(1, 2, L, L).contiguous(), dropout_p=p,
                             bias=ALiBi(slopes), backend=backend, **kw) != 0
    qs, ks, n, m = 24, 9, 12, 18
    torch.manual_seed(7)
    seed = draw_seed()
    eye = torch.eye(m, dtype=dt).expand(1, 1, m, m).contiguous()
    out, _ = _chunk(q[:, 2:4, qs:qs + n], k[:, 1:2, ks:ks + m], eye, backend=backend, seed=seed, positions=(qs, ks),
                    heads=(2, 4), dropout_p=p, bias=ALiBi(slopes[2:4]), **kw)
    want = full[:, 2:4, qs:qs + n, ks:ks + m]
    assert want.any() and not want.all()
    assert torch.equal(out != 0, want)


def test_dense_bias_with_cu_seqlens_is_refused_naming_bias():
    q = torch.zeros(1, 2, OFFS_Q[-1], 8, device=DEVICE)
    k = torch.zeros(1, 2, OFFS_K[-1], 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"dense bias tensor \(bias\) cannot be combined with cu_seqlens"):
        effattn.attention(q, k, k, cu_seqlens=_cu(), bias=torch.zeros(1, 2, OFFS_Q[-1], OFFS_K[-1], device=DEVICE))


def test_explain_serves_terms_with_packing_and_positions():
    """torch/score and triton/score serve packed calls with terms and positions."""
    q = torch.zeros(1, 2, OFFS_Q[-1], 8, device=DEVICE)
    k = torch.zeros(1, 2, OFFS_K[-1], 8, device=DEVICE)
    bias = ALiBi(torch.tensor([0.5, 0.25], device=DEVICE))
    e = effattn.explain(q, k, k, cu_seqlens=_cu(), bias=bias, backend="torch")
    assert e.paths["torch"].startswith("torch/score"), e.paths
    if "triton" in KERNELS:
        e = effattn.explain(q, k, k, cu_seqlens=_cu(), bias=bias, backend="triton")
        assert e.paths["triton"].startswith("triton/score"), (e.paths, e.reasons)
        assert "(segment, tile) work lists" in e.paths["triton"]
        e = effattn.explain(q, k, k, positions=(40, 3), bias=bias, backend="triton")
        assert e.paths["triton"].startswith("triton/score"), (e.paths, e.reasons)
