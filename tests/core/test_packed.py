"""Packed variable-length sequences (cu_seqlens), absolute positions, fp32 partial outputs,
merge_attention and ops.attention_backward (effattn.packed, effattn.merge, effattn.ops)."""
import math

import pytest
import torch

import effattn
from effattn.testing.oracle import naive_attention, visibility


def _packed(offs_q, offs_k, H, Hkv, D, Dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, offs_q[-1], D, generator=g, dtype=dtype)
    k = torch.randn(1, Hkv, offs_k[-1], D, generator=g, dtype=dtype)
    v = torch.randn(1, Hkv, offs_k[-1], Dv, generator=g, dtype=dtype)
    cu_q = torch.tensor(offs_q, dtype=torch.int32)
    cu_k = torch.tensor(offs_k, dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _per_segment(fn, q, k, v, offs_q, offs_k):
    """fn applied to each segment alone, outputs concatenated along the length."""
    return torch.cat([fn(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d])
                      for a, b, c, d in zip(offs_q, offs_q[1:], offs_k, offs_k[1:])], dim=2)


@pytest.fixture(params=["cpu-paths", "work-list"])
def path(request, monkeypatch):
    """Packed calls on the CPU run segment by segment on the CPU fast paths, or (fast paths disabled,
    as on other devices) on the chunked reference's segment work list: both are tested."""
    from effattn.backends.torch.attention import cpu_blocks
    monkeypatch.setattr(cpu_blocks, "ENABLED", request.param == "cpu-paths")
    return request.param


CASES = [
    dict(causal=True),
    dict(),
    dict(window=2),
    dict(causal=True, window=3),
    dict(window=(1, 4)),
]
# segments of length 0 and 1, one longer than the others
SELF = [0, 3, 3, 4, 13, 19]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "dense")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_packed_self_matches_oracle_per_segment(kw, heads, path):
    H, Hkv = heads
    q, k, v, cu, _ = _packed(SELF, SELF, H, Hkv, 8, 6)
    out, lse = effattn.attention(q, k, v, cu_seqlens=cu, max_seqlen=9, return_lse=True, **kw)
    ref_out = _per_segment(lambda a, b, c: naive_attention(a, b, c, **kw)[0], q, k, v, SELF, SELF)
    ref_lse = torch.cat([naive_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], **kw)[1]
                         for a, b in zip(SELF, SELF[1:])], dim=2)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(2, 1))], ids=["causal", "window"])
def test_packed_cross_forward_backward_equal_per_segment(kw, path):
    offs_q, offs_k = [0, 2, 2, 7, 8], [0, 5, 6, 9, 9]          # Lq > Lk, Lk = 0, Lq = 0 segments
    q, k, v, cu_q, cu_k = _packed(offs_q, offs_k, 4, 2, 8, 8)
    for t in (q, k, v):
        t.requires_grad_()
    out = effattn.attention(q, k, v, cu_seqlens=(cu_q, cu_k), max_seqlen=(5, 5), **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _per_segment(lambda a, b, c: effattn.attention(a, b, c, backend="torch", **kw), q, k, v, offs_q, offs_k)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_one_segment_is_the_plain_call_and_gradcheck(path):
    q, k, v, cu, _ = _packed([0, 7], [0, 7], 2, 1, 4, 4)
    plain = effattn.attention(q, k, v, causal=True, window=3)
    packed = effattn.attention(q, k, v, causal=True, window=3, cu_seqlens=cu)
    torch.testing.assert_close(packed, plain, rtol=1e-12, atol=1e-12)
    q, k, v, cu, _ = _packed([0, 2, 5, 6], [0, 2, 5, 6], 2, 1, 3, 3)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: effattn.attention(a, b, c, causal=True, cu_seqlens=cu), inputs)


def test_packed_dropout_is_reproducible_and_its_gradient_matches():
    q, k, v, cu, _ = _packed([0, 4, 9], [0, 4, 9], 2, 2, 4, 4)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def f(a, b, c):
        torch.manual_seed(7)
        return effattn.attention(a, b, c, causal=True, dropout_p=0.3, cu_seqlens=cu)

    o1, o2 = f(*inputs), f(*inputs)
    assert torch.equal(o1, o2)
    torch.manual_seed(8)
    assert not torch.equal(o1, effattn.attention(q, k, v, causal=True, dropout_p=0.3, cu_seqlens=cu))
    # nothing crosses a segment even with dropout: the first segment's rows ignore the second's keys
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 4:] += 5
    v2[:, :, 4:] += 5
    assert torch.equal(f(q, k2, v2)[:, :, :4], o1[:, :, :4])
    assert torch.autograd.gradcheck(f, inputs)


