"""Short CPU calls (issue 25, item 7): the chunked form of causal linear attention as batched ops
(``torch/linear-cpu-chunks``) against the float64 oracle, forward and backward, with its rule visible
in explain; the flash kernel's calls that want gradients of out only (``torch/cpu-flash``,
``torch/cpu-sdpa-mask``) under torch's own autograd node, bitwise the op pair's gradients."""
import pytest
import torch

import effattn
from effattn._call import make_linear_call
from effattn.backends.torch.attention import cpu_flash, cpu_masked
from effattn.backends.torch.linear import cpu_chunks
from effattn.testing.oracle import chunked_linear_attention, feature_map
from tests.backends.torch.test_cpu_paths import _with_threads

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _qkv(B, H, Hkv, L, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, Hkv, L, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, L, Dv, generator=g, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("H,Hkv,L,fm,normalize", [
    (4, 4, 70, "elu", True),         # L not a multiple of the chunk: zero features padded at the end
    (4, 2, 64, "relu", True),        # GQA: two query heads per key/value head
    (2, 1, 33, "elu", False),
    (2, 2, 600, "elu", True),        # past SHORT_L: chunks of 64
])
def test_chunks_match_the_oracle_forward_and_backward(dtype, H, Hkv, L, fm, normalize):
    q, k, v = _qkv(2, H, Hkv, L, 16, 8, dtype)
    kw = dict(causal=True, feature_map=fm, normalize=normalize)
    ex = effattn.explain(q, k, v, op="linear_attention", **kw)
    assert ex.chosen_path == "torch/linear-cpu-chunks", str(ex)
    assert f"chunks of {cpu_chunks.chunk_size(L)}" in ex.paths["torch"]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(2, H, L, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    out = effattn.linear_attention(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    want = chunked_linear_attention(q, k, v, dout, feature_map(fm), causal=True, normalize=normalize)
    tol = TOL[dtype]
    for got, ref in zip((out, *grads), want):
        torch.testing.assert_close(got.double(), ref.double(), atol=tol, rtol=tol)


def test_rows_that_see_nothing_give_zero():
    """relu features of an all-negative query row are 0: with eps = 0 its denominator is 0 and it
    outputs 0 (not NaN), its gradients 0; identity features take the guarded division too."""
    q, k, v = _qkv(1, 2, 2, 40, 8, 8, torch.float64)
    q[0, 0, :5] = -1.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = effattn.linear_attention(*leaves, causal=True, feature_map="relu", eps=0.0)
    assert effattn.explain(q, k, v, op="linear_attention", causal=True, feature_map="relu",
                           eps=0.0).chosen_path == "torch/linear-cpu-chunks"
    assert torch.equal(out[0, 0, :5], torch.zeros(5, 8, dtype=torch.float64))
    gq, gk, gv = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv)) and torch.equal(gq[0, 0, :5], torch.zeros(5, 8).double())
    call = make_linear_call(q, k, v, causal=True, feature_map="identity", eps=0.0)
    ref = effattn.backends.torch.linear.reference.PATH.run(call)[0]
    torch.testing.assert_close(cpu_chunks.chunked(call, 16), ref, atol=1e-9, rtol=1e-9)


def test_the_rule_is_in_explain(monkeypatch):
    """The chunk length follows `chunk_size`; from `SLICED_FROM` threads the ops run on slices; `MAX_L` sends longer calls to the slice path, with the
    rule named in the reason; non-causal calls, Lq != Lk and states are left to the other rows."""
    assert (cpu_chunks.chunk_size(cpu_chunks.SHORT_L), cpu_chunks.chunk_size(cpu_chunks.SHORT_L + 1)) == \
        (cpu_chunks.CHUNK_SHORT, cpu_chunks.CHUNK_LONG)
    q, k, v = _qkv(1, 2, 2, 64, 8, 8, torch.float32)
    assert cpu_chunks.SLICED_FROM is None           # measured idle: the intra-op form is faster at 2 threads
    two = _with_threads(2, lambda: effattn.explain(q, k, v, op="linear_attention", causal=True))
    assert "on all threads" in two.paths["torch"]
    monkeypatch.setattr(cpu_chunks, "SLICED_FROM", 2)
    two = _with_threads(2, lambda: effattn.explain(q, k, v, op="linear_attention", causal=True))
    one = _with_threads(1, lambda: effattn.explain(q, k, v, op="linear_attention", causal=True))
    assert "on slices" in two.paths["torch"] and "on all threads" in one.paths["torch"]
    monkeypatch.setattr(cpu_chunks, "MAX_L", {1: 32, 2: 32})
    ex = effattn.explain(q, k, v, op="linear_attention", causal=True)
    assert ex.chosen_path != "torch/linear-cpu-chunks"
    assert "rule cpu_chunks.MAX_L" in ex.row("torch/linear-cpu-chunks").reasons[0]
    monkeypatch.undo()
    for kw, why in ((dict(causal=False), "not causal"), (dict(causal=True, return_state=True), "does not support state")):
        ex = effattn.explain(q, k, v, op="linear_attention", **kw)
        assert ex.chosen_path != "torch/linear-cpu-chunks" and why in ex.row("torch/linear-cpu-chunks").reasons[0]
    ex = effattn.explain(q[:, :, :10], k, v, op="linear_attention", causal=True)
    assert "Lq = 10 != Lk = 64" in ex.row("torch/linear-cpu-chunks").reasons[0]


@pytest.mark.parametrize("case", ["dense", "causal-gqa", "padding", "padding-nan"])
def test_native_autograd_is_bitwise_the_op_pair(case):
    """An eager call wanting gradients of out only records torch's own autograd node; its output and
    gradients are bitwise those of the op pair (the custom ops); NaN in padded keys reaches nothing."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 48, 16, generator=g)
    k, v = (torch.randn(2, 2 if case == "causal-gqa" else 4, 48, 16, generator=g) for _ in range(2))
    pad = torch.zeros(2, 48, dtype=torch.bool)
    pad[0, 30:] = True
    if case == "padding-nan":
        k[0, :, 40], v[0, :, 41] = float("nan"), float("inf")
    d = torch.randn(2, 4, 48, 16, generator=g)
    causal = case == "causal-gqa"
    if case.startswith("padding"):
        ours = lambda a, b, c: effattn.attention(a, b, c, key_padding_mask=pad)  # noqa: E731
        pair = lambda a, b, c: cpu_masked.cpu_sdpa_mask_fwd(a, b, c, None, 0, pad, 0.25, -1, -1)[0]  # noqa: E731
    else:
        ours = lambda a, b, c: effattn.attention(a, b, c, causal=causal)  # noqa: E731
        pair = lambda a, b, c: cpu_flash.cpu_flash_fwd(a, b, c, causal, 0.25)[0]  # noqa: E731
    res = []
    for fn in (ours, pair):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        res.append((type(out.grad_fn).__name__, out.detach(), *torch.autograd.grad(out, leaves, d)))
    assert res[0][0] == "ScaledDotProductFlashAttentionForCpuBackward0", res[0][0]
    for a, b in zip(res[0][1:], res[1][1:]):
        assert torch.equal(a, b)
    if case == "padding-nan":
        assert all(torch.isfinite(t).all() for t in res[0][1:])
        assert torch.equal(res[0][3][0, :, 30:], torch.zeros(4 // 1, 18, 16))


def test_native_autograd_leaves_huge_scores_to_the_blocks_backward():
    """Scores whose lse is past `kernel_backward_exact`'s bound: the forward runs again through the
    op pair, whose backward (the blocks path's) gives finite gradients."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 16, 8, generator=g) * 1e5 for _ in range(2))
    v = torch.randn(1, 2, 16, 8, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = effattn.attention(*leaves)
    assert type(out.grad_fn).__name__ != "ScaledDotProductFlashAttentionForCpuBackward0"
    assert all(torch.isfinite(t).all() for t in torch.autograd.grad(out, leaves, torch.ones_like(out)))
