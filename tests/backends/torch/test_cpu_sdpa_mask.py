"""The row ``torch/cpu-sdpa-mask`` (backends/torch/attention/cpu_masked.py): torch's fused CPU kernel
with a materialized mask. Its measured admission rule and explain's lines on both sides of it; the
oracle with masks that leave rows with no visible key (output 0, lse -inf, gradients, the lse's
gradient); NaN / inf in keys no query sees with a per-head layout and GQA; and that the generic
checks (tests/contract/test_paths.py) and the fuzz (tests/contract/test_fuzz.py) pick the row up.

The row's generic checks, the fuzz and the poisoned-key regression of every row run in those files.
"""
import math

import pytest
import torch

import effattn
from effattn._call import make_attn_call
from effattn.backends.torch.attention import cpu_masked
from effattn.layouts import BlockLayout
from effattn.testing.oracle import naive_attention
from effattn.visibility import Rule
from tests.contract import test_fuzz, test_paths

ROW = "torch/cpu-sdpa-mask"
pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                                reason="this torch has no flash CPU kernel")


def test_the_generic_checks_and_the_fuzz_pick_the_row_up():
    assert ROW in test_paths.PATHS
    assert ROW in [u.name for u in test_fuzz.runnable_units("attention")]
    assert ROW in [p.values[0].name for p in test_fuzz.ATTN_UNITS]