def test_packed_float32_backward_against_float64(path):
    q, k, v, cu, _ = _packed(SELF, SELF, 4, 2, 8, 8, dtype=torch.float32)
    for t in (q, k, v):
        t.requires_grad_()
    out = effattn.attention(q, k, v, causal=True, cu_seqlens=cu)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _per_segment(lambda a, b, c: naive_attention(a, b, c, causal=True)[0], q64, k64, v64, SELF, SELF)
    ref_grads = torch.autograd.grad(ref.sum(), (q64, k64, v64))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


def test_packed_transposed_view_accepted():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 3, 4, generator=g, dtype=torch.float64)             # (T, H, D)
    view = x.transpose(0, 1)[None]
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    out = effattn.attention(view, view, view, causal=True, cu_seqlens=cu)
    ref = effattn.attention(view.contiguous(), view.contiguous(), view.contiguous(), causal=True, cu_seqlens=cu)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_explain_packed_paths():
    q, k, v, cu, _ = _packed([0, 3, 8], [0, 3, 8], 2, 2, 4, 4, dtype=torch.float16)
    e = effattn.explain(q, k, v, causal=True, cu_seqlens=cu)
    assert e.chosen == "torch"
    assert "packed segments one by one" in e.paths["torch"]
    e = effattn.explain(q, k, v, causal=True, cu_seqlens=cu, dropout_p=0.1)
    assert "segment work list" in e.paths["torch"]
    # the Triton and CUDA kernels serve packed dropout too (named: on a CPU they are test vehicles)
    assert e.paths["triton"] == "triton/prefill" and e.paths["cuda"] == "cuda/prefill", e.paths
    assert not any("varlen" in r for r in e.reasons.get("triton", []) + e.reasons.get("cuda", [])), e.reasons


def _triton_or_skip():
    rt = pytest.importorskip("effattn.backends.triton.runtime")
    if rt.triton is None or rt._available(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter is not usable here")


def test_triton_packed_dropout_draws_at_the_packed_rows():
    """The Triton kernels' packed dropout draws Philox at the packed rows (q0 + i, k0 + j) of head h: the
    keep-mask is the plain call's over the packed tensors, restricted to the segments (V = identity
    reads it off the output); the gradients with that mask match float64; an fp32 output keeps it."""
    _triton_or_skip()
    offs_q, offs_k, p = [0, 3, 3, 20], [0, 5, 9, 24], 0.3
    q, k, _, cu_q, cu_k = _packed(offs_q, offs_k, 4, 2, 8, 8, dtype=torch.float32, seed=3)
    eye = torch.eye(24).expand(1, 2, 24, 24).contiguous()
    kw = dict(causal=True, window=9)
    torch.manual_seed(5)
    packed = effattn.attention(q, k, eye, cu_seqlens=(cu_q, cu_k), dropout_p=p, backend="triton", **kw) != 0
    torch.manual_seed(5)
    plain = effattn.attention(q, k, eye, dropout_p=p, backend="triton") != 0
    visible = visibility(20, 24, cu_seqlens=(cu_q, cu_k), **kw)[0, 0]
    assert torch.equal(packed, plain & visible)
    assert 0.5 < packed[visible.expand_as(packed)].double().mean().item() < 0.9
    v = torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    out = effattn.attention(*leaves, cu_seqlens=(cu_q, cu_k), dropout_p=p, out_dtype=torch.float32,
                            backend="triton", **kw)
    rl = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*rl, cu_seqlens=(cu_q, cu_k), dropout_keep=plain, dropout_p=p, **kw)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_triton_packed_compiles_through_its_custom_op():
    """torch.compile (aot_eager, fullgraph) of a packed Triton call: it traces to the registered ops
    effattn::triton_attention_varlen_fwd / _bwd (the work list is read inside them) and gives the
    eager results, forward and backward; opcheck on the forward op."""
    _triton_or_skip()
    from effattn.backends.triton.attention import op
    offs_q, offs_k = [0, 5, 5, 14], [0, 3, 8, 16]
    q, k, v, cu_q, cu_k = _packed(offs_q, offs_k, 2, 1, 8, 8, dtype=torch.float32, seed=2)

    def f(a, b, c):
        return effattn.attention(a, b, c, cu_seqlens=(cu_q, cu_k), max_seqlen=(9, 8), causal=True, backend="triton")

    targets = []

    def aot_eager(gm, example_inputs):          # aot_eager, recording the traced graph's calls
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch.compile(f, backend=aot_eager, fullgraph=True)(*leaves)
    assert "effattn.triton_attention_varlen_fwd.default" in targets, targets
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = f(*ref_leaves)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, ref_leaves, go)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.library.opcheck(op.triton_attention_varlen_fwd, (*leaves, cu_q, cu_k, None, 0.3, 0.0, -1, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_packed_fp32_output(dtype):
    """out_dtype=float32 on a packed Triton call: fp32 partial outputs (the varlen forward writes
    them) equal to the float64 oracle, and the backward takes their gradient."""
    _triton_or_skip()
    offs_q, offs_k = [0, 6, 6, 17], [0, 4, 8, 20]
    q, k, v, cu_q, cu_k = _packed(offs_q, offs_k, 2, 1, 8, 8, dtype=torch.float32, seed=4)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, cu_seqlens=(cu_q, cu_k), out_dtype=torch.float32, return_lse=True,
                                 causal=True, backend="triton")
    assert out.dtype == torch.float32
    rl = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = naive_attention(*rl, cu_seqlens=(cu_q, cu_k), causal=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double())):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=5 * tol, atol=5 * tol)


