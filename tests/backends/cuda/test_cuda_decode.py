"""The CUDA backend's split-KV decode kernels (csrc/decode_kernels.cuh), run on the CPU through the
emulation (EFFATTN_CUDA_EMU=1): every mask against the float64 oracle with the GQA group packed
into one tile, forced split counts (several, an uneven last one, splits that see no key), the
tiles each split visits, bitwise determinism, the split plan and the dispatch that picks the path.
"""
import math
import os
import shutil

import pytest
import torch

import effattn
from effattn import splits as split_plan
from effattn._call import make_attn_call
from effattn.backends import base
from effattn.backends.cuda.attention import decode
from effattn.layouts import BlockLayout
from effattn.testing.oracle import naive_attention
from effattn.tiles import visited_tiles
from tests.conftest import CSRC, EMU_DEFAULT_SCHEDULE, need_cuda_extension, random_qkv
from tests.core.test_attention import judge, naive_in

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)


def inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype, seed, transposed=False):
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); with `transposed`, views of (B, L, H, D)."""
    return random_qkv(B, H, Hkv, Lq, Lk, D, Dv, torch.Generator().manual_seed(seed), dtype, "cpu", transposed)


def check(out, lse, q, k, v, kw, dtype):
    """Output by the low-precision rule against float64, lse to 1e-3 with the same -inf rows."""
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kw)
    low, _ = naive_in(dtype, q, k, v, kw)
    assert out.dtype == dtype and out.shape == ref.shape and lse.dtype == torch.float32
    judge(out, ref, low, 2, dtype, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-3


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs); layout: (block size, per head)
CASES = {
    "dense-H32-Hkv8-Lq1": (1, 32, 8, 1, 600, 64, 64, {}),
    "causal-gqa4-Lq4-transposed": (2, 8, 2, 4, 600, 32, 32, dict(causal=True)),
    "window-left-Lq3": (1, 4, 1, 3, 700, 64, 64, dict(causal=True, window=130)),
    "window-two-sided-Lq5-D20-padded": (1, 2, 2, 5, 400, 20, 48, dict(window=(90, 2))),
    "key-padding-Dv-ne-D": (2, 6, 2, 2, 500, 40, 24, dict(key_padding="random")),
    "layout-shared-bs32": (1, 8, 2, 2, 640, 32, 32, dict(layout=(32, False), causal=True)),
    "layout-per-head-gqa-bs48": (1, 8, 2, 3, 520, 32, 32, dict(layout=(48, True))),
    "layout-per-head-mha-window": (1, 2, 2, 1, 450, 64, 64, dict(layout=(64, True), window=200)),
    "Lq16-G8-eight-row-tiles": (1, 8, 1, 16, 260, 32, 32, dict(causal=True)),
    "Lq-gt-Lk-empty-rows": (1, 4, 2, 12, 8, 32, 32, dict(causal=True)),
    "D256": (1, 4, 2, 1, 200, 256, 256, dict(causal=True)),
}


def case_kwargs(kw, B, H, Lq, Lk, g):
    kw = dict(kw)
    if kw.pop("key_padding", None):
        kpm = torch.rand(B, Lk, generator=g) < 0.3
        kpm[-1, : Lk // 2] = True                       # most keys of one batch entry gone
        kw["key_padding_mask"] = kpm
    if "layout" in kw:
        bs, per_head = kw.pop("layout")
        mask = torch.rand(H if per_head else 1, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < 0.5
        kw["layout"] = BlockLayout(mask, bs)
    return kw


@pytest.mark.parametrize("case_id", list(CASES))
def test_decode_against_float64(case_id):
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case_id]
    dtype = torch.bfloat16 if len(case_id) % 2 else torch.float16
    q, k, v = inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype, len(case_id), transposed="transposed" in case_id)
    kw = case_kwargs(kw, B, H, Lq, Lk, torch.Generator().manual_seed(7))
    assert effattn.explain(q, k, v, **kw).paths["cuda"].startswith("cuda/decode: split-KV decode")
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kw)
    check(out, lse, q, k, v, kw, dtype)


def test_forced_splits_uneven_and_empty(emulation):
    """One split, several, an uneven last one, more splits than key tiles (splits with no tile), and
    a split whose keys are all padded (its partial lse is -inf): each result by the oracle's rule."""
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 2, 400, 32                # 7 key tiles of 64
    dtype = torch.bfloat16
    q, k, v = inputs(B, H, Hkv, Lq, Lk, D, D, dtype, 3)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, 64:250] = True                                     # splits=3 (3, 3, 1 tiles): most of split 0
    kpm[1, :192] = True                                       # batch 1: all of split 0 with splits=3
    for kw, counts in ((dict(key_padding_mask=kpm), (1, 2, 3, 7, 13)), (dict(causal=True), (3, 13)),
                       (dict(causal=True, window=130), (2, 13))):
        for splits in counts:
            left = kw.get("window", -1)
            out, lse = decode.cuda_attention_decode(q, k, v, None, 0, kw.get("key_padding_mask"), D ** -0.5, left,
                                                    0 if kw.get("causal") else -1, splits)
            check(out, lse, q, k, v, kw, dtype)


