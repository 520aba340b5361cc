"""The torch backend's CPU paths (backends/torch/attention/cpu_flash.py, cpu_blocks.py,
backends/torch/linear/cpu_slices.py, threads.py): which path a
call takes and that explain says so; the chunked reference, which the fused paths now shadow on CPU,
still checked against the oracle; results independent of the thread count.

test_attention.py runs every case through backend="torch", i.e. through the fused paths on CPU.
"""
import pytest
import torch

import effattn
from effattn.backends.torch.attention import cpu_blocks, cpu_masked
from effattn.layouts import BlockLayout
from effattn.testing.oracle import naive_attention
from tests.core.test_attention import CASES, check_against_oracle, extra_peak_bytes_16k, make_inputs

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                                reason="this torch has no flash CPU kernel")


def qkv(H=4, Hkv=4, Lq=40, Lk=40, D=16, Dv=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, H, Lq, D, generator=g), torch.randn(1, Hkv, Lk, D, generator=g),
            torch.randn(1, Hkv, Lk, Dv, generator=g))


PATHS = {
    "dense": (dict(), {}, "flash"),
    "causal": (dict(), dict(causal=True), "flash"),
    "gqa-causal": (dict(Hkv=2), dict(causal=True), "flash"),
    "noncausal-Lq<Lk": (dict(Lq=9), {}, "flash"),
    "causal-Lq<Lk": (dict(Lq=9), dict(causal=True), "masked"),
    "window": (dict(), dict(causal=True, window=8), "masked"),
    "layout": (dict(), dict(layout=BlockLayout(~torch.eye(3, dtype=torch.bool)[None].flip(2), 16)), "masked"),
    # a layout that cuts no pair of the call: the plain (causal) call
    "layout, cuts nothing": (dict(), dict(layout=BlockLayout(torch.ones(1, 3, 3, dtype=torch.bool), 16)), "flash"),
    "layout, cuts nothing causal": (dict(), dict(causal=True, layout=BlockLayout(
        torch.tril(torch.ones(3, 3, dtype=torch.bool)), 16)), "flash"),
    "padding": (dict(), dict(key_padding_mask=torch.zeros(1, 40, dtype=torch.bool)), "masked"),
    "window-long": (dict(Lq=600, Lk=600), dict(causal=True, window=8), "blocks"),
    "dv!=d": (dict(Dv=8), {}, "blocks"),
    "dropout": (dict(), dict(dropout_p=0.1), "reference"),
}
ROW = {"flash": "torch/cpu-flash", "masked": "torch/cpu-sdpa-mask", "blocks": "torch/cpu-blocks",
       "reference": "torch/reference"}
# why the faster CPU rows leave the call (on their lines in explain)
WHY_NOT = {"causal-Lq<Lk": ("torch/cpu-flash", "causal with Lq != Lk"),
           "window": ("torch/cpu-flash", "does not support window"),
           "layout": ("torch/cpu-flash", "a layout that cuts pairs"),
           "padding": ("torch/cpu-flash", "does not support key_padding_mask"),
           "window-long": ("torch/cpu-sdpa-mask", "the blocks path is faster there"),
           "dv!=d": ("torch/cpu-flash", "does not support dv_ne_d"),
           "dropout": ("torch/cpu-blocks", "does not support dropout")}


@pytest.mark.parametrize("name", list(PATHS))
def test_explain_reports_the_cpu_path(name):
    shape, kwargs, path = PATHS[name]
    q, k, v = qkv(**shape)
    ex = effattn.explain(q, k, v, **kwargs)
    assert ex.chosen == "torch" and ex.chosen_path == ROW[path], str(ex)
    assert ex.paths["torch"].startswith(ROW[path]) and f"picks {ROW[path]}" in str(ex)
    assert ex.can_serve(ROW[path]) and ex.can_serve("torch/reference")
    if name in WHY_NOT:
        row, why = WHY_NOT[name]
        assert any(why in r for r in ex.row(row).reasons), ex.row(row)


def test_flash_path_is_torchs_kernel_bottom_right_where_it_can():
    """Causal Lq != Lk would be top-left in the flash kernel: effattn keeps bottom-right (q0 sees 32 keys)."""
    q, k, v = qkv(Lq=8)
    out = effattn.attention(q, k, v, causal=True)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (top_left - out).abs().max() > 1e-2                      # the two conventions differ here


@pytest.mark.parametrize("case_id", list(CASES))
def test_chunked_reference_still_matches_oracle(case_id, monkeypatch):
    """With the fused paths off, backend="torch" is the chunked reference: fwd, lse and gradients."""
    monkeypatch.setattr(cpu_blocks, "ENABLED", False)
    dtype = torch.float32
    q, k, v, kwargs = make_inputs(CASES[case_id], dtype)
    ex = effattn.explain(q, k, v, **kwargs)
    assert ex.chosen_path == "torch/reference"
    assert all(ex.row(r).reasons for r in ("torch/cpu-flash", "torch/cpu-blocks"))
    if not kwargs.get("dropout_p"):
        assert "fused CPU paths turned off (cpu_blocks.ENABLED is False)" in ex.row("torch/cpu-blocks").reasons
    check_against_oracle(q, k, v, kwargs, dtype, "torch")