# ----------------------------------------------------------------------------------- validation

def _err(match, exc=ValueError, **kw):
    q, k, v, cu, _ = _packed([0, 3, 8], [0, 3, 8], 2, 2, 4, 4)
    args = dict(cu_seqlens=cu)
    args.update(kw)
    with pytest.raises(exc, match=match):
        effattn.attention(q, k, v, **args)


def test_validation_errors_name_the_argument():
    _err("cu_seqlens must have dtype torch.int32", TypeError, cu_seqlens=torch.tensor([0, 3, 8]))
    _err("cu_seqlens must be non-decreasing", cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    _err(r"last entry of cu_seqlens must equal the packed length 8, got 7",
         cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    _err(r"cu_seqlens\[0\] must be 0", cu_seqlens=torch.tensor([1, 3, 8], dtype=torch.int32))
    # given max_seqlen, the values are checked on the device (torch._assert_async: no host read)
    _err("max_seqlen=4 is smaller than the longest segment", RuntimeError, max_seqlen=4)
    _err("max_seqlen_k=2 is smaller", RuntimeError, cu_seqlens=(torch.tensor([0, 3, 8], dtype=torch.int32),) * 2,
         max_seqlen=(5, 2))
    _err("cu_seqlens must be non-decreasing", RuntimeError, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32),
         max_seqlen=8)
    _err("max_seqlen must be non-negative", max_seqlen=-1)
    _err("key_padding_mask cannot be combined with cu_seqlens", key_padding_mask=torch.zeros(1, 8, dtype=torch.bool))
    _err("positions cannot be combined with cu_seqlens", positions=(0, 0))
    _err("max_seqlen is given without cu_seqlens", cu_seqlens=None, max_seqlen=3)
    _err("out_dtype must be torch.float32", TypeError, out_dtype=torch.float16)
    _err("positions must be a", TypeError, cu_seqlens=None, positions=(1.5, 0))
    _err("positions must be non-negative", cu_seqlens=None, positions=(-1, 0))
    if torch.cuda.is_available():
        _err("cu_seqlens is on cuda", cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda"))
    q = torch.randn(2, 2, 8, 4)
    with pytest.raises(ValueError, match="packed as"):
        effattn.attention(q, q, q, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))


def forbid_host_reads(monkeypatch):
    """Every way Python code reads a tensor's values back to the host raises inside the `with` (a GPU
    tensor's would synchronize): tolist, item, cpu, numpy, int / float / bool / index conversions."""
    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name} on a {tuple(self.shape)} {self.dtype} tensor")
        return method
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


