"""The warp-specialized Hopper forward (csrc/attention/fwd_sm90_tma.cuh: a producer warpgroup's TMA loads
into a two-stage mbarrier ring, two consumer warpgroups on wgmma in ping-pong turns, setmaxnreg 24 / 240;
128 x 128 tiles, every mask kind):

- emulated (EFFATTN_CUDA_EMU_HOPPER=1), it runs by default: tests/backends/cuda/test_cuda_wgmma.py's
  Hopper-forward tests (every mask kind against float64, the pipeline over many key tiles, schedules,
  dropout, gradients) run on it; here, over ring wrap-arounds, partial tiles, GQA, head dim 128 and every
  mask kind, it and the cp.async kernel (EFFATTN_CUDA_HOPPER_TMA=0, 64-key tiles: the online softmax folds
  64 keys per step, not 128, so the rounding differs) are judged against float64; explain says which kernel
  and tile run; the 128-key tiles at every residue of Lk (1..127: the TMA's zero fill past Lk in a 128-row
  box); the kAny instance at 128-key tiles: the layout lists for them (a tile over two 64-key blocks full only
  if both are), key padding, positions, layouts of blocks 64, 128 and 96 at residues of 128 against float64
  with rows that see no key, and dropout's keep-mask equal to the mma.sync forward's;
- compiled for sm_90a (nvcc): its SASS loads with UTMALDG (Q once, K and V per key tile: HD / 64 boxes
  each), waits and arrives on mbarriers (SYNCS), multiplies on HGMMA (S: 64 x 128), hands the turn over with
  named barriers (BAR.SYNC / BAR.ARV), moves registers (USETMAXREG) and has no cp.async (LDGSTS); 168
  registers at launch (384 threads), no spills, no local memory.
"""
import re

import pytest
import torch

import effattn
from effattn.layouts import BlockLayout
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


def tma_against_float64(hopper, q, k, v, kwargs):
    """The TMA kernel's output (explain: 128 x 128 tiles; wgmma only) against float64, lse too: (out, lse, ref,
    naive bf16 output, the rows that see a key)."""
    told = str(effattn.explain(q, k, v, **kwargs))
    assert "TMA loads by a producer warpgroup" in told and "ping-pong (named barriers), 128 x 128 tiles" in told
    hopper.emu_stats()
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    assert hopper.emu_stats()[1].item() == 0                 # wgmma, no mma.sync
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kwargs)
    low, _ = naive_in(torch.bfloat16, q, k, v, kwargs)
    judge(out, ref, low, 2, torch.bfloat16, "out")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and torch.allclose(lse[seen].double(), ref_lse[seen], atol=1e-3)
    return out, lse, ref, low, seen


@pytest.mark.parametrize("case", list(CASES))
def test_tma_forward_and_the_cp_async_kernel_against_float64(hopper, case, monkeypatch):
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case]
    q, k, v, kwargs = cpu_inputs((B, H, Hkv, Lq, Lk, D, Dv, kw), torch.bfloat16, 5)
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER_TMA", raising=False)
    out, lse, ref, low, seen = tma_against_float64(hopper, q, k, v, kwargs)
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_TMA", "0")
    assert "cp.async loads by both warpgroups, 128 x 64 tiles" in str(effattn.explain(q, k, v, **kwargs))
    out2, lse2 = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    # another summation order (128 keys per online-softmax step, the cp.async kernel 64): each against float64
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


# ------------------------------------------------------------------ kAny at 128-key tiles

def test_128_key_lists_need_both_64_key_blocks_for_a_full_tile():
    """The TMA kernel's layout lists (tiling.layout_lists, tma=True: 128 x 128 tiles): over a layout of 64-key
    blocks a 128-key tile is full only when both of its blocks are, partial when one is, skipped when none is,
    and its partial tiles read the layout per element (layout_check); over 128-key blocks they nest (0)."""
    from effattn.backends.cuda.attention.tiling import layout_lists
    from effattn.tiles import TileLists
    q, k = torch.zeros(1, 1, 64, 64), torch.zeros(1, 1, 512, 64)       # one query block, one query tile
    mask = torch.tensor([[[True, True, True, False, False, True, False, False]]])   # key blocks of 64
    lists, wf, check = layout_lists(q, k, k, mask, 64, -1, -1, by_key=False, hopper=True, tma=True)
    assert check == 1 and lists.shape[1] == 1 and TileLists(lists, wf).row(0, 0) == ([0], [1, 2])
    lists, wf, check = layout_lists(q, k, k, mask[..., :4], 128, -1, -1, by_key=False, hopper=True, tma=True)
    assert check == 0 and TileLists(lists, wf).row(0, 0) == ([0, 1, 2], [])
    lists, wf, _ = layout_lists(q, k, k, mask, 64, -1, -1, by_key=False, hopper=True)      # the cp.async kernel's
    assert TileLists(lists, wf).row(0, 0) == ([0, 1, 2, 5], [])