def test_visits_each_planned_tile_once_across_splits(emulation):
    """The emulation counts warp mma: each visited (block, key tile) costs every warp 2 ceil(D/16)
    for S and 2 ceil(Dv/16) for P V. Summed over the splits, the count must be the tile plan's
    (`visited_tiles` for query tile 0 of 16 rows) per (batch, KV head, row tile): no tile twice, none
    dropped, whatever the split count. Every ldmatrix phase takes one shared-memory wavefront."""
    B, H, Hkv, Lq, Lk, D, Dv = 1, 8, 2, 3, 900, 32, 48
    g = torch.Generator().manual_seed(2)
    q, k, v = inputs(B, H, Hkv, Lq, Lk, D, Dv, torch.float16, 5)
    layout = BlockLayout(torch.rand(1, 1, math.ceil(Lk / 32), generator=g) < 0.4, 32)
    per_tile = 4 * (2 * math.ceil(D / 16) + 2 * math.ceil(Dv / 16))
    for left, right, lay in ((-1, -1, None), (300, 0, None), (-1, -1, layout), (500, 0, layout)):
        full, part = visited_tiles(Lq, Lk, decode.ROWS, decode.BLOCK_N, left, right,
                                   lay.mask if lay else None, lay.block_size if lay else 0)
        for splits in (1, 4, 9):
            emulation.emu_stats()
            decode.cuda_attention_decode(q, k, v, lay.mask if lay else None, lay.block_size if lay else 0, None,
                                         0.2, left, right, splits)
            blocks, mma, phases, wavefronts, worst = emulation.emu_stats().tolist()
            assert mma == (full + part) * B * Hkv * per_tile, (left, right, lay is not None, splits, mma)
            assert phases > 0 and wavefronts == phases and worst == 1     # swizzled: no bank conflict
            assert blocks == B * Hkv * splits + (0 if splits == 1 else math.ceil(B * H * Lq / 4))


def test_rows_seeing_no_key_and_empty_sequences():
    dtype = torch.float16
    q, k, v = inputs(2, 4, 2, 2, 300, 16, 16, dtype, 9)
    kpm = torch.zeros(2, 300, dtype=torch.bool)
    kpm[1] = True
    with torch.no_grad():
        out, lse = effattn.attention(q, k, v, key_padding_mask=kpm, return_lse=True, backend="cuda")
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())
    check(out, lse, q, k, v, dict(key_padding_mask=kpm), dtype)
    for B, Lq, Lk in ((1, 0, 300), (1, 3, 0), (0, 3, 300)):
        q, k, v = inputs(B, 4, 2, Lq, Lk, 16, 16, dtype, 1)
        assert effattn.explain(q, k, v).paths["cuda"].startswith("cuda/decode: split-KV decode")
        for splits in (1, 3):
            out, lse = decode.cuda_attention_decode(q, k, v, None, 0, None, 0.25, -1, 0, splits)
            assert out.shape == (B, 4, Lq, 16) and torch.equal(out, torch.zeros_like(out))
            assert bool((lse == -math.inf).all())


