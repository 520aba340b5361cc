"""LSH attention on the CUDA C++ kernels through the emulation, at small shapes:

- the kernels' per-row positions (``attention_fwd_pos`` / ``attention_bwd_pos``: key j hidden where its position is
  -1 or, causal, later than query i's; a query's own position scores the constant SELF_SCORE with no gradient to
  q or k) against a float64 reference of that rule written here, forward and backward (the lse's gradient
  included), with the LSH chunk layout (64-row forward) and without a layout (128-row forward), D 32 and 64, fp16
  and bf16; the backward is the two passes (the fused backward refuses positions);
- the row ``cuda/lsh`` against the float64 ``torch/lsh`` given the same buckets, forward and gradients;
- its backward bitwise repeatable across the emulator's schedules; explain.
"""
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda.attention.tiling import layout_lists
from effattn.backends.cuda.lsh import layout_mask
from effattn.lsh import SELF_SCORE, lsh_hash
from effattn.testing.oracle import positions_reference
from tests.conftest import EMU_DEFAULT_SCHEDULE

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def close(got, want, tol, what):
    err = (got.double() - want).abs().max().item()
    bound = tol * max(1.0, want.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def positions(B, H, L, g, pad):
    """Query positions a permutation per (b, h); key positions another one (self matches off the diagonal),
    with a fraction `pad` of keys padding (-1). (b, h) = (0, 0) keeps one key, at query 5's position (query 5
    sees only itself); (1, 1) has only padding keys (its rows see nothing)."""
    qp = torch.stack([torch.randperm(L, generator=g) for _ in range(B * H)]).view(B, H, L)
    kp = torch.stack([torch.randperm(L, generator=g) for _ in range(B * H)]).view(B, H, L)
    kp = kp.masked_fill(torch.rand(B, H, L, generator=g) < pad, -1)
    kp[0, 0] = -1
    kp[0, 0, 5] = qp[0, 0, 5]
    kp[1, 1] = -1
    return qp.to(torch.int32), kp.to(torch.int32)


def run_kernels(ops, q, k, v, qp, kp, mask, block, causal, scale, dout, dlse, fused=False):
    lists, wf, check = layout_lists(q, k, v, mask, block, -1, -1, by_key=False)
    klists, kwf, _ = layout_lists(q, k, v, mask, block, -1, -1, by_key=True)
    out, lse = ops.attention_fwd_pos(q, k, v, None, mask, block, check, lists, wf, None, scale, 0.0, qp, kp, causal,
                                     SELF_SCORE, out_fp32=True)
    grads = ops.attention_bwd_pos(dout, dlse, q, k, v, out, lse, None, mask, block, check, lists, wf, klists, kwf,
                                  None, scale, 0.0, qp, kp, causal, SELF_SCORE, fused=fused)
    return out, lse, grads


KERNEL_CASES = {   # id -> (D, layout chunk or None, causal)
    "layout-cl32-causal-d48": (48, 32, True),
    "layout-cl64-d64": (64, 64, False),
    "layout-cl128-causal-d64": (64, 128, True),    # 128-row forward tiles (csrc/attention/fwd.cuh fwd_layout_wide)
    "nolayout-causal-d64": (64, None, True),
    "nolayout-d96": (96, None, False),
}


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case_id", list(KERNEL_CASES))
def test_positions_against_float64(emulation, case_id, dtype):
    D, chunk, causal = KERNEL_CASES[case_id]
    dt = DTYPES[dtype]
    B, H, L = 2, 2, 128
    g = torch.Generator().manual_seed(D + L + (chunk or 0) + causal)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(dt) for _ in range(3))
    qp, kp = positions(B, H, L, g, 0.2)
    mask = None
    if chunk is not None:
        mask = layout_mask(L, chunk, [0, L // chunk - 1], "cpu")           # each chunk and the one before
    scale = 0.3
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = positions_reference(q64, k64, v64, mask, chunk or 1, qp, kp, causal, scale)
    assert torch.isinf(lse_ref).any() and lse_ref[0, 0, 5] == SELF_SCORE    # empty rows and a self-only row
    dout = torch.randn(B, H, L, D, generator=g)
    dlse = torch.randn(B, H, L, generator=g).masked_fill(torch.isinf(lse_ref.detach()), 0.0)
    out, lse, (dq, dk, dv) = run_kernels(emulation, q, k, v, qp, kp, mask, chunk or 0, causal, scale, dout.to(dt),
                                         dlse)
    tol = TOL[dt]
    close(out, out_ref.detach(), tol, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref.detach()))
    fin = ~torch.isinf(lse)
    close(lse[fin], lse_ref.detach()[fin], tol, "lse")
    want = torch.autograd.grad((out_ref, lse_ref.masked_fill(~fin, 0.0)), (q64, k64, v64),
                               (dout.to(dt).double(), dlse.double()))
    for name, a, b in zip("qkv", (dq, dk, dv), want):
        close(a, b, tol, f"d{name}")


def test_fused_backward_refuses_positions(emulation):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 64, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    qp, kp = positions(2, 2, 64, g, 0.0)
    qp, kp = qp[:1, :1].contiguous(), kp[:1, :1].contiguous()
    with pytest.raises(RuntimeError, match="positions"):
        run_kernels(emulation, q, k, v, qp, kp, None, 0, False, 1.0, torch.zeros_like(q), None, fused=True)


ROW_CASES = [  # (B, H, L, D, n_hashes, chunk_len, before, after, causal, padding)
    (1, 2, 128, 48, 2, 32, 1, 0, False, False),
    (2, 1, 128, 64, 2, 64, 1, 1, True, True),
]


def row_inputs(case):
    B, H, L, D, R, cl, before, after, causal, padded = case
    g = torch.Generator().manual_seed(sum(case[:8]) + causal)
    qk = torch.randn(B, H, L, D, generator=g)
    v = torch.randn(B, H, L, D, generator=g)
    kw = dict(n_hashes=R, chunk_len=cl, chunks_before=before, chunks_after=after, causal=causal,
              buckets=lsh_hash(qk, R, max(2, L // cl), g))
    if padded:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[:, -19:] = True
        kw["key_padding_mask"] = kpm
    return qk, v, kw, torch.randn(B, H, L, D, generator=g)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: "B{}-H{}-L{}-D{}-R{}-cl{}-b{}a{}{}{}".format(
    *c[:8], "-causal" if c[8] else "", "-pad" if c[9] else ""))
def test_row_against_float64_torch_row(case, dtype):
    dt = DTYPES[dtype]
    qk, v, kw, dout = row_inputs(case)
    q16, v16 = qk.to(dt).requires_grad_(), v.to(dt).requires_grad_()
    q64, v64 = q16.detach().double().requires_grad_(), v16.detach().double().requires_grad_()
    out = effattn.lsh_attention(q16, v16, backend="cuda", **kw)
    ref = effattn.lsh_attention(q64, v64, backend="torch", **kw)
    tol = TOL[dt]
    close(out, ref.detach(), tol, "out")
    got = torch.autograd.grad(out, (q16, v16), dout.to(dt))
    want = torch.autograd.grad(ref, (q64, v64), dout.to(dt).double())
    for name, a, b in zip(("dqk", "dv"), got, want):
        close(a, b, tol, name)


def test_backward_bitwise_repeatable_across_schedules(emulation):
    qk, v, kw, dout = row_inputs(ROW_CASES[1])
    results = []
    for schedule in (0, 1, 2, 1):
        emulation.emu_set_schedule(schedule)
        q16, v16 = qk.to(torch.bfloat16).requires_grad_(), v.to(torch.bfloat16).requires_grad_()
        out = effattn.lsh_attention(q16, v16, backend="cuda", **kw)
        results.append([out.detach(), *torch.autograd.grad(out, (q16, v16), dout.to(torch.bfloat16))])
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.bfloat16 else \
                torch.equal(a, b)


def test_explain_names_the_row_and_its_refusals():
    small = torch.randn(1, 1, 64, 32, dtype=torch.bfloat16)                # buckets 64 and 128 only
    assert "head dims 33..128" in "; ".join(effattn.explain(small, None, small, op="lsh_attention", n_hashes=1,
                                                            chunk_len=32).row("cuda/lsh").reasons)
    qk, v = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16), torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    rep = effattn.explain(qk, None, v, op="lsh_attention", n_hashes=2, chunk_len=32)
    row = rep.row("cuda/lsh")
    assert not row.reasons and "chunk layout" in row.detail and "partial tiles read the layout" in row.detail
    assert rep.chosen_path != "cuda/lsh"                                 # on a CPU only when named
    rep = effattn.explain(qk.float(), None, v.float(), op="lsh_attention", n_hashes=2, chunk_len=32, dropout_p=0.1)
    why = "; ".join(rep.row("cuda/lsh").reasons)
    assert "float32" in why and "dropout" in why
    big = torch.randn(1, 1, 64, 160, dtype=torch.bfloat16)
    assert "head dim" in "; ".join(effattn.explain(big, None, big, op="lsh_attention", n_hashes=1,
                                                   chunk_len=32).row("cuda/lsh").reasons)
