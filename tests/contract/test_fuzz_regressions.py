"""Regression tests for the bugs of issue 27 and those the fuzz (tests/contract/test_fuzz.py) found, one per
bug, named after it, on every backend usable here (Triton in the interpreter, CUDA in the emulation)."""
import contextlib

import pytest
import torch

import effattn
from effattn.backends import base
from effattn.testing.oracle import naive_attention
from tests.conftest import op_backends
from tests.contract.test_fuzz import runnable_units


def _units(op):
    return [pytest.param(u, id=u.name) for u in runnable_units(op)]


def _call(unit, fn, *args, **kw):
    with unit.enter():
        return fn(*args, backend=unit.backend, **kw)


def _serves_states(unit) -> bool:
    """Whether the unit's row declares states (the one-token step rows and torch/linear-cpu-chunks do not)."""
    row = next(p for p in base.rows("linear_attention") if p.name == unit.name)
    return not unit.name.endswith("-step") and "state" in row.caps.features


@pytest.mark.parametrize("unit", [p for p in _units("linear_attention") if _serves_states(p.values[0])])
def test_linear_backward_with_initial_state_noncausal_h_eq_hkv(unit):
    """Triton / CUDA: the non-causal output pass's backward returned the gradients of the keys' state
    and of initial_state as two views of one tensor when H == Hkv; torch's custom-op wrapper refused."""
    dtype = torch.float32 if torch.float32 in base._REGISTRY["linear_attention"][unit.backend].caps.dtypes \
        else torch.float16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    S0 = (torch.rand(1, 2, 16, 16, generator=g)).requires_grad_()
    z0 = (torch.rand(1, 2, 16, generator=g) + 1).requires_grad_()
    out = _call(unit, effattn.linear_attention, q, k, v, causal=False, initial_state=(S0, z0))
    out.float().sum().backward()
    # the reference: the same sums in float64
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    S64, z64 = S0.detach().double().requires_grad_(), z0.detach().double().requires_grad_()
    phi = lambda x: torch.where(x > 0, x + 1, torch.exp(x))  # noqa: E731
    fq, fk = phi(q64), phi(k64)
    S = S64 + fk.transpose(-1, -2) @ v64
    z = z64 + fk.sum(2)
    ref = (fq @ S) / ((fq * z[:, :, None]).sum(-1, keepdim=True) + 1e-6)
    ref.sum().backward()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad), (S0.grad, S64.grad),
                      (z0.grad, z64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.0, -0.5, -1e-30])
def test_torch_causal_nonpositive_scale_no_nan(dtype, scale):
    """torch backend: causal calls with scale <= 0 went to torch's fused flash CPU kernel, whose
    causal mask then gives NaN; they now take the kernel with a materialized mask, -inf where
    unseen whatever the scale (explain says why the unmasked kernel does not)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 25, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    out = effattn.attention(q, k, v, causal=True, scale=scale, backend="torch")
    assert not out.isnan().any()
    ex = effattn.explain(q, k, v, causal=True, scale=scale)
    assert ex.paths["torch"].startswith("torch/cpu-sdpa-mask")
    assert any("causal with scale <= 0" in w for w in ex.row("torch/cpu-flash").reasons)
    ref, _ = naive_attention(q.detach().double(), k.detach().double(), v.detach().double(), causal=True, scale=scale)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert not any(gr.isnan().any() for gr in grads)


def test_float64_dropout_backward_scale_in_float64():
    """torch backend: the dropout backward multiplied by 1 / (1 - p) rounded to float32 (a bool
    tensor divided by a Python float); float64 gradients were off by ~3e-8 relative."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 9, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    p = 0.3                                  # 1 / 0.7 is not a float32 number
    torch.manual_seed(5)
    out = effattn.attention(q, k, v, dropout_p=p, backend="torch")
    # the keep-mask, read back through V = identity: P o keep / (1 - p)
    eye = torch.eye(9, dtype=torch.float64)[None, None]
    torch.manual_seed(5)
    probs_kept = effattn.attention(q.detach(), k.detach(), eye, dropout_p=p, backend="torch")
    keep = probs_kept != 0
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(q64, k64, v64, dropout_keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q64, k64, v64), go)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