def test_bitwise_deterministic_under_every_schedule(emulation):
    """Repeated runs and the three thread schedules give identical bits (no race, no atomics)."""
    q, k, v = inputs(1, 8, 2, 2, 700, 32, 32, torch.bfloat16, 4)
    kpm = torch.rand(1, 700, generator=torch.Generator().manual_seed(0)) < 0.2
    runs = []
    for s in (0, 1, 2, 0):
        emulation.emu_set_schedule(s)
        runs.append(decode.cuda_attention_decode(q, k, v, None, 0, kpm, 0.3, 250, 0, 5))
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_opcheck(emulation):
    q, k, v = inputs(1, 4, 2, 2, 130, 8, 8, torch.bfloat16, 0)
    lm = torch.rand(4, 1, 5, generator=torch.Generator().manual_seed(1)) < 0.7
    torch.library.opcheck(decode.cuda_attention_decode, (q, k, v, lm, 32, None, 0.3, 40, 0, 2))


def test_auto_split_count_is_the_plans_and_compiles(emulation):
    """The backend's call runs the plan's split count (counted in emulated blocks), and it traces
    under torch.compile(fullgraph=True) with a per-head layout (its lists are built inside the op)."""
    B, H, Hkv, Lk = 1, 8, 2, 1000
    q, k, v = inputs(B, H, Hkv, 1, Lk, 32, 32, torch.bfloat16, 6)
    layout = BlockLayout(torch.rand(H, 1, math.ceil(Lk / 32), generator=torch.Generator().manual_seed(3)) < 0.6, 32)
    kw = dict(layout=layout, window=600, causal=True)

    def f(q, k, v):
        return effattn.attention(q, k, v, backend="cuda", **kw)

    with torch.no_grad():
        emulation.emu_stats()
        eager = f(q, k, v)
        blocks = int(emulation.emu_stats()[0])
        row_tiles, tiles, splits = decode.plan(make_attn_call(q, k, v, **kw))
        assert splits > 1 and blocks == B * Hkv * row_tiles * splits + math.ceil(B * H / 4), (blocks, splits)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(eager, compiled)
    check(eager, effattn.attention(q, k, v, backend="cuda", return_lse=True, **kw)[1], q, k, v, kw, torch.bfloat16)


# ----------------------------------------------------------------------------------- the plan

def test_split_plan_fills_two_waves_with_a_minimum_per_split():
    """H100 (132 SMs), H=32, Hkv=8, Lq=1, Lk=16k (256 key tiles): at least 2 x 132 blocks."""
    for B in (1, 4):
        s = decode.num_splits(B, 8, 1, 256, 132)
        assert B * 8 * s >= 2 * 132 and math.ceil(256 / s) >= decode.MIN_TILES_PER_SPLIT, (B, s)
    assert decode.num_splits(1, 8, 1, 16, 132) == 4             # short cache: the minimum per split rules
    assert decode.num_splits(1, 8, 1, 7, 132) == 1
    assert decode.num_splits(64, 8, 1, 256, 132) == 1             # enough blocks without splitting
    assert decode.num_splits(1, 1, 1, 10 ** 6, 132) == decode.MAX_SPLITS
    header = open(os.path.join(CSRC, "attention", "decode.h")).read()
    for name, value in (("kDecodeRows", decode.ROWS), ("kDecodeBlockN", decode.BLOCK_N),
                        ("kDecodeMaxQueries", decode.MAX_QUERIES)):
        assert f"constexpr int {name} = {value};" in header, name      # the Python plan's tile sizes


def test_dispatch_ranks_the_decode_path_and_explain_names_it():
    """Decode-shaped calls (Lq <= 16, no dropout, no gradient) that see DECODE_MIN_KEYS keys rank the
    row cuda/decode ahead of Triton's rows; with fewer keys it ranks after triton/prefill (still
    before cuda/prefill, so the named backend takes it); other calls take cuda/prefill, and explain
    says on the cuda/decode line why not."""
    q, k, v = inputs(1, 8, 2, 1, split_plan.DECODE_MIN_KEYS, 32, 32, torch.float16, 0)
    ex = effattn.explain(q, k, v, causal=True)
    assert ex.ranks["cuda"] < ex.ranks["triton"]
    assert "split-KV decode: 4 query heads x 1 row(s)" in ex.paths["cuda"] and "8 SMs" in ex.paths["cuda"]
    assert "can serve" in str(ex) and "cuda/decode" in str(ex)
    call = make_attn_call(q, k, v)
    names = [p.name for p in base.rows("attention", call)]
    assert names.index("cuda/decode") < names.index("triton/decode") < names.index("cuda/prefill")
    assert base.rows("attention")[0].name != "cuda/decode"      # without a call: the static order
    short = effattn.explain(q, k[:, :, :split_plan.DECODE_MIN_KEYS - 1], v[:, :, :split_plan.DECODE_MIN_KEYS - 1])
    assert short.ranks["cuda"] > short.ranks["triton"] and short.paths["cuda"].startswith("cuda/decode: split-KV")
    for why, args, kw in (("Lq=17 not in 1..16", (inputs(1, 8, 2, 17, 600, 32, 32, torch.float16, 0)), {}),
                          ("dropout", (q, k, v), dict(dropout_p=0.1)),
                          ("gradients needed", (q.detach().requires_grad_(), k, v), {})):
        ex = effattn.explain(*args, **kw)
        assert ex.ranks["cuda"] > ex.ranks["triton"] and any(why in r for r in ex.row("cuda/decode").reasons)
        assert ex.paths["cuda"].startswith("cuda/prefill")