def block_layout(H, Lq, Lk, bs, seed):
    """A per-head random layout of `bs` blocks with one query block that sees no key block (rows with no key)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(H, -(-Lq // bs), -(-Lk // bs), generator=g) < 0.5
    mask[:, 0] = False
    return BlockLayout(mask, bs)


# (B, H, Hkv, Lq, Lk, D, mask kwargs, layout block or 0): kAny calls at Lk = 128 m + r (r: 1, 63, 64, 127, 72);
# key padding with a fully padded batch entry, positions with causal and a query block of no layout block leave
# rows that see no key (positions alone, without key padding or dropout, run the kWindow instance)
ANY_CASES = {
    "kpm-r1": (2, 2, 1, 130, 257, 64, dict(kpm=0.3), 0),
    "positions-kpm-causal-r63-d128": (2, 1, 1, 65, 191, 128, dict(causal=True, kpm=0.2, positions=(40, 70)), 0),
    "layout-bs64-causal-r64": (1, 2, 2, 200, 320, 64, dict(causal=True), 64),
    "layout-bs128-r127": (1, 2, 1, 256, 383, 64, {}, 128),
    "layout-bs96-kpm-r72": (2, 1, 1, 150, 200, 64, dict(kpm=0.2), 96),
}


def any_case(name, dtype=torch.bfloat16, seed=11):
    B, H, Hkv, Lq, Lk, D, kw, bs = ANY_CASES[name]
    q, k, v, kwargs = cpu_inputs((B, H, Hkv, Lq, Lk, D, D, {n: x for n, x in kw.items() if n != "positions"}),
                                 dtype, seed)
    if "positions" in kw:
        kwargs["positions"] = kw["positions"]
    if bs:
        kwargs["layout"] = block_layout(H, Lq, Lk, bs, seed)
    return q, k, v, kwargs


@pytest.mark.parametrize("case", list(ANY_CASES))
def test_kany_at_128_key_tiles_against_float64(hopper, case):
    """Key padding, positions and layouts of blocks 64 (two per key tile), 128 and 96 (straddling tiles) on the
    TMA kernel's 128 x 128 tiles (explain says so), against float64 (outputs NaN-poisoned by the binding); rows
    that see no key give 0 and lse -inf; NaN values at padded keys change nothing."""
    q, k, v, kwargs = any_case(case)
    out, lse, _, _, seen = tma_against_float64(hopper, q, k, v, kwargs)
    assert (~seen).any() and seen.any()
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    kpm = kwargs.get("key_padding_mask")
    if kpm is not None:          # padded keys' values are never read: the consumers zero them in V (NaN-safe)
        v_nan = v.clone()
        v_nan.transpose(1, 2)[kpm] = float("nan")
        assert torch.equal(effattn.attention(q, k, v_nan, backend="cuda", **kwargs), out)


def keep_read_off(q, k, p, kwargs, seed=5, chunk=128):
    """The dropout keep-mask a forward draws under torch seed `seed`, read off its output with V = identity
    (out[i, j] = P_ij M_ij / (1 - p)), 128 columns of the identity per call (head dims up to 128)."""
    B, Hkv, Lk = k.shape[:3]
    eye = torch.eye(Lk, dtype=q.dtype).expand(B, Hkv, Lk, Lk)
    parts = []
    for c in range(0, Lk, chunk):
        torch.manual_seed(seed)
        parts.append(effattn.attention(q, k, eye[..., c:c + chunk].contiguous(), dropout_p=p, backend="cuda",
                                       **kwargs) != 0)
    return torch.cat(parts, -1)


@pytest.mark.parametrize("case", ["positions-kpm-causal-r63-d128", "layout-bs64-causal-r64"])
def test_kany_dropout_at_128_key_tiles_draws_the_other_kernels_keep_mask(hopper, case, monkeypatch):
    """Dropout on the TMA kernel's 128-key tiles (with positions: the counters at the chunk's absolute rows and
    keys): the keep-mask equals the mma.sync forward's (the same Philox counters per (row, key)), keeps only
    visible pairs, about 1 - p of them, and the output with that mask matches float64."""
    p = 0.3
    q, k, v, kwargs = any_case(case, seed=3)
    mask = keep_read_off(q, k, p, kwargs)
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    assert torch.equal(mask, keep_read_off(q, k, p, kwargs))
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    visible = torch.isfinite(naive_attention(q.double(), k.double(), v.double(), **kwargs)[1])[..., None] & (
        naive_attention(q.double(), k.double(), torch.eye(k.shape[2]).double().expand(*k.shape[:3], -1),
                        **kwargs)[0] > 0)
    assert not (mask & ~visible).any()
    n = int(visible.sum())
    frac = mask[visible].double().mean().item()
    assert n > 100 and abs(frac - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5, (frac, n)     # 4 standard deviations
    torch.manual_seed(5)
    hopper.emu_stats()
    out = effattn.attention(q, k, v, dropout_p=p, backend="cuda", **kwargs)
    assert hopper.emu_stats()[1].item() == 0
    mask = mask.expand(q.shape[0], q.shape[1], -1, -1)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), dropout_keep=mask, dropout_p=p, **kwargs)
    low, _ = naive_attention(q, k, v, dtype=torch.bfloat16, dropout_keep=mask, dropout_p=p, **kwargs)
    judge(out, ref, low, 2, torch.bfloat16, "out with dropout")


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
        bn = 128                                                        # every instance: 128-key tiles
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