# the rows that serve none of these calls: the split-KV decodes (few rows, no grad), the flash CPU
# kernel (no masks) and the packed CPU row (cu_seqlens only)
@pytest.mark.parametrize("unit", [p for p in _units("attention")
                                  if not p.values[0].name.endswith(("decode", "cpu-flash", "cpu-segments"))])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("ignored", ["padding", "window", "layout"])
def test_nan_in_ignored_key_does_not_poison_row(unit, poison, ignored):
    """Every backend: a NaN / inf in the K or V row of a key no query sees (padded, outside every
    window, in no visible layout block) turned whole rows into NaN (0 * NaN in P V and in the
    gradients). Outputs and gradients must equal the call with finite values there."""
    from effattn.layouts import BlockLayout
    dtype = torch.float16 if unit.backend == "cuda" else torch.float32
    B, H, Lq, Lk, D = 2, 2, 5, 40, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    k, v = torch.randn(B, H, Lk, D, generator=g).to(dtype), torch.randn(B, H, Lk, D, generator=g).to(dtype)
    bad = torch.zeros(B, H, Lk, dtype=torch.bool)
    if ignored == "padding":
        kw = {"key_padding_mask": torch.arange(Lk)[None].expand(B, Lk) >= 30}
        bad[:, :, 33] = True
    elif ignored == "window":                      # rows see keys [i + 25, i + 35]
        kw = {"causal": True, "window": 10}
        bad[:, :, 3] = True
    else:                                          # key block 0 (keys 0..15) visible to no query
        kw = {"layout": BlockLayout(torch.tensor([[[False, True, True]]]), 16)}
        bad[:, :, 7] = True
    kp, vp = k.clone(), v.clone()
    kp[bad], vp[bad] = poison, poison
    if unit.name.endswith("/score"):               # the score-terms rows serve calls with a score term
        kw["softcap"] = 30.0
    outs, grads = [], []
    for kk, vv in ((k, v), (kp, vp)):
        leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
        out = _call(unit, effattn.attention, *leaves, **kw)
        outs.append(out)
        grads.append(torch.autograd.grad(out.float().sum(), leaves))
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1]):
        assert not b.isnan().any()
        assert torch.equal(a[~bad] if a.shape[1] == H and a.shape[2] == Lk else a, b[~bad]
                           if b.shape[1] == H and b.shape[2] == Lk else b)
    for gr in grads[1][1:]:                        # the ignored keys' own gradients: 0
        assert bool((gr[bad] == 0).all())
    with torch.no_grad():                          # the forward-only paths (split-KV decode)
        assert torch.equal(_call(unit, effattn.attention, q, kp, vp, **kw), _call(unit, effattn.attention, q, k, v,
                                                                                  **kw))


@pytest.mark.parametrize("name", [n for n in op_backends("attention") if n != "torch"] + ["cuda"])
def test_backend_dtype_errors_are_type_errors(name):
    """A named backend asked for a dtype it does not serve raised RuntimeError; now TypeError (like
    the public functions' dtype errors), and other refusals ValueError (both still RuntimeError)."""
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype float64 not served"):
        effattn.attention(q, q, q, backend=name)
    with pytest.raises(RuntimeError):
        effattn.attention(q, q, q, backend=name)
    assert base.DtypeNotServed.__mro__.index(TypeError) < base.DtypeNotServed.__mro__.index(ValueError)


def test_readme_documents_triton_fp32_decode_limit():
    """The Triton split-KV decode serves float32 (IEEE dots) only up to 4096 packed rows x head dim."""
    import os

    from effattn.backends.triton.attention import decode
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")).read()
    assert "**4096 for float32 with IEEE dots**" in readme
    assert decode.fits(16, 256, 256, 4, True) and not decode.fits(32, 256, 256, 4, True)
    assert decode.fits(64, 64, 64, 4, True) and not decode.fits(128, 64, 64, 4, True)


