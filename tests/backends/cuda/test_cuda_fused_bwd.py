"""The fused backward (csrc/attention/bwd_fused.cuh: dK, dV and dQ in one kernel of 8 warps, five
products per (query tile, key tile) pair, dQ added in key-tile order under a semaphore per query tile)
through the emulation, at small shapes:

- against float64 with several key blocks adding into each query tile (the semaphore's turns), causal
  and sliding windows, GQA, Lq != Lk, Dv != D, key padding with a fully padded batch entry, head-dim
  buckets 32 / 64 / 128, fp16 and bf16; the two-pass kernels (``EFFATTN_CUDA_FUSED_BWD=0``) on the
  same cases;
- bitwise-equal gradients across the emulator's three thread schedules and runs, with dropout;
- five products: the emulated mma count of a backward is 5/7 of the two passes';
- padded keys holding NaN give the gradients of zeros there, bit for bit;
- which backward runs (explain), the fallback under a 99 KB device at head dim 128, the op's refusal of
  a call it does not serve.
Other modules' backward tests (test_cuda_attention.py, test_cuda_packed.py, ...) run the fused kernel
wherever it applies (the emulated device is an H100's).
"""
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda import resources
from effattn.layouts import BlockLayout
from tests.conftest import EMU_DEFAULT_SCHEDULE, random_qkv
from tests.core.test_attention import check_against_oracle

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]

FUSED = "backward: fused dK/dV/dQ kernel"
# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs)
CASES = {
    "dense-three-key-blocks-d64": (1, 2, 2, 70, 300, 64, 64, {}),
    "causal-gqa-lq-lt-lk-d32-dv48": (1, 4, 2, 100, 260, 32, 48, dict(causal=True)),
    "window-d128-dv96": (1, 2, 1, 130, 140, 128, 96, dict(window=(50, 10))),
    "key-padding-lq-gt-lk": (2, 2, 1, 150, 130, 24, 24, dict(kpm=0.3)),
}


def inputs(case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, kw = case
    g = torch.Generator().manual_seed(Lq + Lk)
    q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, Dv, g, dtype, "cpu")
    kw = dict(kw)
    if "kpm" in kw:
        kpm = torch.rand(B, Lk, generator=g) < kw.pop("kpm")
        kpm[-1] = True                                   # a fully padded batch entry
        kw["key_padding_mask"] = kpm
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_fused_backward_against_float64(case_id, dtype):
    q, k, v, kw = inputs(CASES[case_id], dtype)
    assert FUSED in effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    check_against_oracle(q, k, v, kw, dtype, "cuda")


@pytest.mark.parametrize("case_id", ["causal-gqa-lq-lt-lk-d32-dv48", "key-padding-lq-gt-lk"])
def test_two_pass_fallback_against_float64(case_id, monkeypatch):
    monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", "0")
    q, k, v, kw = inputs(CASES[case_id], torch.bfloat16)
    text = effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    assert "dK/dV and dQ passes" in text and "EFFATTN_CUDA_FUSED_BWD=0" in text, text
    check_against_oracle(q, k, v, kw, torch.bfloat16, "cuda")


def grads(q, k, v, go, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(9)
    out = effattn.attention(*leaves, backend="cuda", **kw)
    return torch.autograd.grad(out, leaves, go)


def test_bitwise_equal_across_schedules_and_runs(emulation):
    """The dQ sums run in one order whatever the threads' order: gradients equal bit for bit under
    lockstep, warp-serial and reversed warp-serial, twice each, with GQA, a window, key padding and dropout."""
    g = torch.Generator().manual_seed(5)
    q, k, v = random_qkv(1, 4, 2, 90, 270, 32, 32, g, torch.bfloat16, "cpu")
    kw = dict(causal=True, window=200, key_padding_mask=torch.rand(1, 270, generator=g) < 0.2, dropout_p=0.2)
    go = torch.randn(1, 4, 90, 32, generator=g).bfloat16()
    assert FUSED in effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    runs = []
    for s in (0, 1, 2, 1):
        emulation.emu_set_schedule(s)
        runs.append(grads(q, k, v, go, **kw))
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in runs[0])