def _with_threads(n, fn):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("op,masked", [(op, m) for op in ("window-gqa", "layout-perhead", "padding-batch")
                                       for m in (True, False)] + [("linear", False)])
def test_results_do_not_depend_on_the_thread_count(op, masked, monkeypatch):
    """The slice-parallel paths (and torch's kernel with a mask, which takes these short calls
    first) give bitwise the same outputs and gradients at 1 and 2 threads."""
    monkeypatch.setattr(cpu_masked, "ENABLED", masked)          # off: the blocks path takes them
    g = torch.Generator().manual_seed(3)
    B = 3 if op == "padding-batch" else 1
    q = torch.randn(B, 4, 150, 16, generator=g)
    k, v = (torch.randn(B, 2 if op != "layout-perhead" else 4, 150, 16, generator=g) for _ in range(2))
    kw = {"window-gqa": dict(causal=True, window=40),
          "layout-perhead": dict(layout=BlockLayout(torch.rand(4, 10, 10, generator=g) < 0.5, 16)),
          "padding-batch": dict(key_padding_mask=torch.rand(B, 150, generator=g) < 0.3)}.get(op, {})

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if op == "linear":
            out = effattn.linear_attention(*leaves, causal=True)
        else:
            out = effattn.attention(*leaves, **kw)
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    one, two = _with_threads(1, run), _with_threads(2, run)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_linear_cpu_path_reports_and_keeps_parameter_gradients():
    """Named feature maps take the slice-parallel path (causal calls without a state take the
    chunked batched ops first: test_cpu_chunks.py); a callable with parameters stays on the
    reference so that its parameters get gradients."""
    q, k, v = qkv()
    two = _with_threads(2, lambda: effattn.explain(q, k, v, op="linear_attention", causal=False))
    assert two.chosen_path == "torch/linear-cpu-slices" and "in parallel" in two.paths["torch"]
    one = _with_threads(1, lambda: effattn.explain(q, k, v, op="linear_attention", causal=False))
    assert one.chosen_path == "torch/linear-chunked"
    assert "one thread" in one.row("torch/linear-cpu-slices").reasons[0]
    lin = torch.nn.Linear(16, 8)
    phi = lambda x: torch.nn.functional.elu(lin(x)) + 1  # noqa: E731
    ex = effattn.explain(q, k, v, op="linear_attention", feature_map=phi)
    assert ex.chosen_path == "torch/linear-chunked"
    assert "does not support feature_map=callable" in ex.row("torch/linear-cpu-slices").reasons
    effattn.linear_attention(q, k, v, feature_map=phi).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_blocks_path_memory_is_bounded_at_16k():
    """A causal window of 256 at B=1, H=8, L=16384, D=64 fp32, forward + backward, in a fresh process:
    the extra peak memory stays far below the 8.6 GB of a score matrix (the inputs, outputs and
    gradients themselves are 6 x 32 MiB)."""
    extra = extra_peak_bytes_16k("causal=True, window=256")
    assert extra < 512 << 20, f"extra peak memory {extra / 2**20:.0f} MiB >= 512 MiB"


def test_slice_pool_works_in_a_forked_child(monkeypatch):
    """A process forked after the pool started (a DataLoader worker) gets its own pool, not a hang."""
    import multiprocessing as mp
    monkeypatch.setattr(cpu_masked, "ENABLED", False)           # the blocks path in both processes
    q, k, v = qkv()
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = effattn.attention(q, k, v, causal=True, window=5)          # starts the pool here
        ctx = mp.get_context("fork")
        with ctx.Pool(1) as pool:
            got = pool.apply_async(_window_call, (q, k, v)).get(timeout=120)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(got, want)


def _window_call(q, k, v):
    torch.set_num_threads(2)
    return effattn.attention(q, k, v, causal=True, window=5)


# ------------------------------------------------------------------ causal calls in query blocks

def _split_call(B, H, Hkv, L, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv)]