@pytest.mark.parametrize("unit", [p for p in _units("attention") if p.values[0].name == "torch/reference"])
def test_empty_batch_per_head_layout_and_padding(unit):
    """Found by the fuzz: B = 0 with a per-head layout and a key padding mask crashed the torch
    reference (a reshape of 0 elements with an inferred dimension)."""
    from effattn.layouts import BlockLayout
    q = torch.randn(0, 2, 3, 4, requires_grad=True)
    k, v = torch.randn(0, 1, 1, 4, requires_grad=True), torch.randn(0, 1, 1, 4, requires_grad=True)
    kw = dict(layout=BlockLayout(torch.ones(2, 1, 1, dtype=torch.bool), 16),
              key_padding_mask=torch.zeros(0, 1, dtype=torch.bool))
    out, lse = _call(unit, effattn.attention, q, k, v, return_lse=True, **kw)
    assert out.shape == (0, 2, 3, 4) and lse.shape == (0, 2, 3)
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    assert all(gr is None or gr.numel() == 0 for gr in grads)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_flash_path_strided_last_dim(name):
    """Found by the fuzz: torch's fused flash CPU kernel reads rows as if their last dimension were
    contiguous; a view such as x[..., ::2] gave wrong results (errors of order 1) on the default CPU
    path. Such inputs are now copied first, and explain says so."""
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(1, 2, 5, 16, generator=g) for n in "qkv"}
    t[name] = torch.randn(1, 2, 5, 32, generator=g)[..., ::2]
    path = effattn.explain(t["q"], t["k"], t["v"]).paths["torch"]
    assert "flash" in path and f"{name} copied" in path
    leaves = [t[n].requires_grad_() for n in "qkv"]
    out = effattn.attention(*leaves, backend="torch")
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref, _ = naive_attention(*ref_leaves)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    go = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, ref_leaves, go.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unit", [p for p in _units("attention") if not p.values[0].name.endswith(("decode", "score"))])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_huge_scores_give_finite_gradients(unit, out_dtype):
    """Found by the fuzz: scores of ~1e10 (q, k, v ~ 1000, scale 1e4) gave NaN dq / dk and inf dv in
    float32 on the flash CPU kernel's paths: its backward recomputes the scores rounding them
    otherwise than its forward did, by ulps of 1e10 (1024), and exp(s - lse) overflowed. Those
    gradients are now computed by the blocks path's backward, whose P never exceeds 1."""
    g = torch.Generator().manual_seed(0)
    base_ = [torch.randn(1, 1, 3, 1, generator=g, dtype=torch.float64) * 1000 for _ in range(3)]
    kw = {} if out_dtype is None else {"out_dtype": out_dtype}
    dtype = torch.float32 if torch.float32 in base._REGISTRY["attention"][unit.backend].caps.dtypes \
        else torch.bfloat16
    base_ = [t.to(dtype).double() for t in base_]
    leaves = [t.to(dtype).requires_grad_() for t in base_]
    with unit.enter():
        ok = effattn.explain(*leaves, scale=1e4, **kw).can_serve(unit.backend)
    if not ok:
        pytest.skip("the unit does not serve this call")
    out = _call(unit, effattn.attention, *leaves, scale=1e4, **kw)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    ref_leaves = [t.clone().requires_grad_() for t in base_]
    ref, _ = naive_attention(*ref_leaves, scale=1e4)
    ref_grads = torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        # P is one-hot here (score gaps of ~1e6): dq = dk = 0 and dv counts each key's winners
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("unit", [p for p in _units("attention") if p.values[0].name in
                                  ("torch/cpu-sdpa-mask", "torch/reference")])