def test_max_seqlen_reads_nothing_back(monkeypatch):
    """A packed call given max_seqlen validates cu_seqlens on its device and leaves the work list lazy:
    building the call reads no value back (the CUDA kernels then need none, test_cuda_packed.py); a row
    that needs the host work list reads it once, and the result is the eager one's."""
    from effattn._call import make_attn_call
    from effattn.packed import LazySegments
    q, k, v, cu_q, cu_k = _packed([0, 3, 3, 9], [0, 4, 6, 11], 2, 1, 4, 4, dtype=torch.float32)
    with monkeypatch.context() as m:
        forbid_host_reads(m)
        with pytest.raises(AssertionError, match="host read: Tensor.tolist"):    # the guard works
            cu_q.tolist()
        call = make_attn_call(q, k, v, causal=True, cu_seqlens=(cu_q, cu_k), max_seqlen=(6, 5), dropout_p=0.1)
    assert isinstance(call.segments, LazySegments) and call.max_seqlen == (6, 5)
    eager = make_attn_call(q, k, v, causal=True, cu_seqlens=(cu_q, cu_k))
    assert tuple(call.segments) == eager.segments and eager.max_seqlen == (6, 5)
    out = effattn.attention(q, k, v, causal=True, cu_seqlens=(cu_q, cu_k), max_seqlen=(6, 5))
    ref = effattn.attention(q, k, v, causal=True, cu_seqlens=(cu_q, cu_k))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_wrong_device_is_named():
    q, k, v, cu, _ = _packed([0, 3, 8], [0, 3, 8], 2, 2, 4, 4)
    meta = torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        effattn.attention(q, k, v, cu_seqlens=meta)


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    cu, m = effattn.cu_seqlens_from_position_ids(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10] and m == 4
    # a sequence that continues from a cache offset (positions not restarting at 0) is one segment
    cu, m = effattn.cu_seqlens_from_position_ids(torch.tensor([5, 6, 7, 0, 1]))
    assert cu.tolist() == [0, 3, 5] and m == 3
    with pytest.raises(ValueError, match="one packed row"):
        effattn.cu_seqlens_from_position_ids(torch.zeros(2, 4, dtype=torch.long))


# --------------------------------------------------------------------- positions, merge, backward

@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=5), dict(window=(3, 2)), dict()],
                         ids=["causal", "causal-window", "window", "dense"])