def _x(L, D=16, H=2):
    return torch.zeros(1, H, L, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_explain_shows_the_rule_on_both_sides(dtype):
    """Short calls: the row at any visible fraction; past ADMIT.small_pairs a narrow window goes to the
    blocks path and a wide one (or light padding) stays, each with the rule's reason in explain."""
    a = cpu_masked.ADMIT
    short = int(math.isqrt(a.small_pairs))                    # Lq * Lk == small_pairs: still admitted
    x = _x(short).to(dtype)
    ex = effattn.explain(x, x, x, causal=True, window=2)
    assert ex.chosen_path == ROW and f"Lq * Lk = {short * short} <= {a.small_pairs}" in ex.paths["torch"], str(ex)
    long = short + 64
    fmin = cpu_masked.min_fraction(dtype, 64, long * long)
    x = _x(long, D=64).to(dtype)
    narrow = effattn.explain(x, x, x, causal=True, window=8)
    assert narrow.chosen_path == "torch/cpu-blocks", str(narrow)
    why = narrow.row(ROW).reasons
    assert len(why) == 1 and "visible fraction" in why[0] and f"< {fmin}" in why[0] and \
        "the blocks path is faster there" in why[0], why
    wide = effattn.explain(x, x, x, causal=True, window=long - 2)
    assert wide.chosen_path == ROW and f">= {fmin}" in wide.paths["torch"], str(wide)
    pad = torch.zeros(1, long, dtype=torch.bool)
    pad[:, : long // 10] = True
    ex = effattn.explain(x, x, x, key_padding_mask=pad)
    assert ex.chosen_path == ROW, str(ex)                      # visible fraction 0.9
    pad[:, : long - 4] = True
    ex = effattn.explain(x, x, x, key_padding_mask=pad)       # almost all padding: skipped, 4 keys read
    assert ex.chosen_path == ROW and f"the 4 of {long} keys" in ex.paths["torch"], str(ex)
    xb = x.expand(8, -1, -1, -1)
    pad = pad.expand(8, -1).clone()
    pad[0] = False              # one entry keeps every key, seven almost none: nothing skipped, fraction 0.13
    ex = effattn.explain(xb, xb, xb, key_padding_mask=pad)
    assert ex.chosen_path == "torch/cpu-blocks" and "visible fraction" in ex.row(ROW).reasons[0], str(ex)


def test_the_rule_follows_the_measured_constants(monkeypatch):
    """The decision reads ADMIT: moving the threshold moves the call."""
    x = _x(300, D=64)
    call = make_attn_call(x, x, x, causal=True, window=100)     # visible fraction ~0.28
    frac = cpu_masked.visible_fraction(call)
    assert 0.25 < frac < 0.35
    for mid in (300 * 300, 300 * 300 - 1):                    # the mid or the long regime
        for f, refused in ((frac + 0.01, True), (frac - 0.01, False)):
            other = {torch.float32: 1.0 if refused else 0.0}
            fs = ({torch.float32: f}, other) if mid == 300 * 300 else (other, {torch.float32: f})
            monkeypatch.setattr(cpu_masked, "ADMIT", cpu_masked.Admit(300 * 300 - 1, mid, *fs, 0.0))
            assert bool(cpu_masked.PATH.reasons(call)) == refused
    monkeypatch.setattr(cpu_masked, "ADMIT", cpu_masked.Admit(300 * 300, 0, {torch.float32: 1.0},
                                                              {torch.float32: 1.0}, 1.0))
    assert not cpu_masked.PATH.reasons(call)


def _cases(H, Hkv, Lq, Lk):
    g = torch.Generator().manual_seed(5)
    pad = torch.zeros(3, Lk, dtype=torch.bool)
    pad[1] = True                                             # a batch entry that sees no key at all
    pad[2, Lk // 2:] = True
    lay = torch.rand(H, -(-Lq // 16), -(-Lk // 16), generator=g) < 0.5
    lay[:, 1] = False                                         # a block row of queries that sees nothing
    return {
        # Lq > Lk, bottom-right: the first Lq - Lk rows see no key
        "causal Lq>Lk": dict(causal=True),
        "window (2, 1) Lq>Lk": dict(window=(2, 1)),
        "padding, causal": dict(causal=True, key_padding_mask=pad),
        "per-head layout + window + padding": dict(layout=BlockLayout(lay, 16), window=(20, 3), key_padding_mask=pad),
    }


CASE_NAMES = list(_cases(4, 2, 50, 37))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_oracle_with_rows_that_see_no_key(case, dtype):
    """Output, lse (-inf exactly where the oracle's is, output 0 there) and gradients, with and
    without an lse gradient, against the float64 oracle."""
    B, H, Hkv, Lq, Lk, D = 3, 4, 2, 50, 37, 16
    kw = _cases(H, Hkv, Lq, Lk)[case]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, L, D, generator=g).to(dtype) for h, L in ((H, Lq), (Hkv, Lk), (Hkv, Lk)))
    call = make_attn_call(q, k, v, return_lse=True, **kw)
    assert cpu_masked.PATH.reasons(call) == []
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = cpu_masked.PATH.run(make_attn_call(*leaves, return_lse=True, **kw))
    ref, ref_lse = naive_attention(*ref_leaves, **kw)
    empty = torch.isneginf(ref_lse)
    assert empty.any() and not empty.all()
    assert torch.equal(torch.isneginf(lse), empty) and bool((out[empty] == 0).all())
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=tol, rtol=tol)
    gen = torch.Generator().manual_seed(2)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    gl = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(empty, 0.0)
    for with_lse in (False, True):
        def loss(o, l, gl=gl):
            finite = l.masked_fill(torch.isinf(l), 0.0)
            return (o.double() * go).sum() + ((finite.double() * gl).sum() if with_lse else 0.0)
        out, lse = cpu_masked.PATH.run(make_attn_call(*leaves, return_lse=True, **kw))
        got = torch.autograd.grad(loss(out, lse), leaves)
        ref, ref_lse = naive_attention(*ref_leaves, **kw)
        want = torch.autograd.grad(loss(ref, ref_lse), ref_leaves)
        for name, a, b in zip("qkv", got, want):
            assert not a.isnan().any(), name
            torch.testing.assert_close(a.double(), b, atol=tol * 3, rtol=tol * 3, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_poison_in_keys_no_query_sees_per_head_layout_gqa(poison):
    """Keys unseen by every query head of one kv head (a per-head layout, GQA) and padded keys hold
    NaN / inf: out, lse and gradients equal the finite call's bitwise, the poisoned keys' gradients
    are 0. (The regression test of every row, tests/contract/test_fuzz_regressions.py, covers a shared layout,
    a window and padding.)"""
    B, H, Hkv, L, D = 2, 4, 2, 48, 8
    g = torch.Generator().manual_seed(3)
    lay = torch.ones(H, 3, 3, dtype=torch.bool)
    lay[0:2, :, 1] = False                 # kv head 0: key block 1 (keys 16..31) seen by neither query head
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 40:] = True
    kw = dict(layout=BlockLayout(lay, 16), key_padding_mask=pad, return_lse=True)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    bad = torch.zeros(B, Hkv, L, dtype=torch.bool)
    bad[:, 0, 20] = True
    bad[1, :, 44] = True
    kp, vp = k.clone(), v.clone()
    kp[bad], vp[bad] = poison, poison
    res = []
    for kk, vv in ((k, v), (kp, vp)):
        leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
        out, lse = cpu_masked.PATH.run(make_attn_call(*leaves, **kw))
        res.append((out, lse, torch.autograd.grad(out.sum() + lse.sum(), leaves)))
    (o0, l0, g0), (o1, l1, g1) = res
    assert not o1.isnan().any() and torch.equal(o0, o1) and torch.equal(l0, l1)
    assert torch.equal(g0[0], g1[0])
    for a, b in zip(g0[1:], g1[1:]):
        assert not b.isnan().any() and torch.equal(a[~bad], b[~bad]) and bool((b[bad] == 0).all())


def test_the_mask_memory_is_bounded(monkeypatch):
    """Past MASK_BUDGET entries (counting batch entries with key padding) the row refuses, saying so;
    explain gives the mask's size."""
    y = torch.zeros(1, 8, 1024, 64)
    ex = effattn.explain(y, y, y, causal=True, window=256)
    assert f"mask materialized (1048576 entries, 4.0 MiB; at most {cpu_masked.MASK_BUDGET})" in ex.paths["torch"], \
        str(ex)
    x = torch.zeros(4, 2, 100, 8)
    pad = torch.zeros(4, 100, dtype=torch.bool)
    monkeypatch.setattr(cpu_masked, "MASK_BUDGET", 4 * 100 * 100 - 1)
    assert not cpu_masked.PATH.reasons(make_attn_call(x, x, x, causal=True, window=3))
    why = cpu_masked.PATH.reasons(make_attn_call(x, x, x, causal=True, key_padding_mask=pad))
    assert why == [f"the mask would hold 40000 entries > {4 * 100 * 100 - 1} (memory)"]
    assert effattn.explain(x, x, x, causal=True, key_padding_mask=pad).chosen_path == "torch/cpu-blocks"
    ex = effattn.explain(x, x, x, key_padding_mask=pad)      # key padding alone: a (B, 1, 1, Lk) mask
    assert ex.chosen_path == ROW and f"(400 entries, 0.0 MiB; at most {4 * 100 * 100 - 1})" in ex.paths["torch"]


def test_dispatch_at_the_issue_lengths():
    """Issue 25's measurement (B=1, H=8, D=64, fp32): at L = 1024 a causal window of 256 (visible
    0.22) and the fixed layout (0.34) take the masked kernel; at L = 2048 (0.12, 0.20) the blocks path."""
    from effattn import layouts
    for L, row in ((1024, ROW), (2048, "torch/cpu-blocks")):
        x = torch.zeros(1, 8, L, 64)
        # the benchmarks' "fixed" pattern (benchmarks/registry.py)
        fixed = layouts.sliding_and_summary(L, 128, local_blocks=4, every=16)
        for kw in (dict(layout=fixed), dict(window=256)):
            ex = effattn.explain(x, x, x, causal=True, **kw)
            assert ex.chosen_path == row, str(ex)



@pytest.mark.parametrize("row", ["torch/cpu-flash", ROW])
def test_head_dim_stride_two(row):
    """torch's kernel reads a head dim with stride != 1 wrongly (errors of order 1, found by the fuzz
    on this row; torch/cpu-flash had it too): both rows pass it views of stride 1 along the head dim.
    Output and gradients equal the contiguous call's."""
    from effattn.backends import base
    path = next(p for p in base.rows("attention") if p.name == row)
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)[..., ::2].requires_grad_() for _ in range(3)]
    xc = [t.detach().contiguous().requires_grad_() for t in x]
    kw = dict(causal=True) if row == "torch/cpu-flash" else dict(causal=True, window=2)
    a, b = path.run(make_attn_call(*x, **kw))[0], path.run(make_attn_call(*xc, **kw))[0]
    assert torch.equal(a, b)
    torch.testing.assert_close(a, naive_attention(*xc, **kw)[0], atol=1e-12, rtol=1e-12)
    for ga, gb in zip(torch.autograd.grad(a.sum(), x), torch.autograd.grad(b.sum(), xc)):
        assert torch.equal(ga, gb)