def test_batch_permutation_torch_rows_within_ulps(unit):
    """Found by the fuzz: permuting the batch did not permute the output bitwise on the torch paths
    (float64, shape (2, 1, 1, 9, 9, 1, 1)). torch's own CPU kernels are not batch-invariant: they
    round a batch row differently by its place in memory (shown below on a bare matmul), so the
    fuzz holds the torch backend's rows to a few ulps there (bitwise elsewhere)."""
    from tests.contract import test_fuzz as tf
    perm = torch.tensor([1, 0])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 1, 43, 55, generator=g, dtype=torch.float64), torch.randn(2, 1, 55, 3, generator=g,
                                                                                   dtype=torch.float64)
    differs = [not torch.equal(torch.matmul(a, b)[perm], torch.matmul(a[perm], b[perm]))]
    for s, shape in enumerate([(2, 1, 1, 9, 9, 1, 1), (2, 1, 1, 43, 55, 3, 3)] * 2):
        c = dict(dtype=torch.float64, shape=shape, kw={"causal": bool(s % 2)}, mag=1.0, grad=False,
                 view="contiguous", poison=None, seed=s)
        q, k, v = tf._inputs(c)
        with torch.no_grad():
            out = _call(unit, effattn.attention, q, k, v, **c["kw"])
            got = _call(unit, effattn.attention, q[perm], k[perm], v[perm], **c["kw"])
            differs.append(not torch.equal(got, out[perm]))
            tf.check_properties(unit, c, q, k, v, c["kw"])      # within its few ulps
    if not any(differs):
        pytest.skip("torch's kernels are batch-invariant on this machine")


@pytest.mark.parametrize("unit", [p for p in _units("attention") if p.values[0].name == "torch/cpu-segments"])
def test_segments_unit_serves_packed_calls(unit):
    """Found by the fuzz: torch/cpu-segments, set alone in its backend, refused every packed call
    that explain said it serves ("not a packed call"): it runs each segment as a plain call of the
    torch backend, whose other rows the fuzz had set aside. The fuzz's unit now keeps them for the
    segments; a segment without keys gives rows of 0 (lse -inf), with or without the isolation."""
    from tests.contract import test_fuzz as tf
    cu = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32))
    q = torch.randn(1, 1, 1, 4, requires_grad=True)
    k, v = torch.randn(1, 1, 0, 4), torch.randn(1, 1, 0, 4)
    for ctx in (unit.enter, contextlib.nullcontext):
        with ctx():
            assert effattn.explain(q, k, v, cu_seqlens=cu).paths["torch"].startswith("torch/cpu-segments")
            out, lse = effattn.attention(q, k, v, cu_seqlens=cu, return_lse=True, backend="torch")
        assert torch.equal(out, torch.zeros(1, 1, 1, 4)) and torch.isneginf(lse).all()
        assert torch.equal(torch.autograd.grad(out.sum(), q)[0], torch.zeros_like(q))
    c = dict(dtype=torch.float32, shape=(1, 2, 1, 7, 9, 8, 8), mag=1.0, grad=True, view="contiguous", poison=None,
             seed=3, kw={"causal": True, "cu_seqlens": (torch.tensor([0, 3, 3, 7], dtype=torch.int32),
                                                        torch.tensor([0, 4, 4, 9], dtype=torch.int32))})
    tf.check_attention(unit, c)                   # against the oracle, with every property