def test_chunk_pairs_with_positions_merge_to_the_whole_call(kw):
    """Queries [8, 16) of a 16-token sequence against its key chunks [0, 8) and [8, 16): the merged
    fp32 partials are the whole call's rows, and the pair backwards sum to its gradients."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]                                      # GQA
    for t in (q, k, v):
        t.requires_grad_()
    whole, whole_lse = effattn.attention(q, k, v, return_lse=True, **kw)
    dout = torch.randn_like(whole)
    dq, dk, dv = torch.autograd.grad(whole, (q, k, v), dout, retain_graph=True)
    qc = q[:, :, 8:]
    parts = [effattn.attention(qc, k[:, :, s:s + 8], v[:, :, s:s + 8], positions=(8, s), return_lse=True,
                               out_dtype=torch.float32, **kw) for s in (0, 8)]
    out, lse = effattn.merge_attention(parts)
    torch.testing.assert_close(out, whole[:, :, 8:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse[:, :, 8:], rtol=1e-5, atol=1e-6)
    # the merge is differentiable: gradients through it equal the whole call's
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), dout[:, :, 8:])
    ref = torch.autograd.grad(whole[:, :, 8:], (q, k, v), dout[:, :, 8:], retain_graph=True)
    for a, b in zip((gq, gk, gv), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # pair backwards against the global out / lse, summed over the pairs
    with torch.no_grad():
        pdq = torch.zeros(1, 4, 8, 8)
        for s in (0, 8):
            a, b, c = effattn.ops.attention_backward(dout[:, :, 8:], qc, k[:, :, s:s + 8], v[:, :, s:s + 8],
                                                     whole[:, :, 8:], whole_lse[:, :, 8:], positions=(8, s), **kw)
            assert a.dtype == b.dtype == c.dtype == torch.float32
            pdq += a
            if s == 8:                                             # keys [8, 16): only rows [8, 16) see them
                wk = torch.autograd.grad(whole, k, dout * (torch.arange(16) >= 8)[:, None], retain_graph=True)[0]
                torch.testing.assert_close(b, wk[:, :, 8:], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pdq, dq[:, :, 8:], rtol=1e-5, atol=1e-6)


def test_out_dtype_float32_keeps_the_partials():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    out = effattn.attention(q, k, v, causal=True, out_dtype=torch.float32)
    ref = naive_attention(q, k, v, causal=True)[0]
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 1e-5                 # no bf16 rounding of the output


def test_merge_attention_empty_rows_and_errors():
    o = torch.randn(1, 1, 3, 2)
    lse = torch.tensor([[[0.5, -math.inf, 1.0]]])
    none = torch.full_like(lse, -math.inf)
    out, l = effattn.merge_attention([(o, lse), (torch.randn_like(o), none)])
    torch.testing.assert_close(out, torch.where(torch.isinf(lse)[..., None], torch.zeros_like(o), o))
    assert torch.equal(torch.isinf(l), torch.isinf(lse)) and not torch.isnan(out).any()
    with pytest.raises(TypeError, match="non-empty list"):
        effattn.merge_attention([])
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        effattn.merge_attention([(o, lse), (o[..., :1, :], lse)])


# ---------------------------------------------------------------------------------- linear attention

@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_packed_restarts_the_state(causal):
    offs = [0, 5, 5, 6, 12]
    q, k, v, cu, _ = _packed(offs, offs, 4, 2, 4, 3)
    for t in (q, k, v):
        t.requires_grad_()
    out = effattn.linear_attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=6)
    ref = _per_segment(lambda a, b, c: effattn.linear_attention(a, b, c, causal=causal), q, k, v, offs, offs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    whole = effattn.linear_attention(q, k, v, causal=causal)
    assert not torch.allclose(out[:, :, 6:], whole[:, :, 6:])        # the state did restart
    g = torch.autograd.grad(out.sum(), (q, k, v))
    r = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="return_state cannot be combined with cu_seqlens"):
        effattn.linear_attention(q, k, v, cu_seqlens=cu, return_state=True)
    with pytest.raises(ValueError, match="max_seqlen=3 is smaller"):
        effattn.linear_attention(q, k, v, cu_seqlens=cu, max_seqlen=3)


def test_positions_that_change_nothing_take_the_plain_paths():
    """A chunk pair at the bottom-right offset, or one whose window hides no pair, is a plain call
    (the CPU fast paths, the kernels); others keep their positions."""
    q = torch.randn(1, 2, 8, 4)
    e = effattn.explain(q, q, q, causal=True, positions=(16, 16))
    assert "segment work list" not in e.paths["torch"]
    e = effattn.explain(q, q, q, causal=True, positions=(16, 0))          # every key is in the past: dense
    assert "flash" in e.paths["torch"]
    e = effattn.explain(q, q, q, causal=True, window=10, positions=(16, 8))  # the window cuts: positioned
    assert "segment work list" in e.paths["torch"]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for qs, ks in ((16, 0), (16, 8), (8, 16)):
        for kw in (dict(causal=True), dict(causal=True, window=10), dict(window=(3, 9))):
            part, plse = effattn.attention(q[:, :, qs:qs + 8], k[:, :, ks:ks + 8], v[:, :, ks:ks + 8],
                                           positions=(qs, ks), return_lse=True, **kw)
            # the oracle's rows qs..qs+8 of the whole sequence against keys ks..ks+8 only
            s = q[:, :, qs:qs + 8] @ k[:, :, ks:ks + 8].transpose(-1, -2) / 2.0
            m = visibility(24, 24, **kw)[0, 0, qs:qs + 8, ks:ks + 8]
            s = s.masked_fill(~m, float("-inf"))
            p = torch.where(m.any(-1, keepdim=True), torch.softmax(s, -1), torch.zeros_like(s))
            torch.testing.assert_close(plse, torch.logsumexp(s, -1), rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(part, p @ v[:, :, ks:ks + 8], rtol=1e-10, atol=1e-10)


def test_positions_with_key_padding_and_layout():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    out = effattn.attention(q, k, v, causal=True, window=2, key_padding_mask=pad, positions=(10, 7))
    s = (q @ k.transpose(-1, -2)) / 2.0
    i, j = torch.arange(6)[:, None] + 10, torch.arange(6)[None, :] + 7
    vis = (j <= i) & (j >= i - 2) & ~pad[:, None, None, :]
    p = torch.where(vis.any(-1, keepdim=True), torch.softmax(s.masked_fill(~vis, float("-inf")), -1), 0.0)
    torch.testing.assert_close(out, torch.nan_to_num(p) @ v, rtol=1e-10, atol=1e-10)
    lay = effattn.layouts.local(6, 2, 1, causal=True)
    with pytest.raises(ValueError, match="positions cannot be combined with layout"):
        effattn.attention(q, k, v, layout=lay, positions=(10, 7))


def _positions_backends():
    from effattn.backends import base
    from tests.conftest import op_backends
    return [n for n in op_backends("attention") if "positions" in base._REGISTRY["attention"][n].caps.features]


@pytest.mark.parametrize("backend", _positions_backends())
@pytest.mark.parametrize("kw,dtype", [(dict(causal=True, window=5), torch.float32), (dict(window=(2, 3)), torch.float32),
                                      (dict(causal=True), torch.float32), (dict(causal=True, window=5), torch.bfloat16)],
                         ids=["causal-window", "window", "causal", "causal-window-bf16"])
def test_positions_and_fp32_output_on_every_backend(backend, kw, dtype):
    """A chunk pair with positions and an fp32 output on each backend that declares them: equal to the
    oracle's rows of the whole sequence against the chunk's keys, forward and backward."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(dtype) for _ in range(3))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    k, v = k[:, :1], v[:, :1]
    qs, ks = 24, 16
    qc, kc, vc = (t[:, :, s:s + 16].clone().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
    out, lse = effattn.attention(qc, kc, vc, positions=(qs, ks), out_dtype=torch.float32, return_lse=True,
                                 backend=backend, **kw)
    assert out.dtype == torch.float32
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qc, kc, vc))
    m = visibility(40, 40, **kw)[0, 0, qs:qs + 16, ks:ks + 16]
    s = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) / 4.0).masked_fill(~m, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))
    ref = p @ v64.repeat_interleave(2, 1)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=tol, atol=tol)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (qc, kc, vc), dout.float())
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout)
    for a, b in zip(grads, refs):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=10 * tol, atol=10 * tol)


