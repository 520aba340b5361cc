"""The warp-specialized Hopper forward (csrc/attention/fwd_sm90_tma.cuh: a producer warpgroup's TMA loads
into a two-stage mbarrier ring, two consumer warpgroups on wgmma, setmaxnreg 40 / 232):

- emulated (EFFATTN_CUDA_EMU_HOPPER=1), it runs by default: tests/backends/cuda/test_cuda_wgmma.py's
  Hopper-forward tests (every mask kind against float64, the pipeline over many key tiles, schedules,
  dropout, gradients) run on it; here it is bitwise equal to the cp.async kernel it replaces
  (EFFATTN_CUDA_HOPPER_TMA=0: the same fp32 operations in the same order) over ring wrap-arounds, partial
  tiles, GQA, head dim 128 and every mask kind, and explain says which of the two runs;
- compiled for sm_90a (nvcc): its SASS loads with UTMALDG (Q once, K and V per key tile: HD / 64 boxes
  each), waits and arrives on mbarriers (SYNCS), multiplies on HGMMA, moves registers (USETMAXREG) and
  has no cp.async (LDGSTS); 168 registers at launch (384 threads), no spills.
"""
import re

import pytest
import torch

import effattn
from effattn.testing.oracle import naive_attention
from tests.backends.cuda.nvcc_units import Units, functions, needs_nvcc, ptxas_entries, sass_of
from tests.conftest import EMU_DEFAULT_SCHEDULE
from tests.core.test_attention import judge, make_inputs, naive_in

# (B, H, Hkv, Lq, Lk, D, Dv, mask kwargs): 5 key tiles (each stage used 3 times: the parities wrap), a
# partial last key tile, GQA, head dim 128 (two boxes per tile), D != Dv (zero-filled columns), causal with
# key padding and a layout (masked tiles: V rows zeroed by the consumers)
CASES = {
    "dense-5-tiles": (1, 1, 1, 130, 320, 64, 64, {}),
    "ragged-gqa-d128": (1, 4, 2, 70, 200, 128, 128, {}),
    "causal-kpm-d128": (2, 1, 1, 140, 200, 128, 128, dict(causal=True, kpm=0.2)),
    "window-dv<d": (1, 2, 2, 90, 150, 80, 48, dict(window=(20, 5))),
    "layout-causal": (1, 2, 2, 128, 256, 64, 64, dict(layout=(64, False), causal=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tma_forward_against_float64_and_bitwise_the_cp_async_kernel(hopper, case, monkeypatch):
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case]
    q, k, v, kwargs = make_inputs((B, H, Hkv, Lq, Lk, D, Dv, kw), torch.bfloat16, seed=5)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    kwargs = {n: (t.cpu() if hasattr(t, "cpu") else t) for n, t in kwargs.items()}
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER_TMA", raising=False)
    assert "TMA loads by a producer warpgroup" in str(effattn.explain(q, k, v, **kwargs))
    hopper.emu_stats()
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    assert hopper.emu_stats()[1].item() == 0                 # wgmma, no mma.sync
    ref, _ = naive_attention(q.double(), k.double(), v.double(), **kwargs)
    low, _ = naive_in(torch.bfloat16, q, k, v, kwargs)
    judge(out, ref, low, 2, torch.bfloat16, "out")
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_TMA", "0")
    assert "cp.async loads by both warpgroups" in str(effattn.explain(q, k, v, **kwargs))
    out2, lse2 = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_tma_forward_under_every_schedule(hopper):
    q, k, v, kwargs = make_inputs((1, 2, 1, 70, 200, 64, 64, dict(causal=True, kpm=0.3)), torch.float16, seed=2)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    kwargs = {n: (t.cpu() if hasattr(t, "cpu") else t) for n, t in kwargs.items()}
    outs = []
    try:
        for s in (0, 1, 2):
            hopper.emu_set_schedule(s)
            outs.append(effattn.attention(q, k, v, backend="cuda", **kwargs))
    finally:
        hopper.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ------------------------------------------------------------------ its sm_90a SASS (nvcc)

@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Units(tmp_path_factory.mktemp("nvcc"), {"attention/fwd_sm90.cu": ("sm_90a",)})


@needs_nvcc
def test_tma_forward_sass_loads_with_tma_waits_on_mbarriers_and_moves_registers(compiled):
    report, obj = compiled["attention/fwd_sm90.cu"]
    entries = [e for e in ptxas_entries(report) if "attn_fwd_sm90_tma_kernel" in e[1]]
    assert len(entries) == 12, entries                       # 2 head dims x 2 dtypes x 3 mask kinds
    for arch, name, regs, st, ld in entries:
        assert regs <= 168 and st == 0 and ld == 0, (name, regs, st, ld)
    bodies = functions(sass_of(obj, "sm_90a"), "attn_fwd_sm90_tma_kernel")
    assert len(bodies) == 12
    for body in bodies:
        name = body.split("\n", 1)[0]
        hd = 128 if "ILi128E" in name else 64
        assert len(re.findall(r"\bUTMALDG\.4D\b", body)) == 3 * hd // 64, name   # Q, K, V: HD / 64 boxes each
        assert "SYNCS.ARRIVE.TRANS64" in body and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in body, name
        assert "USETMAXREG.DEALLOC.CTAPOOL" in body and "USETMAXREG.TRY" in body, name
        assert f"HGMMA.64x{hd}x16" in body and "HGMMA.64x64x16" in body, name
        assert "LDGSTS" not in body, name
