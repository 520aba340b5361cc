"""The Hopper backward (csrc/attention/bwd_sm90.cuh: the fused backward's five products on wgmma, two
consumer warpgroups of 64 keys per 128-key block fed by a TMA producer warp through an mbarrier ring, dQ in
key-tile order under the fused kernel's semaphores) through
the emulation with the sm_90a device selected (EFFATTN_CUDA_EMU_HOPPER=1), at small shapes:

- dq, dk, dv (and the forward) against float64 for every mask kind it serves (dense, causal, windows),
  Lq / Lk not multiples of the tiles, GQA, D != Dv, rows that see no key, head-dim buckets 64 and 128,
  fp16 and bf16; explain names it and the emulated backward runs no mma.sync;
- bitwise-equal gradients on a repeat and across the emulator's three thread schedules;
- EFFATTN_CUDA_HOPPER_BWD=0 and the calls it does not serve (key padding, dropout, bucket 32) take the
  fused mma.sync kernel and explain says why; the op refuses hopper=True for a call it does not serve;
- compiled for sm_90a (nvcc, long run): no spills, registers under the cap, the wgmma shapes and the TMA
  loads in its SASS;
- on a real compute-capability 9.0 GPU (marker gpu; not yet run): against float64 at many blocks, bitwise
  on a repeat, close to the fused kernel.
"""
import re
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda import _ext, resources
from tests.backends.cuda.nvcc_units import Units, functions, needs_nvcc, ptxas_entries, sass_of
from tests.conftest import EMU_DEFAULT_SCHEDULE, random_qkv
from tests.core.test_attention import check_against_oracle

HOPPER_BWD = "backward: Hopper wgmma kernel (sm_90a"
FUSED = "backward: fused dK/dV/dQ kernel"