def test_five_products_where_the_two_passes_run_seven(emulation, monkeypatch):
    """Dense, one key block of 128 and one query tile of 64 at head dim 64: each of the 8 warps runs
    4 x 8 mma for S^T, dP^T, dV and dK and 8 x 4 for dQ: 5 x 256 in all. The two passes at the same
    shape run 7 products of the same size (their dQ kernel recomputes S and dP)."""
    q, k, v = random_qkv(1, 1, 1, 64, 128, 64, 64, torch.Generator().manual_seed(0), torch.bfloat16, "cpu")
    go = torch.ones(1, 1, 64, 64).bfloat16()
    counts = []
    for switch in ("1", "0"):
        monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", switch)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, backend="cuda")
        emulation.emu_stats()                            # reset after the forward
        torch.autograd.grad(out, leaves, go)
        counts.append(int(emulation.emu_stats()[1]))
    assert counts == [5 * 256, 7 * 256], counts


def test_padded_keys_holding_nan_change_nothing():
    """K and V rows of padded keys hold NaN: the gradients equal those with zeros there bit for bit
    (the kernel zeroes those K rows before dQ = dS K), and the padded keys' dK, dV are 0."""
    g = torch.Generator().manual_seed(2)
    q, k, v = random_qkv(1, 2, 2, 80, 200, 32, 32, g, torch.bfloat16, "cpu")
    kpm = torch.rand(1, 200, generator=g) < 0.3
    go = torch.randn(1, 2, 80, 32, generator=g).bfloat16()
    ref = grads(q, k.masked_fill(kpm[:, None, :, None], 0), v.masked_fill(kpm[:, None, :, None], 0), go,
                key_padding_mask=kpm)
    got = grads(q, k.masked_fill(kpm[:, None, :, None], float("nan")),
                v.masked_fill(kpm[:, None, :, None], float("nan")), go, key_padding_mask=kpm)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(got[1][:, :, kpm[0]], torch.zeros_like(got[1][:, :, kpm[0]]))
    assert torch.equal(got[2][:, :, kpm[0]], torch.zeros_like(got[2][:, :, kpm[0]]))


def test_which_backward_runs_and_the_99_kb_fallback(emulation):
    """explain names the backward: fused at head dim 128 on the emulated H100; on a 99 KB device the
    fused kernel (145 KB at head dim 128) does not fit and the two passes run, against float64; a block
    layout, head dim 256 and a call without gradients say why."""
    q, k, v, kw = inputs(CASES["window-d128-dv96"], torch.bfloat16)
    q.requires_grad_()
    assert FUSED in effattn.explain(q, k, v, **kw).paths["cuda"]
    before = resources.set_emulated_smem(99 * 1024)
    try:
        text = effattn.explain(q, k, v, **kw).paths["cuda"]
        assert (f"the fused backward is not used: the fused backward kernel needs {resources.bwd_fused_smem(128)} "
                "bytes of shared memory per block, the emulated GPU allows 101376") in text, text
        check_against_oracle(q.detach(), k, v, kw, torch.bfloat16, "cuda")
    finally:
        resources.set_emulated_smem(before)
    lay = BlockLayout(torch.ones(1, 3, 3, dtype=torch.bool), 64)
    assert "block layouts" in effattn.explain(q, k, v, layout=lay).paths["cuda"]
    big = torch.zeros(1, 1, 8, 256, dtype=torch.bfloat16, requires_grad=True)
    assert "this call's bucket is 256" in effattn.explain(big, big, big).paths["cuda"]


def test_op_refuses_a_fused_call_it_does_not_serve(emulation):
    """The C++ op checks the backend's decision: fused with the ALiBi slope gradient names the argument."""
    q, k, v = random_qkv(1, 1, 1, 64, 64, 32, 32, torch.Generator().manual_seed(0), torch.bfloat16, "cpu")
    out, lse = emulation.attention_fwd(q, k, v, None, None, 0, 0, None, 0, None, 0.2, 0.0, -1, -1)
    args = (out, None, q, k, v, out, lse, None, None, 0, 0, None, 0, None, 0, None, 0.2, 0.0, -1, -1, 0.0,
            torch.full((1,), 0.1), None, True)
    with pytest.raises(RuntimeError, match="fused: the fused backward serves"):
        emulation.attention_bwd_score(*args, fused=True)
    assert torch.isfinite(emulation.attention_bwd_score(*args)[0]).all()
