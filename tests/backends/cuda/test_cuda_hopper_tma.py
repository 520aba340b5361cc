"""The warp-specialized Hopper forward (csrc/attention/fwd_sm90_tma.cuh: a producer warpgroup's TMA loads
into a two-stage mbarrier ring, two consumer warpgroups on wgmma in ping-pong turns, setmaxnreg 24 / 240;
128 x 128 tiles, 128 x 64 for its kAny instance):

- emulated (EFFATTN_CUDA_EMU_HOPPER=1), it runs by default: tests/backends/cuda/test_cuda_wgmma.py's
  Hopper-forward tests (every mask kind against float64, the pipeline over many key tiles, schedules,
  dropout, gradients) run on it; here, over ring wrap-arounds, partial tiles, GQA, head dim 128 and every
  mask kind, it is judged against float64 and, at 64-key tiles (key padding, layouts: the same fp32
  operations in the same order), bitwise equal to the cp.async kernel (EFFATTN_CUDA_HOPPER_TMA=0); at
  128-key tiles the online softmax folds 128 keys per step (the cp.async kernel: 64), so the rounding
  differs and both are judged against float64; explain says which kernel and tile run; the 128-key tiles
  at every residue of Lk (1..127: the TMA's zero fill past Lk in a 128-row box);
- compiled for sm_90a (nvcc): its SASS loads with UTMALDG (Q once, K and V per key tile: HD / 64 boxes
  each), waits and arrives on mbarriers (SYNCS), multiplies on HGMMA (S: 64 x 128 at 128-key tiles),
  hands the turn over with named barriers (BAR.SYNC / BAR.ARV), moves registers (USETMAXREG) and has no
  cp.async (LDGSTS); 168 registers at launch (384 threads), no spills.
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


def cpu_inputs(case, dtype, seed):
    q, k, v, kwargs = make_inputs(case, dtype, seed=seed)
    return q.cpu(), k.cpu(), v.cpu(), {n: (t.cpu() if hasattr(t, "cpu") else t) for n, t in kwargs.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_tma_forward_against_float64_and_bitwise_the_cp_async_kernel(hopper, case, monkeypatch):
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case]
    q, k, v, kwargs = cpu_inputs((B, H, Hkv, Lq, Lk, D, Dv, kw), torch.bfloat16, 5)
    bn = 64 if ("kpm" in kw or "layout" in kw) else 128            # the kAny instance: 64-key tiles
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER_TMA", raising=False)
    told = str(effattn.explain(q, k, v, **kwargs))
    assert "TMA loads by a producer warpgroup" in told and f"ping-pong (named barriers), 128 x {bn} tiles" in told
    hopper.emu_stats()
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    assert hopper.emu_stats()[1].item() == 0                 # wgmma, no mma.sync
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kwargs)
    low, _ = naive_in(torch.bfloat16, q, k, v, kwargs)
    judge(out, ref, low, 2, torch.bfloat16, "out")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and torch.allclose(lse[seen].double(), ref_lse[seen], atol=1e-3)
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_TMA", "0")
    assert "cp.async loads by both warpgroups, 128 x 64 tiles" in str(effattn.explain(q, k, v, **kwargs))
    out2, lse2 = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    if bn == 64:
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
    else:                                                    # another summation order: each against float64
        judge(out2, ref, low, 2, torch.bfloat16, "out (cp.async)")


# the residues r of Lk = 128 m + r: CI runs the edges of the tile and its halves (about 1 s); the long run all
RESIDUES = {"edges": (1, 2, 7, 63, 64, 65, 120, 127, 128), "all": tuple(range(1, 129))}


@pytest.mark.parametrize("residues", list(RESIDUES))
def test_128_key_tiles_at_every_residue(hopper, residues):
    """Lk = 128 m + r for r in 1..127 (m = r % 3: one to three key tiles, the ring's stages reused) and
    Lk = 256 (r = 128: the kDense instance): the keys past Lk of the last 128-row box land as zeros and are
    masked."""
    for r in RESIDUES[residues]:
        Lk = 128 * (r % 3) + r
        D = 128 if r % 4 == 1 else 64
        dtype = torch.float16 if r % 2 else torch.bfloat16
        q, k, v, kwargs = cpu_inputs((1, 1, 1, 24, Lk, D, D, {}), dtype, r)
        out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda")
        ref, ref_lse = naive_attention(q.double(), k.double(), v.double())
        low, _ = naive_in(dtype, q, k, v, kwargs)
        judge(out, ref, low, 2, dtype, f"out at Lk {Lk}")
        assert torch.allclose(lse.double(), ref_lse, atol=1e-3), Lk


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
        bn = 64 if re.search(r"ILi\d+ELb[01]ELi2EE", name) else 128     # kAny (2): 64-key tiles
        assert len(re.findall(r"\bUTMALDG\.4D\b", body)) == 3 * hd // 64, name   # Q, K, V: HD / 64 boxes each
        assert "SYNCS.ARRIVE.TRANS64" in body and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in body, name
        # setmaxnreg: the producer down to 24 registers, the consumers up to 240
        assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in body and "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in body, name
        # S = Q K^T: m64 n(BN); O += P V: m64 n(HD)
        assert f"HGMMA.64x{bn}x16" in body and f"HGMMA.64x{hd}x16" in body, name
        assert set(re.findall(r"HGMMA\.(64x\d+)x16", body)) == {f"64x{bn}", f"64x{hd}"}, name
        # the ping-pong's turns: bar.sync on the warpgroup's barrier, bar.arrive on the other's
        # (256 threads: 0x100; the id in a register where it depends on the warpgroup)
        assert re.search(r"\bBAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100 ;", body), name
        assert re.search(r"\bBAR\.ARV R\d+, 0x100 ;", body) and re.search(r"\bBAR\.ARV 0x2, 0x100 ;", body), name
        assert "LDGSTS" not in body and "LDL" not in body and "STL" not in body, name