@pytest.mark.parametrize("unit", [p for p in _units("linear_attention") if p.values[0].name == "torch/linear-chunked"])
def test_linear_float64_gradient_judged_on_its_terms(unit):
    """Found by the fuzz: torch/linear-chunked, float64, shape (1, 1, 1, 1, 1, 1, 1), elu, eps 1e-6:
    dq off by 1.7e-10 of its size > the 1e-10 floor. The path was right: with eps small, d(num / den)
    is the difference of two terms ~1e6 times its size, which float64 rounds at 1e-16 of the terms.
    The fuzz now judges a linear gradient relative to those terms (`linear_grad_terms`)."""
    from tests.contract import test_fuzz as tf
    for s, mag, state in [(0, 1.0, False), (0, 0.1, True), (1, 0.01, False), (2, 1.0, True)]:
        c = dict(dtype=torch.float64, shape=(1, 1, 1, 1, 1, 1, 1), causal=False, fmap="elu", normalize=True,
                 eps=1e-6, state=state, grad=True, view="contiguous", mag=mag, seed=s)
        tf.check_linear(unit, c)
    # the cancellation the old floor missed, and the path's dq within 1e-14 of the terms
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1, 1, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    out = _call(unit, effattn.linear_attention, q, k, v, eps=1e-6)
    dq, = torch.autograd.grad(out.sum(), q)
    phi = tf.feature_map("elu")
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_dq, = torch.autograd.grad(tf.linear_oracle(*ref_leaves, phi, False, True, 1e-6, None).sum(), ref_leaves[0])
    terms = tf.linear_grad_terms([t.detach().clone().requires_grad_() for t in (q, k, v)],
                                 torch.ones_like(out), phi, False, True, 1e-6, None)
    assert terms[0] > 1e4 * ref_dq.abs().item()
    assert abs(dq.item() - ref_dq.item()) <= 1e-14 * terms[0]


@pytest.mark.parametrize("unit", [p for p in _units("attention") if p.values[0].name == "torch/reference"])
def test_fp32_output_with_layout_keeps_the_layout(unit):
    """Found by the fuzz: torch/reference, out_dtype=torch.float32 with a block layout: the fp32
    output's work list (one segment, the whole call) dropped the layout, so keys of blocks no
    query may see were attended (float16, (1, 1, 1, 1, 17, 1, 1), layout [[1, 0]]: off by 0.08)."""
    from effattn.layouts import BlockLayout
    from tests.contract import test_fuzz as tf
    for c in (dict(dtype=torch.float16, shape=(1, 1, 1, 1, 17, 1, 1), mag=1.0, grad=False, view="contiguous",
                   poison=None, seed=0, kw={"layout": BlockLayout(torch.tensor([[[True, False]]]), 16),
                                            "out_dtype": torch.float32}),
              dict(dtype=torch.bfloat16, shape=(2, 2, 1, 40, 70, 8, 8), mag=1.0, grad=True, view="transposed",
                   poison=float("nan"), seed=1, kw={"causal": True, "out_dtype": torch.float32,
                                                    "layout": BlockLayout(torch.rand(2, 3, 5, generator=torch.Generator()
                                                                                     .manual_seed(1)) < 0.5, 16)})):
        tf.check_attention(unit, c)                # against the oracle, with every property


@pytest.mark.parametrize("unit", [p for p in _units("linear_attention") if p.values[0].name.endswith("-step")])
def test_linear_step_unit_refuses_gradients_as_explain_says(unit):
    """Found by the fuzz: the linear fuzz asked explain about inputs without gradients, then called
    the forward-only step rows with inputs requiring them (refused: "the step kernel has no
    backward"). It now asks about the call as made, and the refusal is what explain says."""
    from tests.contract import test_fuzz as tf
    c = dict(dtype=torch.float32, shape=(1, 1, 1, 1, 1, 1, 1), causal=False, fmap="elu", normalize=False, eps=1e-6,
             state=False, grad=True, view="contiguous", mag=1.0, seed=0)
    tf.check_linear(unit, c)
    q = torch.randn(1, 1, 1, 4, requires_grad=True)
    with unit.enter():
        assert not effattn.explain(q, q, q, op="linear_attention").can_serve(unit.backend)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("block, per_head", [(16, True), (16, False), (1, True)])