def test_gradients_take_the_prefill_kernels(monkeypatch):
    """With a gradient needed the backend runs the prefill forward (its backward exists); under
    no_grad the decode kernels."""
    taken = []
    real = decode.PATH.run
    monkeypatch.setattr(decode.PATH, "run", lambda call: taken.append(call.Lq) or real(call))
    q, k, v = inputs(1, 4, 2, 2, 200, 16, 16, torch.bfloat16, 0)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = effattn.attention(*leaves, causal=True, backend="cuda")
    assert not taken and all(g is not None for g in torch.autograd.grad(out.float().sum(), leaves))
    with torch.no_grad():
        dec = effattn.attention(*leaves, causal=True, backend="cuda")
    assert taken == [2]
    ref, _ = naive_attention(*(t.detach().double() for t in leaves), causal=True)
    low, _ = naive_in(torch.bfloat16, *(t.detach() for t in leaves), dict(causal=True))
    judge(dec, ref, low, 2, torch.bfloat16, "out")


# ------------------------------------------------------------------------------------ on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case_id", ["causal-gqa4-Lq4-transposed", "key-padding-Dv-ne-D", "layout-per-head-gqa-bs48",
                                     "D256"])
def test_gpu_decode_matches_its_emulation(case_id):
    """The real kernels against the emulated ones on the same inputs and split count: a couple of
    units in the last place (ex2.approx, the tensor cores' summation order)."""
    need_cuda_extension()
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case_id]
    dtype = torch.bfloat16
    q, k, v = inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype, 0)
    kw = case_kwargs(kw, B, H, Lq, Lk, torch.Generator().manual_seed(7))
    call = make_attn_call(q, k, v, **kw)
    lay = call.layout
    got = {}
    for dev in ("cuda", "cpu"):
        args = [t.to(dev) for t in (q, k, v)]
        mask = lay.mask.to(dev) if lay is not None else None
        kpm = call.key_padding_mask.to(dev) if call.key_padding_mask is not None else None
        got[dev] = [t.cpu() for t in decode.cuda_attention_decode(*args, mask, lay.block_size if lay else 0, kpm,
                                                                  call.scale, call.window_left, call.window_right, 3)]
    for name, a, b in zip(("out", "lse"), got["cuda"], got["cpu"]):
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        err = (a.float() - b.float()).abs().nan_to_num(posinf=0.0, neginf=0.0).max().item()
        assert err <= 4 * 2.0 ** -7 * max(b.float().abs().max().item(), 1.0), (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_decode_at_the_issue_shape(B):
    """H=32, Hkv=8, D=128, Lk=16k, one query row: "auto" picks the CUDA decode kernels, which match
    float64 by the low-precision rule and repeat bit for bit."""
    need_cuda_extension()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(B)
    q = torch.randn(B, 32, 1, 128, device=dev, dtype=dtype, generator=g)
    k, v = (torch.randn(B, 8, 16384, 128, device=dev, dtype=dtype, generator=g) for _ in range(2))
    ex = effattn.explain(q, k, v, causal=True)
    assert ex.chosen == "cuda" and "split-KV decode" in ex.paths["cuda"], str(ex)
    with torch.no_grad():
        runs = [effattn.attention(q, k, v, causal=True, return_lse=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    check(*runs[0], q, k, v, dict(causal=True), dtype)