def _feature_backends(feature):
    from effattn.backends import base
    from tests.conftest import op_backends
    return [n for n in op_backends("attention") if feature in base._REGISTRY["attention"][n].caps.features]


@pytest.mark.parametrize("backend", _feature_backends("varlen"))
@pytest.mark.parametrize("kw,dtype", [(dict(causal=True), torch.float32), (dict(window=(3, 2)), torch.float32),
                                      (dict(causal=True, window=9), torch.float32), (dict(), torch.bfloat16)],
                         ids=["causal", "window", "causal-window", "dense-bf16"])
def test_packed_on_every_backend_against_the_oracle(backend, kw, dtype):
    """Cross-attention segments (Lq > Lk, Lq < Lk, no keys, no queries, length 1, one longer than a
    tile) with GQA and Dv != D on each backend that declares varlen: forward and backward equal the
    float64 oracle run on each segment alone."""
    offs_q, offs_k = [0, 2, 2, 7, 8, 48, 49], [0, 5, 6, 9, 9, 50, 51]
    q, k, v, cu_q, cu_k = _packed(offs_q, offs_k, 4, 2, 16, 8, dtype=torch.float32, seed=7)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = effattn.attention(q, k, v, cu_seqlens=(cu_q, cu_k), max_seqlen=(40, 41), backend=backend, **kw)
    assert out.dtype == dtype
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _per_segment(lambda a, b, c: naive_attention(a, b, c, **kw)[0], q64, k64, v64, offs_q, offs_k)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g.double(), r, rtol=5 * tol, atol=5 * tol)


def _dropout_backends():
    from effattn.backends import base
    from tests.conftest import op_backends
    feats = {"positions", "dropout"}
    # the CUDA kernels declare both but refuse them together (test_cuda_refuses_dropout_with_positions)
    return [n for n in op_backends("attention") if feats <= base._REGISTRY["attention"][n].caps.features
            and n != "cuda"]


_DROP_KW = {"causal-window": dict(causal=True, window=9), "dense": dict(), "causal": dict(causal=True)}


@pytest.mark.parametrize("backend,kw", [(b, kw) for b in _dropout_backends() for kw in _DROP_KW
                                        if b == "torch" or kw == "causal-window"])   # the interpreter is slow