def _child(q, k, v):
    x = effattn.explain(q, k, v, causal=True, window=5)
    return effattn.attention(q, k, v, causal=True, window=5), x.chosen_path, x.row(ROW).reasons


def test_a_forked_child_takes_the_blocks_path():
    """torch's OpenMP kernel hangs in a process forked after it ran on several threads (torch/cpu-flash
    too); in such a child the row refuses, explain says why, and the call completes."""
    import multiprocessing as mp
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=g) for _ in range(3))
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = effattn.attention(q, k, v, causal=True, window=5)          # the kernel runs here
        assert effattn.explain(q, k, v, causal=True, window=5).chosen_path == ROW
        with mp.get_context("fork").Pool(1) as pool:
            got, path, why = pool.apply_async(_child, (q, k, v)).get(timeout=120)
    finally:
        torch.set_num_threads(prev)
    assert path == "torch/cpu-blocks" and any("forked process" in w for w in why), why
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("row,kw", [
    ("torch/cpu-flash", dict(causal=True)),
    (ROW, dict(causal=True, window=5)),
    ("torch/cpu-blocks", dict(causal=True, window=5)),
], ids=["flash", "sdpa-mask", "blocks"])
@pytest.mark.parametrize("grads", ["out", "lse", "both"])
def test_eager_calls_skip_the_ops_bitwise(row, kw, grads, monkeypatch):
    """Eager calls on plain tensors run the CPU rows' op bodies directly (autograd.eager_op_pair):
    forward, lse and gradients bitwise those of the torch.library ops, with a gradient of out only,
    of lse only (out's gradient is None then) or both."""
    from effattn.backends import autograd
    if row == "torch/cpu-blocks":
        monkeypatch.setattr(cpu_masked, "ENABLED", False)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    go, gl = torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64), torch.randn(2, 4, 40, generator=g,
                                                                                     dtype=torch.float64)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        assert effattn.explain(*leaves, **kw).chosen_path == row
        out, lse = effattn.attention(*leaves, return_lse=True, **kw)
        loss = {"out": (out * go).sum(), "lse": (lse * gl).sum(), "both": (out * go).sum() + (lse * gl).sum()}[grads]
        return out.grad_fn.name(), [out, lse, *torch.autograd.grad(loss, leaves)]

    eager_fn, eager = run()
    monkeypatch.setattr(autograd, "direct", lambda *tensors: False)
    op_fn, ops = run()
    assert eager_fn == "EagerBackward" and op_fn != eager_fn, (eager_fn, op_fn)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], eager, ops):
        assert torch.equal(a, b), name
    with torch.no_grad():                                    # a forward without autograd: the body itself
        assert effattn.attention(q, k, v, **kw).grad_fn is None