@pytest.fixture(scope="module")
def hopper():
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EFFATTN_CUDA_EMU", "1")
        mp.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
        mp.delenv("EFFATTN_CUDA_HOPPER_BWD", raising=False)
        problem = _ext.emu_problem()
        assert problem is None, problem
        yield torch.ops.effattn_cuda_emu
        torch.ops.effattn_cuda_emu.emu_set_schedule(EMU_DEFAULT_SCHEDULE)


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs): several key blocks adding into each query tile (the semaphore's
# turns), partial last tiles on both sides, GQA, D != Dv (zero-filled columns), rows seeing no key
# (causal with Lq > Lk: the first Lq - Lk rows; a window whose rows past the keys see none), a query offset
CASES = {
    "causal-gqa-lq-lt-lk-d64": (1, 4, 2, 100, 300, 64, 64, dict(causal=True)),
    "dense-d128-dv96": (1, 2, 2, 70, 260, 128, 96, {}),
    "window-d48-lq-gt-lk": (1, 2, 1, 200, 140, 48, 48, dict(window=(40, 10))),
    "causal-emptyrows-d128": (1, 1, 1, 150, 130, 128, 128, dict(causal=True)),
    "dense-gqa-exact-tiles-d64": (1, 2, 1, 128, 256, 64, 64, {}),
    "causal-positions-d64": (1, 2, 2, 90, 200, 64, 64, dict(causal=True, positions=(60, 0))),
}


def inputs(case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case]
    g = torch.Generator().manual_seed(Lq * 7 + Lk)
    q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, Dv, g, dtype, "cpu")
    return q, k, v, dict(kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_hopper_backward_against_float64(hopper, case, dtype):
    q, k, v, kw = inputs(case, dtype)
    assert HOPPER_BWD in effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    hopper.emu_stats()
    check_against_oracle(q.detach(), k, v, kw, dtype, "cuda")
    assert hopper.emu_stats()[1].item() == 0          # forward and backward on wgmma: no mma.sync


def grads(q, k, v, go, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = effattn.attention(*leaves, backend="cuda", **kw)
    return torch.autograd.grad(out, leaves, go)


def test_bitwise_equal_on_repeat_and_across_schedules(hopper):
    """dQ sums in key-tile order whatever the threads' order: the gradients of lockstep, warp-serial and
    reversed warp-serial runs, and of a repeat, are equal bit for bit (GQA, a window, 3 key blocks)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = random_qkv(1, 2, 1, 90, 300, 64, 64, g, torch.bfloat16, "cpu")
    kw = dict(window=(150, 20))
    go = torch.randn(1, 2, 90, 64, generator=g).bfloat16()
    assert HOPPER_BWD in effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    runs = []
    for s in (1, 0, 2, 1):
        hopper.emu_set_schedule(s)
        runs.append(grads(q.detach(), k, v, go, **kw))
    hopper.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in runs[0])


def test_keys_no_row_sees_holding_nan_change_nothing(hopper):
    """A window far right of the rows (q_offset-free: Lk - Lq = 200): keys 0..179 are seen by no row and hold
    NaN in K and V. The kernel zeroes those K rows before dQ = dS K (dS is 0 there, 0 * NaN is not), so the
    gradients equal those with zeros there bit for bit, and those keys' dK, dV are 0 (key tile 0 sees no
    query tile at all)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = random_qkv(1, 2, 1, 100, 300, 64, 64, g, torch.bfloat16, "cpu")
    kw = dict(window=(20, 5))
    go = torch.randn(1, 2, 100, 64, generator=g).bfloat16()
    assert HOPPER_BWD in effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    q = q.detach()
    unseen = torch.arange(300) < 180
    fill = lambda t, x: t.masked_fill(unseen[None, None, :, None], x)   # noqa: E731
    ref = grads(q, fill(k, 0), fill(v, 0), go, **kw)
    got = grads(q, fill(k, float("nan")), fill(v, float("nan")), go, **kw)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.isfinite(got[0]).all() and got[0].abs().sum() > 0
    assert torch.equal(got[1][:, :, :180], torch.zeros_like(got[1][:, :, :180]))
    assert torch.equal(got[2][:, :, :180], torch.zeros_like(got[2][:, :, :180]))


def test_switch_and_calls_it_does_not_serve_take_the_fused_kernel(hopper, monkeypatch):
    """EFFATTN_CUDA_HOPPER_BWD=0, key padding, dropout and head-dim bucket 32 run the fused mma.sync kernel,
    and explain says why; the switched-off call's gradients agree with the Hopper kernel's (the products
    sum in another order: close, not bitwise)."""
    q, k, v, kw = inputs("dense-gqa-exact-tiles-d64", torch.bfloat16)
    go = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    mine = grads(q, k, v, go, **kw)
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_BWD", "0")
    text = effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    assert FUSED in text and "EFFATTN_CUDA_HOPPER_BWD=0" in text, text
    hopper.emu_stats()
    theirs = grads(q.detach(), k, v, go, **kw)
    assert hopper.emu_stats()[1].item() > 0           # the fused kernel's mma.sync
    for a, b in zip(mine, theirs):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER_BWD")
    kpm = torch.zeros(1, 256, dtype=torch.bool)
    for extra, why in ((dict(key_padding_mask=kpm), "this call has key padding"),
                       (dict(dropout_p=0.1), "this call has dropout")):
        text = effattn.explain(q, k, v, **extra).paths["cuda"]
        assert FUSED in text and why in text, text
    small = torch.zeros(1, 1, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    text = effattn.explain(small, small, small).paths["cuda"]
    assert FUSED in text and "this call's bucket is 32" in text, text


def test_op_refuses_hopper_for_a_call_it_does_not_serve(hopper):
    q, k, v = random_qkv(1, 1, 1, 64, 64, 64, 64, torch.Generator().manual_seed(0), torch.bfloat16, "cpu")
    out, lse = hopper.attention_fwd(q, k, v, None, None, 0, 0, None, 0, None, 0.125, 0.0, -1, -1)
    kpm = torch.zeros(1, 64, dtype=torch.bool)
    args = (out, None, q, k, v, out, lse, kpm, None, 0, 0, None, 0, None, 0, None, 0.125, 0.0, -1, -1)
    with pytest.raises(RuntimeError, match="hopper: the Hopper backward serves"):
        hopper.attention_bwd(*args, fused=True, hopper=True)
    args = (out, None, q, k, v, out, lse, None, None, 0, 0, None, 0, None, 0, None, 0.125, 0.0, -1, -1)
    with pytest.raises(RuntimeError, match="with fused=True"):
        hopper.attention_bwd(*args, hopper=True)
    assert all(torch.isfinite(t).all() for t in hopper.attention_bwd(*args, fused=True, hopper=True))


def test_shared_memory_is_what_resources_says_and_the_fused_kernel_fills_in(hopper):
    """The kernel launches with resources.hopper_bwd_smem bytes (head dim 64: runs at exactly that limit,
    the op fails one byte under, naming the size); one byte under, the backend takes the fused kernel (no
    dQ partial, no alignment slack) and explain says why. (Head dim 64: there the Hopper forward at 128 x 128
    tiles needs less than the backward, so the forward still fits at the limits the test sets.)"""
    q, k, v = random_qkv(1, 1, 1, 64, 128, 64, 64, torch.Generator().manual_seed(4), torch.bfloat16, "cpu")
    need = resources.hopper_bwd_smem(64)
    assert resources.hopper_smem(64, 128) < need
    out, lse = hopper.attention_fwd(q, k, v, None, None, 0, 0, None, 0, None, 0.1, 0.0, -1, -1)
    args = (out, None, q, k, v, out, lse, None, None, 0, 0, None, 0, None, 0, None, 0.1, 0.0, -1, -1)
    before = resources.set_emulated_smem(need)
    try:
        assert HOPPER_BWD in effattn.explain(q.requires_grad_(), k, v).paths["cuda"]
        assert all(torch.isfinite(t).all() for t in hopper.attention_bwd(*args, fused=True, hopper=True))
        resources.set_emulated_smem(need - 1)
        with pytest.raises(RuntimeError, match=f"asks for {need} bytes"):
            hopper.attention_bwd(*args, fused=True, hopper=True)
        text = effattn.explain(q, k, v).paths["cuda"]
        assert FUSED in text and f"the Hopper backward kernel needs {need} bytes" in text, text
        out = effattn.attention(q, k, v, backend="cuda")
        assert all(torch.isfinite(t).all() for t in torch.autograd.grad(out.sum(), (q,)))
    finally:
        resources.set_emulated_smem(before)


# ---------------------------------------------------------------------------------- a real H100 / H200

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D,kw", [(128, dict(causal=True)), (64, {}), (128, dict(window=(300, 40)))],
                         ids=["causal-d128", "dense-d64", "window-d128"])
def test_real_hopper_backward_against_float64_bitwise_on_repeat(D, kw, dtype, monkeypatch):
    """On a compute-capability 9.0 GPU with the sm_90a kernels built: many blocks at once (the dQ turns
    really wait), GQA and ragged lengths; against float64, bitwise equal on a repeat, close to the fused
    mma.sync kernel (EFFATTN_CUDA_HOPPER_BWD=0)."""
    if not torch.cuda.is_available() or _ext.cuda_problem():
        pytest.skip("needs a GPU and effattn._C")
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER_BWD", raising=False)
    g = torch.Generator().manual_seed(D)
    q, k, v = random_qkv(2, 4, 2, 700, 1000, D, D, g, dtype, "cuda")
    text = effattn.explain(q.requires_grad_(), k, v, **kw).paths["cuda"]
    if HOPPER_BWD not in text:
        pytest.skip(f"the Hopper backward does not run here: {text}")
    q = q.detach()
    check_against_oracle(q, k, v, kw, dtype, "cuda")
    go = torch.randn(2, 4, 700, D, generator=g).to(dtype).cuda()
    first, again = grads(q, k, v, go, **kw), grads(q, k, v, go, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_BWD", "0")
    for a, b in zip(first, grads(q, k, v, go, **kw)):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


# ---------------------------------------------------------------------------------- nvcc (long run)

HOPPER_UNITS = tuple(f"attention/inst/bwd_sm90_{hd}_{dt}.cu" for hd in (64, 128) for dt in ("fp16", "bf16"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Units(tmp_path_factory.mktemp("nvcc"), {u: ("sm_90a",) for u in HOPPER_UNITS})


@needs_nvcc
@pytest.mark.parametrize("unit", ["attention/inst/bwd_sm90_128_bf16.cu", "attention/inst/bwd_sm90_64_fp16.cu"])
def test_hopper_backward_compiles_to_hgmma_without_spills(compiled, unit):
    """Per mask kind: no spills, at most 168 registers (the __launch_bounds__ of one block of 384 threads per
    SM; setmaxnreg moves them to the consumers), and per key-tile step the wgmma shapes of the five products:
    S^T and dP^T (HD / 16 each of m64n64k16), dV and dK (4 each of m64nHDk16) and dQ (m64n64k16: 8 at head dim
    128, 4 at 64), three wgmma waits, TMA loads (UTMALDG) on mbarriers (SYNCS), no cp.async, no mma.sync."""
    hd = int(re.search(r"bwd_sm90_(\d+)_", unit).group(1))
    report, obj = compiled[unit]
    entries = [e for e in ptxas_entries(report) if "attn_bwd_sm90_kernel" in e[1]]
    assert len(entries) == 3, entries                          # kDense, kCausal, kWindow
    for arch, name, regs, st, ld in entries:
        assert arch == "sm_90a" and regs <= 168 and st == 0 and ld == 0, (name, regs, st, ld)
    bodies = functions(sass_of(obj, "sm_90a"), "attn_bwd_sm90_kernel")
    assert len(bodies) == 3
    for body in bodies:
        shapes = re.findall(r"HGMMA\.(64x\d+x16)\.F32", body)
        want = {"64x64x16": 24, "64x128x16": 8} if hd == 128 else {"64x64x16": 20}
        got = {s: shapes.count(s) for s in set(shapes)}
        assert got == want, got
        assert body.count("WARPGROUP.DEPBAR") == 3 and "HMMA" not in body
        assert "UTMALDG" in body and "SYNCS" in body and "LDGSTS" not in body