def test_positions_draw_dropout_at_the_absolute_rows_and_keys(backend, kw):
    """A chunk pair with positions drops exactly the pairs the whole sequence's call drops at those rows
    and keys (drawn per (b, h, absolute i, absolute j) from the same seed): V = identity reads the keep-mask
    off the output. The chunk's gradients (fp32 output) match float64 with that mask."""
    B, H, Hkv, L, p, kw = 2, 4, 2, 40, 0.3, _DROP_KW[kw]
    g = torch.Generator().manual_seed(8)
    q = torch.randn(B, H, L, 16, generator=g)
    k = torch.randn(B, Hkv, L, 16, generator=g)
    eye = torch.eye(L).expand(B, Hkv, L, L).contiguous()
    torch.manual_seed(21)
    full = effattn.attention(q, k, eye, dropout_p=p, backend=backend, **kw) != 0
    visible = visibility(L, L, **kw)[0, 0]
    assert 0.55 < full[visible.expand_as(full)].double().mean().item() < 0.85
    for qs, ks in ((24, 8), (0, 20)):
        qc, kc, ec = q[:, :, qs:qs + 16], k[:, :, ks:ks + 16], eye[:, :, ks:ks + 16]
        torch.manual_seed(21)
        chunk = effattn.attention(qc, kc, ec, dropout_p=p, positions=(qs, ks), backend=backend, **kw) != 0
        assert torch.equal(chunk[..., ks:ks + 16], full[:, :, qs:qs + 16, ks:ks + 16]), (qs, ks)
        assert not chunk[..., :ks].any() and not chunk[..., ks + 16:].any()
        keep = full[:, :, qs:qs + 16, ks:ks + 16]
        v = torch.randn(B, Hkv, 16, 8, generator=g)
        leaves = [t.clone().requires_grad_() for t in (qc, kc, v)]
        torch.manual_seed(21)
        out = effattn.attention(*leaves, dropout_p=p, positions=(qs, ks), out_dtype=torch.float32, backend=backend,
                                **kw)
        rl = [t.detach().double().requires_grad_() for t in leaves]
        ref, _ = naive_attention(*rl, dropout_keep=keep, dropout_p=p, positions=(qs, ks), **kw)
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
        go = torch.randn(out.shape, generator=g)
        for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double())):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_cuda_dropout_draws_at_the_calls_positions_and_head_shard():
    """The CUDA op arguments of a call carry where its dropout draws (drop_at: positions, a head
    shard's first head and head count) exactly when they differ from the call's own; the emulated
    kernels' masks: tests/backends/cuda/test_cuda_packed.py."""
    from effattn._call import make_attn_call
    from effattn.backends.cuda.attention import ops
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    assert ops.packed_args(make_attn_call(q, q, q, dropout_p=0.1, positions=(8, 3), heads=(2, 4)))["drop_at"] == [
        8, 3, 2, 4]
    assert ops.packed_args(make_attn_call(q, q, q, dropout_p=0.1, heads=(2, 4)))["drop_at"] == [0, 0, 2, 4]
    for kw in (dict(), dict(positions=(0, 0)), dict(heads=(2, 4), dropout_p=0.0)):
        assert "drop_at" not in ops.packed_args(make_attn_call(q, q, q, **{"dropout_p": 0.1, **kw})), kw


def test_pair_backward_replays_the_whole_calls_dropout():
    """ops.attention_backward with the forward's seed: each (query chunk, key chunk) pair's gradients
    with dropout are its exact share of the whole call's (the keep-mask replayed at the pair's absolute
    positions); summed over the pairs they are the whole call's gradients."""
    from effattn.numerics import draw_seed
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    k, v = k[:, :2].clone(), v[:, :2].clone()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw, p = dict(causal=True, window=9), 0.25
    torch.manual_seed(4)
    whole, lse = effattn.attention(*leaves, dropout_p=p, return_lse=True, backend="torch", **kw)
    torch.manual_seed(4)
    seed = draw_seed()
    dout = torch.randn(whole.shape, generator=g)
    ref = torch.autograd.grad(whole, leaves, dout)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for qs in (0, 8):
        for ks in (0, 8):
            rows = slice(qs, qs + 8)
            a, b, c = effattn.ops.attention_backward(dout[:, :, rows], q[:, :, rows], k[:, :, ks:ks + 8],
                                                     v[:, :, ks:ks + 8], whole[:, :, rows].detach(),
                                                     lse[:, :, rows].detach(), positions=(qs, ks), dropout_p=p,
                                                     seed=seed, **kw)
            got[0][:, :, rows] += a
            got[1][:, :, ks:ks + 8] += b
            got[2][:, :, ks:ks + 8] += c
    for name, a, b in zip("qkv", got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"d{name}: {m}")
    with pytest.raises(ValueError, match="needs seed"):
        effattn.ops.attention_backward(dout, q, k, v, whole.detach(), lse.detach(), dropout_p=p, **kw)