def test_triton_decode_layout_hidden_key_does_not_poison_row(monkeypatch, poison, block, per_head):
    """Triton split-KV decode: it zeroed the values of keys no query sees by window and padding
    but not by block layout, so a NaN / inf in the K / V row of a key that only a layout hides
    turned the rows of its split into NaN (0 * NaN in P V). Block 16: the queries in one query
    block (the keys the GQA group's heads see, per key); block 1: the rows of one tile in several
    query blocks (the kernel reduces its mask over the rows); one split and three."""
    from effattn import splits
    from effattn.backends.triton.attention import decode
    from effattn.layouts import BlockLayout
    if "triton" not in op_backends("attention"):
        pytest.skip("triton not usable here")
    monkeypatch.setattr(splits, "DECODE_MIN_KEYS", 1)         # the decode row takes this short call
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 3, 96, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    mask = torch.rand(H if per_head else 1, -(-Lq // block), -(-Lk // block), generator=g) < 0.4
    mask[..., -1] = True                                      # every row sees its own key
    layout = BlockLayout(mask, block)
    kw = dict(causal=True, layout=layout)
    assert effattn.explain(q, k, v, **kw).paths["triton"].startswith("triton/decode")
    _, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kw)
    from effattn.testing.oracle import visibility
    vis = visibility(Lq, Lk, causal=True, layout=layout, B=B, H=H)           # (B, H, Lq, Lk)
    unseen = ~vis.any(2).reshape(B, Hkv, H // Hkv, Lk).any(2)
    assert unseen.any() and (~unseen).any()
    kp, vp = k.clone(), v.clone()
    kp[unseen], vp[unseen] = poison, poison
    for per in (None, 32):                                    # one split, and three
        out = decode.fwd(q, k, v, layout.mask, block, None, D ** -0.5, -1, 0,
                         keys_per_split=per, block_n=32)[0]
        bad = decode.fwd(q, kp, vp, layout.mask, block, None, D ** -0.5, -1, 0,
                         keys_per_split=per, block_n=32)[0]
        assert not bad.isnan().any(), f"keys_per_split={per}"
        assert torch.equal(bad, out), f"keys_per_split={per}"
    with torch.no_grad():
        out = effattn.attention(q, k, v, backend="triton", **kw)
        assert torch.equal(effattn.attention(q, kp, vp, backend="triton", **kw), out)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("Lq, window", [(1, 5), (2, 5), (20, 5), (2, None)], ids=["decode", "packed", "unpacked", "no-window"])
def test_paged_window_hidden_key_does_not_poison_row(poison, Lq, window):
    """Triton paged kernel: it masked the scores of keys outside every query's window but read their
    values, so a NaN / inf in a page slot of a key no query sees (in the key tile the window's start
    falls in) turned the rows into NaN (0 * NaN in P V). Every slot no query sees holds the poison:
    hidden by the window, past seqlens in a sequence's last page, in pages no table lists; one split
    and splits of 64 keys; packed GQA rows (Lq <= 16) and unpacked ones."""
    from effattn.backends.triton.paged.launch import paged_forward
    from tests.core.test_paged import paged_setup
    lens, ps = [70, 131, 3], 16
    q, kp, vp, table, seqlens = paged_setup(lens, page_size=ps, num_pages=30, Lq=Lq)
    table = table.clamp_min(0)
    seen = torch.zeros(kp.shape[:2], dtype=torch.bool)                 # (page, slot) some query sees
    for b, n in enumerate(lens):
        first = max(0, n - Lq - window) if window is not None else 0
        for j in range(first, n):
            seen[table[b, j // ps], j % ps] = True
    kb, vb = kp.clone(), vp.clone()
    kb[~seen], vb[~seen] = poison, poison
    left, right = effattn.visibility.normalize_window(window, True)
    for per in (None, 64):
        out, lse = paged_forward(q, kp, vp, table, seqlens, left, right, 8 ** -0.5, keys_per_split=per)
        bad, bad_lse = paged_forward(q, kb, vb, table, seqlens, left, right, 8 ** -0.5, keys_per_split=per)
        assert not bad.isnan().any(), f"keys_per_split={per}"
        assert torch.equal(bad, out) and torch.equal(bad_lse, lse), f"keys_per_split={per}"
    for backend in ("triton", "torch"):
        kw = dict(block_table=table, seqlens=seqlens, causal=True, window=window, backend=backend)
        assert torch.equal(effattn.attention(q, kb, vb, **kw), effattn.attention(q, kp, vp, **kw)), backend


@pytest.mark.parametrize("unit", [p for p in _units("attention") if p.values[0].name in ("torch/score", "triton/score",
                                                                                           "cuda/prefill")])
def test_positions_with_distance_terms_never_collapse(unit):
    """``positions`` that hide no pair (no causal, no window) left a plain call, so ALiBi / Relative /
    Span read the bottom-right distance ``i + Lk - Lq - j`` instead of the positions'
    ``(q_start + i) - (k_start + j)`` (torch/score, triton/score, cuda/prefill: off by up to 2.1 at
    (1, 2, 8, 16), positions (0, 5)). Such positions now stay, and the score rows serve them with the
    positions' distances; positions at the bottom-right offset still collapse."""
    from effattn.bias import ALiBi
    from effattn.testing.oracle import score_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g).to(torch.float16) for _ in range(3))
    bias = ALiBi(torch.tensor([0.5, 0.25]))
    for pos in [(0, 5), (20, 0)]:
        with unit.enter():
            assert effattn.explain(q, k, v, bias=bias, positions=pos).can_serve(unit.backend)
        out = _call(unit, effattn.attention, q, k, v, bias=bias, positions=pos)
        ref, _ = score_attention(q, k, v, bias=bias, positions=pos)
        assert (out.double() - ref).abs().max().item() < 2e-3, pos
    out = _call(unit, effattn.attention, q, k, v, bias=bias, positions=(3, 3))     # offset Lk - Lq = 0
    ref, _ = score_attention(q, k, v, bias=bias, positions=(3, 3))
    assert (out.double() - ref).abs().max().item() < 2e-3
    # softcap, sinks and a dense bias read no distance: those positions still collapse to a plain call
    out = _call(unit, effattn.attention, q, k, v, softcap=2.0, positions=(0, 5))
    ref, _ = score_attention(q, k, v, softcap=2.0)
    assert (out.double() - ref).abs().max().item() < 2e-3


@pytest.mark.parametrize("unit", [p for p in _units("attention") if p.values[0].name in ("torch/score", "triton/score",
                                                                                           "cuda/prefill")])
def test_large_softcap_keeps_tanh_accurate(unit):
    """Triton's tanh was (1 - e^-2x) / (1 + e^-2x): with a large softcap (1e6, i.e. no cap) x = s / c is
    ~1e-6, 1 - e cancels, and the scores came out ~1% off (lse off by 0.03 at (1, 1, 26, 26, 16) fp16):
    small arguments now take tanh's Taylor series."""
    from effattn.testing.oracle import score_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 26, 16, generator=g).to(torch.float16) for _ in range(3))
    for cap in (1e6, 1e3, 8.0, 0.5):
        out, lse = _call(unit, effattn.attention, q, k, v, softcap=cap, scale=1.8, causal=True, return_lse=True)
        ref, ref_lse = score_attention(q, k, v, softcap=cap, scale=1.8, causal=True)
        assert (lse.double() - ref_lse).abs().max().item() < 1e-4 * max(1.0, ref_lse.abs().max().item()), cap
        assert (out.double() - ref).abs().max().item() < 4e-3, cap


@pytest.mark.parametrize("max_seqlen", [(5, 5, 5), (5,), [5, 5, 1], ()])
def test_max_seqlen_tuple_not_a_pair_is_refused(max_seqlen):
    """``max_seqlen`` of another length than 2 was taken as a pair (its first two entries, or only the
    query side): a wrong argument served silently (found while the fuzz's invalid arguments were
    extended to the packed ones)."""
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(TypeError, match=r"max_seqlen must be an int or a \(max_seqlen_q, max_seqlen_k\) pair"):
        effattn.attention(q, q, q, cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), max_seqlen=max_seqlen)
    # the validation without max_seqlen's device checks (explain) refuses it the same way
    with pytest.raises(TypeError, match="max_seqlen"):
        effattn.explain(q, q, q, cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), max_seqlen=max_seqlen)