@pytest.mark.parametrize("L", [256, 301])
@pytest.mark.parametrize("lse_grad", [False, True])
def test_causal_in_query_blocks_against_the_oracle(L, lse_grad):
    """Float32 causal calls from SPLIT.min_len run in query blocks (each against the keys up to its
    end): output, lse and gradients against the float64 oracle, GQA, L not a multiple of the blocks;
    explain says so."""
    from effattn.backends.torch.attention import cpu_flash
    q, k, v = _split_call(2, 4, 2, L, 16)
    blocks = cpu_flash._blocks(q, k, True)
    assert blocks is not None and len(blocks) == cpu_flash.SPLIT.pieces and blocks[-1][1] == L
    ex = effattn.explain(q, k, v, causal=True)
    assert ex.chosen_path == "torch/cpu-flash" and "query blocks" in ex.paths["torch"], str(ex)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = effattn.attention(*leaves, causal=True, return_lse=True)
    assert out.stride() == q.new_empty(2, L, 4, 16).transpose(1, 2).stride()      # as the kernel (and the fake) lay it out
    ref, ref_lse = naive_attention(*refs, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    g = torch.Generator().manual_seed(1)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    loss = lambda o, l: (o * go.to(o.dtype)).sum() + ((l * gl.to(l.dtype)).sum() if lse_grad else 0)  # noqa: E731
    got = torch.autograd.grad(loss(out, lse), leaves)
    want = torch.autograd.grad(loss(ref, ref_lse), refs)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_causal_query_blocks_eager_bitwise_the_ops_and_reproducible(monkeypatch):
    """The eager call (no Python op dispatch) and the torch.library ops give the same bits, forward
    and backward, and a repeated backward the same bits (the blocks' dK, dV summed in a fixed order);
    a gradient of out only goes through the op pair's autograd, not the kernel's own node."""
    from effattn.backends import autograd
    q, k, v = _split_call(1, 2, 2, 256, 8, seed=4)
    go = torch.randn(1, 2, 256, 8, generator=torch.Generator().manual_seed(5))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, causal=True)
        return out.grad_fn.name(), [out, *torch.autograd.grad(out, leaves, go)]

    name, eager = run()
    assert name == "EagerBackward"
    assert all(torch.equal(a, b) for a, b in zip(eager, run()[1]))
    monkeypatch.setattr(autograd, "direct", lambda *tensors: False)
    op_name, ops = run()
    assert op_name != name
    for what, a, b in zip(["out", "dq", "dk", "dv"], eager, ops):
        assert torch.equal(a, b), what


def test_causal_query_blocks_follow_the_rule(monkeypatch):
    """The cut applies from SPLIT.min_len to SPLIT.max_len, to float32 causal self-attention only;
    setting SPLIT moves it (and is a new dispatch plan)."""
    from effattn import plans
    from effattn.backends.torch.attention import cpu_flash
    s = cpu_flash.SPLIT
    x = lambda L, dtype=torch.float32: torch.zeros(1, 1, L, 8, dtype=dtype)  # noqa: E731
    assert cpu_flash._blocks(x(s.min_len - 1), x(s.min_len - 1), True) is None
    assert cpu_flash._blocks(x(s.min_len), x(s.min_len), True) is not None
    assert cpu_flash._blocks(x(s.max_len), x(s.max_len), True) is not None
    assert cpu_flash._blocks(x(s.max_len + 1), x(s.max_len + 1), True) is None
    assert cpu_flash._blocks(x(s.min_len), x(s.min_len), False) is None
    assert cpu_flash._blocks(x(s.min_len, torch.float64), x(s.min_len, torch.float64), True) is None
    q, k, v = _split_call(1, 2, 2, s.min_len, 8)
    effattn.attention(q, k, v, causal=True)
    n = len(plans._PLANS)
    monkeypatch.setattr(cpu_flash, "SPLIT", s._replace(min_len=s.min_len + 1))
    assert "query blocks" not in effattn.explain(q, k, v, causal=True).paths["torch"]
    effattn.attention(q, k, v, causal=True)
    assert len(plans._PLANS) == n + 1                      # judged again under the new rule


def test_a_layout_that_cuts_nothing_runs_the_plain_call():
    """A layout keeping every tile the causal mask reaches (here: lower-triangular blocks, the last one
    partial) is the plain causal call: the flash row takes it, against the oracle with the layout,
    forward and backward; one head's tile dropped and it cuts pairs again."""
    from effattn._call import make_attn_call
    from effattn.backends.torch.attention import cpu_flash
    L, bs = 300, 64                                           # 5 blocks, the last one partial (L = 128..1024: query blocks too)
    lay = torch.tril(torch.ones(2, 5, 5, dtype=torch.bool))
    q, k, v = (t.requires_grad_() for t in qkv(H=2, Hkv=2, Lq=L, Lk=L))
    kw = dict(causal=True, layout=BlockLayout(lay, bs))
    assert effattn.explain(q, k, v, **kw).chosen_path == "torch/cpu-flash"
    out = effattn.attention(q, k, v, **kw)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*refs, **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, refs, go.double())):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)
    cut = lay.clone()
    cut[1, 3, 0] = False                                      # head 1, query block 3 no longer sees key block 0
    call = make_attn_call(q, k, v, causal=True, layout=BlockLayout(cut, bs))
    assert not cpu_flash.layout_cuts_nothing(call)
    assert effattn.explain(q, k, v, causal=True, layout=BlockLayout(cut, bs)).chosen_path != "torch/cpu-flash"