def test_kernel_backward_exact_reads_finite_lse_only():
    """The kernel's backward takes a call unless a finite |lse| passes 2**-10 / eps; rows that see no
    key (lse -inf) do not count, whichever reduction finds that out."""
    from effattn.backends.torch.attention.cpu_flash import kernel_backward_exact
    bound = 2.0 ** -10 / torch.finfo(torch.float32).eps          # 8192
    lse = torch.tensor([[1.0, -3.0, 100.0]])
    assert kernel_backward_exact(lse) and kernel_backward_exact(lse[:, :0])
    assert kernel_backward_exact(torch.tensor([bound, -bound]))
    assert not kernel_backward_exact(torch.tensor([1.0, 2 * bound]))
    assert kernel_backward_exact(torch.tensor([1.0, -math.inf, -math.inf]))
    assert kernel_backward_exact(torch.full((4,), -math.inf))
    assert not kernel_backward_exact(torch.tensor([-math.inf, -2 * bound]))
    assert not kernel_backward_exact(torch.tensor([-math.inf, 2 * bound], dtype=torch.float64) * 2 ** 29)


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_masks_are_kept_for_the_same_tensor_only(causal):
    """The masks of the last key padding tensor are reused by the next call with that tensor, and
    built again when it was changed in place (the oracle follows the change) or is another tensor;
    one entry is kept."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, 30, dtype=torch.bool)
    pad[:, 20:] = True
    args = (q, k, None, 0, pad, -1, 0 if causal else -1)
    first = cpu_masked._masks(*args)
    assert cpu_masked._masks(*args) is first and cpu_masked._LAST_PADDING[0][0]() is pad
    assert cpu_masked.visible_fraction(make_attn_call(q, k, v, key_padding_mask=pad)) == pytest.approx(20 / 30)
    pad[1, 5:] = True                                           # in place: built again
    assert cpu_masked._masks(*args) is not first
    assert cpu_masked.visible_fraction(make_attn_call(q, k, v, key_padding_mask=pad)) == pytest.approx(12.5 / 30)
    assert effattn.explain(q, k, v, key_padding_mask=pad, causal=causal).chosen_path == ROW
    out = effattn.attention(q, k, v, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(out, naive_attention(q, k, v, key_padding_mask=pad, causal=causal)[0])
    other = pad.clone()
    assert cpu_masked._masks(q, k, None, 0, other, -1, 0 if causal else -1) is not cpu_masked._masks(*args)


def test_dropout_never_takes_torchs_kernel():
    """torch's CPU kernel has no dropout of effattn's (reproducible, position-keyed) kind: calls with
    dropout_p > 0 go to the reference, and explain says why the fused rows do not take them."""
    x = _x(64)
    ex = effattn.explain(x, x, x, causal=True, window=8, dropout_p=0.1)
    assert ex.chosen_path == "torch/reference", str(ex)
    for row in (ROW, "torch/cpu-flash", "torch/cpu-blocks"):
        assert any("dropout" in w for w in ex.row(row).reasons), (row, ex.row(row).reasons)


def _skipped_padding(B=3, Lk=40, seed=6):
    """Key padding the row skips: entry 0 keeps 30 scattered keys, entry 1 none, entry 2 the first 20
    (at most 30 kept of 40: 10 skipped, past COMPACT's thresholds)."""
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(B, Lk, dtype=torch.bool)
    pad[0, torch.randperm(Lk, generator=g)[:10]] = True
    pad[1] = True
    pad[2, 20:] = True
    return pad


def _layout():
    lay = torch.rand(4, 3, 5, generator=torch.Generator().manual_seed(7)) < 0.6
    lay[:, :, 1] = False                        # keys 8..15: seen by no query head
    return lay


SKIP_CASES = {
    "padding": dict(),
    "padding, causal": dict(causal=True),
    "padding, window (6, 2)": dict(window=(6, 2)),
    "padding, per-head layout": dict(layout=BlockLayout(_layout(), 8)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_skipped_padding_against_the_oracle(case, dtype, monkeypatch):
    """Key padding skipped (K and V gathered at the kept keys, gradients spread back; slots past an
    entry's keys zeroed): output, lse and gradients (with and without an lse gradient, through torch's
    autograd node and through the op pair) against the float64 oracle, the padded keys poisoned with
    NaN; their gradients are exactly 0."""
    B, H, Hkv, Lq, Lk, D = 3, 4, 2, 24, 40, 16
    monkeypatch.setattr(cpu_masked, "COMPACT", cpu_masked.Compact(pairs_per_key=6))   # 10 * 24 >= 6 * 40
    pad = _skipped_padding(B, Lk)
    kw = dict(key_padding_mask=pad, **SKIP_CASES[case])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, Lq if h == H else Lk, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    # poisoned: the padded keys, and the kept keys no query sees (a window's first keys, a layout's)
    rule = {n: x for n, x in kw.items() if n != "key_padding_mask"}
    vis = Rule.of(Lq, Lk, **rule).materialize(key_padding_mask=pad)
    unseen = pad if vis is None else ~vis.any(2).any(1)
    assert case in ("padding", "padding, causal") or bool((unseen & ~pad).any())
    k, v = (x.masked_fill(unseen[:, None, :, None], float("nan")) for x in (k, v))
    call = make_attn_call(q, k, v, **kw)
    assert cpu_masked.PATH.reasons(call) == [] and cpu_masked.read_keys(call) == 30
    m = cpu_masked._masks(q, k, *call.op_args()[3:6], call.rule.left, call.rule.right)
    assert m.keys is not None and m.keys.shape == (B, 30) and m.fill is not None
    assert "the 30 of 40 keys" in effattn.explain(q, k, v, **kw).paths["torch"]
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    clean = [x.masked_fill(unseen[:, None, :, None], 0.0).double().requires_grad_() if x is not q
             else x.double().requires_grad_() for x in (q, k, v)]
    gen = torch.Generator().manual_seed(2)
    for return_lse in (False, True):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        got = effattn.attention(*leaves, return_lse=return_lse, **kw)
        out, lse = got if return_lse else (got, None)
        ref, ref_lse = naive_attention(*clean, **kw)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        go = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        loss, ref_loss = (out.double() * go).sum(), (ref * go).sum()
        if return_lse:
            empty = torch.isneginf(ref_lse)
            assert torch.equal(torch.isneginf(lse), empty) and bool((out[empty] == 0).all())
            gl = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(empty, 0.0)
            loss = loss + (lse.masked_fill(empty, 0.0).double() * gl).sum()
            ref_loss = ref_loss + (ref_lse.masked_fill(empty, 0.0) * gl).sum()
        grads = torch.autograd.grad(loss, leaves)
        want = torch.autograd.grad(ref_loss, clean)
        for name, a, b in zip("qkv", grads, want):
            assert not a.isnan().any(), name
            torch.testing.assert_close(a.double(), b, atol=tol * 3, rtol=tol * 3, msg=lambda s: f"d{name}: {s}")
        for a in grads[1:]:
            assert bool((a.masked_select(unseen[:, None, :, None].expand(a.shape)) == 0).all())


def test_skipped_padding_one_key_set_and_the_threshold(monkeypatch):
    """A batch whose entries keep the same keys reads them with one index (no slots to zero), the
    output equals the call on the kept keys alone; the rule skips from COMPACT.pairs_per_key skipped
    pairs per key (here 22 padded keys of 64 with 64 queries: 22 per key), and explain says so."""
    B, H, L, D = 2, 2, 64, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    keep = torch.tensor([i % 3 != 0 for i in range(L)])
    pads = [(~keep)[None].expand(B, L).clone() for _ in range(3)]      # one tensor per rule (masks are per tensor)
    for pad, per_key, skips in zip(pads, (22, 23, 16), (True, False, True)):
        monkeypatch.setattr(cpu_masked, "COMPACT", cpu_masked.Compact(pairs_per_key=per_key))
        m = cpu_masked._masks(q, k, None, 0, pad, -1, -1)
        assert (m.keys is not None) == skips, per_key
        assert ("the 42 of 64 keys" in effattn.explain(q, k, v, key_padding_mask=pad).paths["torch"]) == skips
        if skips:
            assert m.keys.dim() == 1 and m.fill is None and m.add is None and m.unseen is None
        out = effattn.attention(q, k, v, key_padding_mask=pad)
        torch.testing.assert_close(out, effattn.attention(q, k[:, :, keep], v[:, :, keep]), atol=1e-6, rtol=1e-6)


def test_padding_everywhere_is_not_skipped():
    """Every key of every entry padded: nothing to gather (no empty key range reaches the kernel);
    every row sees no key: output 0, lse -inf, gradients 0, as the oracle."""
    q, k, v = (torch.randn(2, 2, 32, 8, generator=torch.Generator().manual_seed(9)).requires_grad_() for _ in range(3))
    pad = torch.ones(2, 32, dtype=torch.bool)
    assert cpu_masked.read_keys(make_attn_call(q, k, v, key_padding_mask=pad)) == 32
    out, lse = effattn.attention(q, k, v, key_padding_mask=pad, return_lse=True)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(bool((g == 0).all()) for g in grads)

