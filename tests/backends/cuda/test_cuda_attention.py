"""The CUDA backend's kernels, run on the CPU through their host emulation (EFFATTN_CUDA_EMU=1,
see csrc/emu/), against the float64 oracle: the shared softmax cases of test_attention.py and the
random configurations of test_fuzz.py in fp16 and bf16, under two thread schedules; tile visits
against the Triton backend's plan; dropout keep-masks bit for bit against the Triton kernels; the
torch.library ops (opcheck, torch.compile); bank conflicts of every ldmatrix.

The emulated extension is compiled with g++ on first use (about 30 s) and cached.
"""
import math
import shutil

import numpy as np
import pytest
import torch

import effattn
from effattn.layouts import BlockLayout
from effattn.numerics import draw_seed, drop_threshold, philox_key
from effattn.testing.oracle import naive_attention
from tests.conftest import EMU_DEFAULT_SCHEDULE
from tests.contract.test_fuzz import draw
from tests.core.test_attention import CASES, check_against_oracle, judge, make_inputs

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16]
# schedule -> (its number, the backward's switch): lockstep runs the two-pass backward
# (EFFATTN_CUDA_FUSED_BWD=0), warp-serial the fused one wherever it applies, so the shared cases check both
SCHEDULES = {"lockstep-two-pass-bwd": (0, "0"), "warp-serial": (1, "1")}


@pytest.fixture(params=list(SCHEDULES))
def schedule(request, emulation, monkeypatch):
    number, fused = SCHEDULES[request.param]
    monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", fused)
    emulation.emu_set_schedule(number)
    yield request.param
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)


@pytest.fixture(params=["fused-bwd", "two-pass-bwd"])
def backward(request, monkeypatch):
    """The fused backward (where it applies) or the two passes (EFFATTN_CUDA_FUSED_BWD=0)."""
    monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", "1" if request.param == "fused-bwd" else "0")
    return request.param


# ------------------------------------------------------------------------ the shared softmax suite

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_shared_cases_against_float64(case_id, dtype, schedule):
    q, k, v, kwargs = make_inputs(CASES[case_id], dtype, transposed=case_id.startswith("gqa"))
    check_against_oracle(q, k, v, kwargs, dtype, "cuda")


@pytest.mark.parametrize("seed", range(30))
def test_random_configurations_against_float64(seed):
    (B, H, Hkv, Lq, Lk, D, Dv), kw, kpm, transposed = draw(seed)
    dtype = DTYPES[seed % 2]
    g = torch.Generator().manual_seed(1000 + seed)

    def rnd(h, L, d):
        if transposed:
            return torch.randn(B, L, h, d, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(B, h, L, d, generator=g).to(dtype)

    if kpm is not None:
        kw["key_padding_mask"] = kpm
    check_against_oracle(rnd(H, Lq, D), rnd(Hkv, Lk, D), rnd(Hkv, Lk, Dv), kw, dtype, "cuda")


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs): head-dim buckets 32..256, padded and strided inputs
SHAPES = {
    "D40-Dv56-bucket64-causal": (1, 2, 1, 70, 70, 40, 56, dict(causal=True)),
    "D96-Dv72-bucket128-window": (1, 2, 2, 50, 66, 96, 72, dict(window=(20, 5))),
    "D130-Dv8-bucket256-layout": (1, 2, 2, 45, 45, 130, 8, dict(layout=(16, True))),
    "D256-Dv256-decode-gqa": (1, 4, 1, 3, 70, 256, 256, dict(causal=True)),
    "window-int32-max": (1, 2, 2, 30, 40, 16, 16, dict(window=(2**31 - 1, 2**31 - 1))),
    "Lk-not-multiple-Lq-gt-Lk-layout-bs48": (2, 2, 2, 100, 61, 16, 16, dict(layout=(48, False), causal=True)),
}


@pytest.mark.parametrize("case_id", list(SHAPES))
def test_head_dim_buckets_and_layout_blocks(case_id):
    B, H, Hkv, Lq, Lk, D, Dv, kw = SHAPES[case_id]
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(len(case_id))
    q, k, v = (torch.randn(B, h, L, d, generator=g).to(dtype) for h, L, d in ((H, Lq, D), (Hkv, Lk, D), (Hkv, Lk, Dv)))
    kw = dict(kw)
    if "layout" in kw:
        bs, per_head = kw.pop("layout")
        mask = torch.rand(H if per_head else 1, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < 0.6
        kw["layout"] = BlockLayout(mask, bs)
    check_against_oracle(q, k, v, kw, dtype, "cuda")


def test_strided_stride0_and_unaligned_inputs():
    """Head-dim stride 2, batch stride 0 and length stride 0 (expanded), a storage offset that
    breaks 16-byte alignment, a transposed padding mask: the binding copies what cp.async cannot
    read and the result is right."""
    B, H, L, D = 2, 2, 37, 16
    g = torch.Generator().manual_seed(3)
    dt = torch.float16
    q = torch.randn(B, H, L, 2 * D, generator=g).to(dt)[..., ::2]
    k = torch.randn(1, 1, L, D, generator=g).to(dt).expand(B, 1, L, D)
    v = torch.randn(1, 1, 1, D, generator=g).to(dt).expand(B, 1, L, D)
    kpm = (torch.rand(2 * L, B, generator=g) < 0.25).t()[:, ::2]
    check_against_oracle(q, k, v, dict(causal=True, window=9, key_padding_mask=kpm), dt, "cuda")
    flat = torch.randn(B * H * L * D + 1, generator=g).to(dt)
    q2 = flat[1:].view(B, H, L, D)                       # 2-byte offset: rows not 16-byte aligned
    assert q2.data_ptr() % 16
    k2, v2 = (torch.randn(B, H, L, D, generator=g).to(dt) for _ in range(2))
    check_against_oracle(q2, k2, v2, {}, dt, "cuda")


def test_rows_seeing_no_key_and_empty_sequences():
    """Rows with no visible key: out 0, lse -inf, zero gradients; Lq = 0, Lk = 0 and B = 0."""
    dt = torch.bfloat16
    q, k, v = (torch.randn(2, 2, 40, 16).to(dt).requires_grad_() for _ in range(3))
    kpm = torch.zeros(2, 40, dtype=torch.bool)
    kpm[1] = True
    lay = torch.ones(1, 3, 3, dtype=torch.bool)
    lay[0, 1] = False
    out, lse = effattn.attention(q, k, v, key_padding_mask=kpm, layout=BlockLayout(lay, 16), return_lse=True,
                                 backend="cuda")
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())
    assert torch.equal(out[0, :, 16:32], torch.zeros_like(out[0, :, 16:32]))
    assert bool((lse[0, :, 16:32] == -math.inf).all()) and bool(torch.isfinite(lse[0, :, :16]).all())
    grads = torch.autograd.grad(out.float().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), (q, k, v))
    assert not any(torch.isnan(g).any() for g in grads)
    for gr in grads[:2]:                                 # dq, dk of the fully padded batch entry
        assert torch.equal(gr[1], torch.zeros_like(gr[1]))
    for B, Lq, Lk in ((1, 0, 24), (1, 24, 0), (0, 24, 24)):
        leaves = [torch.randn(B, 2, L, 16).to(dt).requires_grad_() for L in (Lq, Lk, Lk)]
        out, lse = effattn.attention(*leaves, causal=True, return_lse=True, backend="cuda")
        assert out.shape == (B, 2, Lq, 16) and torch.equal(out, torch.zeros_like(out))
        assert bool((lse == -math.inf).all())
        for gr, t in zip(torch.autograd.grad(out.float().sum(), leaves, allow_unused=True), leaves):
            assert gr.shape == t.shape and torch.equal(gr, torch.zeros_like(gr))


# --------------------------------------------------------------------------------- determinism

def test_ops_take_only_the_normalized_window(emulation):
    """The window rule has one home (effattn/visibility.py: a window wider than the sequences is no
    window, -1): the C++ ops only check it and name the argument; the public call normalizes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, L, 16, generator=g).half() for L in (5, 7, 7))
    assert torch.equal(effattn.attention(q, k, v, window=(100, 100), backend="cuda"),
                       effattn.attention(q, k, v, backend="cuda"))
    fwd_args = (None, None, 0, 0, None, 0, None, 0.25, 0.0)       # no mask, layout or dropout
    dec_args = (None, None, 0, 0, None, 0, 0.25)
    for left, right, name in ((6, -1, "window_left"), (-1, 4, "window_right"), (-2, -1, "window_left")):
        with pytest.raises(RuntimeError, match=f"{name} must be -1 \\(no window\\) or in"):
            emulation.attention_fwd(q, k, v, *fwd_args, left, right)
        with pytest.raises(RuntimeError, match=name):
            emulation.attention_decode(q, k, v, *dec_args, left, right, 1)
    out, _ = emulation.attention_fwd(q, k, v, *fwd_args, 5, 3)      # the widest windows that still bound
    assert torch.equal(out, effattn.attention(q, k, v, window=(5, 3), backend="cuda"))


def test_schedules_give_bitwise_identical_results(emulation):
    """No result depends on the order threads run in (a race would): forward and backward under
    lockstep, warp-serial and reversed warp-serial agree bit for bit, with every feature on."""
    B, H, Hkv, L, D = 1, 4, 2, 70, 32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, D, generator=g).bfloat16()
    k, v = (torch.randn(B, Hkv, L, D, generator=g).bfloat16() for _ in range(2))
    layout = BlockLayout(torch.rand(H, 3, 3, generator=g) < 0.7, 32)
    kpm = torch.rand(B, L, generator=g) < 0.2
    go = torch.randn(B, H, L, D, generator=g).bfloat16()
    runs = []
    for s in (0, 1, 2):
        emulation.emu_set_schedule(s)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(9)
        out = effattn.attention(*leaves, causal=True, window=20, layout=layout, key_padding_mask=kpm,
                                dropout_p=0.2, backend="cuda")
        runs.append((out,) + torch.autograd.grad(out, leaves, go))
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- dropout

DROP_SHAPE = (1, 4, 2, 40, 56, 16)     # B, H, Hkv, Lq, Lk, D
DROP_P, DROP_KW = 0.25, dict(window=(30, 4))


def drop_inputs():
    B, H, Hkv, Lq, Lk, D = DROP_SHAPE
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g), g


def keep_mask(backend, dt, q, k, seed=2024):
    """The dropout keep-mask `backend`'s forward draws under torch seed `seed`, read off its output with
    V = identity: out[i, j] = P_ij M_ij / (1 - p)."""
    B, Hkv, Lk = k.shape[:3]
    eye = torch.eye(Lk).expand(B, Hkv, Lk, Lk).contiguous()
    torch.manual_seed(seed)
    return effattn.attention(q.to(dt), k.to(dt), eye.to(dt), dropout_p=DROP_P, backend=backend, **DROP_KW) != 0


def test_dropout_keep_mask_equals_the_triton_kernels_bit_for_bit():
    """The same torch seed gives the same seed tensor, and the CUDA kernels' Philox counters are the
    Triton kernels': the masks are identical."""
    rt = pytest.importorskip("effattn.backends.triton.runtime")
    if rt.triton is None or rt._available(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter is not usable here")
    q, k, _ = drop_inputs()
    assert torch.equal(keep_mask("cuda", torch.bfloat16, q, k), keep_mask("triton", torch.float32, q, k))


def philox_first_word(key: int, c0, c1, c2, c3):
    """An independent model of the counter-based generator the kernels draw from: Philox4x32 with 10
    rounds (Salmon, Moraes, Dror, Shaw, SC'11), the first of its four output words, on numpy uint64
    arrays of 32-bit words (a product of two fits in 64 bits). Round r keys with the 64-bit `key`'s low
    and high words plus r times the Weyl constants."""
    low = np.uint64(0xFFFFFFFF)
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32 & 0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & low for c in (c0, c1, c2, c3))
    for _ in range(10):
        a, b = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (b >> np.uint64(32)) ^ c1 ^ k0, b & low, (a >> np.uint64(32)) ^ c3 ^ k1, a & low
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0


def test_dropout_keep_mask_equals_a_philox_model_without_triton():
    """Without Triton: the CUDA forward's keep-mask is Philox4x32-10 of the call's key (the seed tensor
    the torch seed draws, effattn.numerics.philox_key) at counter (query row, key, b * H + h, 0), kept
    where the first word's top 24 bits reach the threshold, on every visible pair (GQA: the query head's
    index). A mistake the forward and the backward share (counter order, round keys, head index), which
    the gradient test below cannot see, fails here."""
    q, k, _ = drop_inputs()
    B, H, _, Lq, Lk, _ = DROP_SHAPE
    mask = keep_mask("cuda", torch.bfloat16, q, k)
    torch.manual_seed(2024)
    key = philox_key(draw_seed())
    i, j = np.meshgrid(np.arange(Lq), np.arange(Lk), indexing="ij")
    bh = np.arange(B * H).reshape(B, H, 1, 1)
    word = philox_first_word(key, np.broadcast_to(i, (B, H, Lq, Lk)), j, bh, 0)
    keep = torch.from_numpy((word >> np.uint64(8)).astype(np.int64) >= drop_threshold(DROP_P))
    eye = torch.eye(Lk).expand(B, DROP_SHAPE[2], Lk, Lk).double()
    probs, _ = naive_attention(q.double(), k.double(), eye, **DROP_KW)
    visible = probs > 0
    assert visible.sum() > 1000 and 0.6 < keep[visible].double().mean().item() < 0.9
    assert torch.equal(mask, keep & visible)


def test_dropout_gradients_follow_the_forwards_keep_mask(backward):
    """Without Triton: the keep-mask read off the CUDA forward keeps only visible pairs, about 1 - p of
    them, and the backward's gradients (dK/dV and dQ regenerate it from their own Philox counters)
    match float64 with that mask: a backward pass whose counters differ from the forward's fails."""
    q, k, g = drop_inputs()
    mask = keep_mask("cuda", torch.bfloat16, q, k)
    eye = torch.eye(k.shape[2]).expand(*k.shape[:3], k.shape[2]).double()
    probs, _ = naive_attention(q.double(), k.double(), eye, **DROP_KW)
    visible = probs > 0
    assert not (mask & ~visible).any()
    frac = mask[visible].double().mean().item()
    assert abs(frac - (1 - DROP_P)) < 0.04, frac
    dt = torch.float16
    v = torch.randn(*k.shape[:3], 24, generator=g).to(dt)
    leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(2024)
    out = effattn.attention(*leaves, dropout_p=DROP_P, backend="cuda", **DROP_KW)
    rl = [t.detach().double().requires_grad_() for t in leaves]
    ref, _ = naive_attention(*rl, dropout_keep=mask, dropout_p=DROP_P, **DROP_KW)
    ll = [t.detach().requires_grad_() for t in leaves]
    low, _ = naive_attention(*ll, dtype=dt, dropout_keep=mask, dropout_p=DROP_P, **DROP_KW)
    judge(out, ref, low, 2, dt, "out")
    go = torch.randn(out.shape, generator=g).to(dt)
    for name, a, b, c in zip("qkv", torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, rl, go.double()),
                             torch.autograd.grad(low, ll, go)):
        judge(a, b, c, 3, dt, f"d{name}")


def test_running_max_grows_at_every_key_tile():
    """Scores that rise with the key index make every key tile raise each row's running maximum, so
    every tile rescales the output accumulators (alpha < 1): an accumulator left unscaled fails (a
    mutation the random cases missed: the maximum seldom moves there)."""
    g = torch.Generator().manual_seed(4)
    L, D = 200, 16
    q = torch.ones(1, 2, L, D).half()
    k = (torch.linspace(0, 3, L).view(1, 1, L, 1) * torch.ones(1, 2, L, D) / 4).half()
    v = torch.randn(1, 2, L, D, generator=g).half()
    for kw in (dict(), dict(causal=True)):
        check_against_oracle(q, k, v, kw, torch.float16, "cuda")


# ------------------------------------------------------------------------------------- barriers

def test_barrier_removal_is_caught_under_the_default_schedule(backward):
    """Forward and backward over three query and key tiles, with partial tiles (the zeroing of unseen
    keys between barriers) and key padding, under the emulator's default schedule (warp-serial: a
    warp runs on to its next barrier, so without a barrier it overwrites a tile the other warps still
    read; lockstep hides that). csrc/emu/mutate.py removes each barrier of the tile loops in turn:
    this test fails on every one."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 150, 32, generator=g).half() for _ in range(3))
    kpm = torch.rand(1, 150, generator=g) < 0.2
    for kw in (dict(causal=True), dict(key_padding_mask=kpm)):
        check_against_oracle(q, k, v, kw, torch.float16, "cuda")


# ---------------------------------------------------------------- window edges at every residue

# Whether a key tile is full or partial for a query tile is decided from the window's edge rows
# (key_schedule / query_schedule in csrc/attention/common.cuh); an off-by-one there makes one key
# leak into one row only when an edge falls at one residue modulo the tile size. Lq = 100 (query
# tiles ending at rows 63 and 99), Lk = 128 (offset 28): window (28 + i, i) for i in 0..63 puts the
# left edge of each query tile's last row, the right edge of its first row, and the edges of every
# key tile seen from the backward's side at each residue modulo 64 (every tile of these kernels at
# this head dim is 64 long). fp16 and near-uniform scores keep a leaked key (about 1/100 of a row's
# weight) far above the rule's tolerance. The forward's query tiles are 128 rows (one tile of 100 rows
# here): no window (28 + i, i) holds a whole key tile for all of them, so its full-tile test is only
# reached by the one-sided windows below (mutation window-left-full-tile survives this sweep through
# the forward and the fused backward, CI's part of it).
RESIDUE_SHIFTS = range(64)
RESIDUES_ONE_SIDED = range(64)


def residue_inputs(D):
    g = torch.Generator().manual_seed(11)
    q, k = (0.25 * torch.randn(1, 1, L, D, generator=g) for L in (100, 128))
    v = torch.randn(1, 1, 128, D, generator=g)
    return q.half(), k.half(), v.half()


def test_window_edges_at_every_tile_residue_forward_and_backward(backward):
    q, k, v = residue_inputs(16)
    for i in RESIDUE_SHIFTS:
        check_against_oracle(q, k, v, dict(window=(28 + i, i)), torch.float16, "cuda")


def test_one_sided_window_edges_at_every_tile_residue(backward):
    """The coupled windows above make the tile at a query tile's right edge partial from the left too,
    so a right bound one too far in the full-tile test (`fhi` in key_schedule) hid there (found by
    csrc/emu/mutate.py). One-sided windows put each edge alone at every residue: right-only (no left
    bound) and left-only (no right bound), forward and backward."""
    q, k, v = residue_inputs(16)
    for i in RESIDUES_ONE_SIDED:
        for window in ((1000, i), (i, 1000)):
            check_against_oracle(q, k, v, dict(window=window), torch.float16, "cuda")


def test_window_edges_at_every_tile_residue_hopper_forward(monkeypatch):
    """The same sweep through the Hopper forward (head-dim bucket 64; the TMA kernel's kWindow instance: one
    128-key tile, both window edges partial inside it), forward only."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    q, k, v = residue_inputs(40)
    assert "Hopper wgmma" in str(effattn.explain(q, k, v, window=(28, 0)))
    for i in RESIDUE_SHIFTS:
        kw = dict(window=(28 + i, i))
        out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kw)
        ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kw)
        low, _ = naive_attention(q, k, v, dtype=torch.float16, **kw)
        judge(out, ref, low, 2, torch.float16, f"out, window {kw['window']}")
        assert (lse.double() - ref_lse).abs().max().item() <= 1e-3, kw


@pytest.mark.parametrize("hopper", [False, True], ids=["mma.sync", "hopper"])
def test_each_mask_kind_instance_against_float64(hopper, monkeypatch):
    """The launcher runs one forward instance per mask kind (MaskKind in csrc/attention/common.cuh):
    kDense (no mask and Lk a multiple of the key tile: no mask code at all; a ragged Lq is fine),
    kWindow (a dense call with a ragged Lk), kCausal (causal, Lq != Lk; the Hopper forward's kWindow) and
    kAny (key padding). test_cuda_instances.py: every kind and dropout flag, and which instance ran."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1" if hopper else "0")
    g = torch.Generator().manual_seed(4)
    for Lq, Lk, kw in ((70, 128, {}), (70, 120, {}), (50, 128, dict(causal=True)), (64, 128, dict(kpm=0.3))):
        q = torch.randn(1, 2, Lq, 40, generator=g).half()
        k, v = (torch.randn(1, 2, Lk, 40, generator=g).half() for _ in range(2))
        kwargs = dict(kw)
        if "kpm" in kwargs:
            kwargs["key_padding_mask"] = torch.rand(1, Lk, generator=g) < kwargs.pop("kpm")
        check_against_oracle(q, k, v, kwargs, torch.float16, "cuda")


# -------------------------------------------------------------------------------- tile visits

# id -> (Lq, Lk, D, left, right, layout (bs, density) or None)
VISITS = {
    "causal-L200": (200, 200, 32, -1, 0, None),
    "causal-q70-k200": (70, 200, 32, -1, 0, None),
    "window-40-0-L250": (250, 250, 64, 40, 0, None),
    "window-7-70-q130-k190": (130, 190, 32, 7, 70, None),
    "dense-L130": (130, 130, 32, -1, -1, None),
    "layout-bs32-causal": (192, 192, 32, -1, 0, (32, 0.5)),
    "layout-bs64-window": (256, 200, 32, 60, 10, (64, 0.6)),
    "layout-bs128-D256": (128, 256, 256, -1, -1, (128, 0.5)),
    "causal-D128-q100-k160": (100, 160, 128, -1, 0, None),
    "layout-bs128-D64": (300, 260, 64, -1, -1, (128, 0.6)),
}


@pytest.mark.parametrize("case_id", list(VISITS))
def test_kernels_visit_exactly_the_planned_tiles(case_id, emulation, monkeypatch):
    """The emulation counts warp mma: each visited (query tile, key tile) pair costs every warp a
    fixed number of them (forward: Q K^T over D, P V over Dv; dK/dV: S^T, dP^T, dV, dK; dQ: S, dP,
    dQ), so the counts give the tiles each pass visited. They must be the pairs of the Triton
    backend's plan (`visited_tiles`, the code that builds the layout lists) for each pass's tiles."""
    monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", "0")        # the two passes' products (the fused kernel's:
                                                              # test_cuda_fused_bwd.py)
    from effattn.backends.cuda import resources
    from effattn.backends.cuda.attention.tiling import bucket, tiles
    from effattn.tiles import visited_tiles
    Lq, Lk, D, left, right, lay = VISITS[case_id]
    H = 2
    g = torch.Generator().manual_seed(1)
    layout = None
    if lay:
        bs, dens = lay
        layout = BlockLayout(torch.rand(H, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < dens, bs)
    q = torch.randn(1, H, Lq, D, generator=g).half().requires_grad_()
    k, v = (torch.randn(1, H, Lk, D, generator=g).half().requires_grad_() for _ in range(2))
    kw = {}
    if right == 0:
        kw = dict(causal=True, window=(left, 0)) if left >= 0 else dict(causal=True)
    elif left >= 0 or right >= 0:
        kw = dict(window=(left, right))

    def pairs(by_key, forward=False):
        bm, bn = tiles(D, D, by_key)
        if forward:                                           # the forward's tiles on this device
            # a layout on 128-row tiles through its lists' 128-row rows (fwd.cuh fwd_layout_wide)
            wide = layout is not None and resources.layout_wide(bucket(D, D), resources.device_limits(q.device),
                                                                False, False)
            bm = resources.fwd_rows(bucket(D, D), resources.device_limits(q.device), layout is not None and not wide)
            # 128 x 64 at head dim 128 (kDense: full key tiles of 64; launch.cuh kLongKeys)
            long_keys = wide or (layout is None and not (left < 0 and right < 0 and Lk % 64 == 32))
            bn = resources.fwd_key_tile(bucket(D, D), bm, resources.device_limits(q.device), long_keys)
        full, part = visited_tiles(Lq, Lk, bm, bn, left, right, layout.mask if layout else None,
                                   layout.block_size if layout else 0)
        return (full + part) * (1 if layout is not None else H), bm, bn

    steps = math.ceil(D / 16)                                 # 16-wide steps over D (= Dv here)
    split = 2 if D > 128 else 1                               # head dim 256: two column halves
    emulation.emu_stats()
    out = effattn.attention(q, k, v, layout=layout, backend="cuda", **kw)
    fwd = int(emulation.emu_stats()[1])
    n, bm, bn = pairs(False, forward=True)
    assert fwd == n * 4 * (bm // 64) * 2 * (bn // 16) * 2 * steps, (fwd, n)   # a warp: bm / 64 row blocks of 16
    n, _, bn = pairs(False)
    torch.autograd.grad(out.float().sum(), (q, k, v))
    bwd = int(emulation.emu_stats()[1])
    nk, bm_kv, _ = pairs(True)
    # per block half: S^T and dP^T over all of D, dV and dK over its half of the columns
    dkdv = nk * 4 * 2 * (bm_kv // 16) * (2 * steps * split + 2 * steps)
    dq = n * 4 * 2 * (bn // 16) * (2 * steps * split + steps)
    assert bwd == dkdv + dq, (bwd, dkdv, dq)


def test_ldmatrix_one_wavefront_per_phase_in_every_kernel(emulation):
    """Bank accounting of every ldmatrix the kernels issue (forward and backward, buckets 32 to
    256): one wavefront per 8-row phase, the XOR swizzle's promise."""
    for D in (24, 64, 128, 200):
        q, k, v = (torch.randn(1, 1, 40, D).bfloat16().requires_grad_() for _ in range(3))
        emulation.emu_stats()
        out = effattn.attention(q, k, v, causal=True, backend="cuda")
        torch.autograd.grad(out.float().sum(), (q, k, v))
        blocks, mma, phases, wavefronts, worst = emulation.emu_stats().tolist()
        assert phases > 0 and wavefronts == phases and worst == 1, (D, phases, wavefronts, worst)


# ------------------------------------------------------------------------------ ops and dispatch

def test_opcheck_and_compile(emulation):
    from effattn.backends.cuda.attention import ops
    dt = torch.bfloat16
    q = torch.randn(1, 4, 20, 8).to(dt).requires_grad_()
    k, v = (torch.randn(1, 2, 20, 8).to(dt).requires_grad_() for _ in range(2))
    kpm = torch.rand(1, 20) < 0.2
    lm = torch.rand(4, 2, 2) < 0.7
    torch.library.opcheck(ops.cuda_attention_fwd, (q, k, v, lm, 16, kpm, None, None, None, 0.3, 0.0, 4, 0))
    torch.library.opcheck(ops.cuda_attention_fwd, (q, k, v, None, 0, None, torch.tensor([3, 4]), None, None, 0.3, 0.2,
                                                 -1, -1))
    out, lse = ops.cuda_attention_fwd(q, k, v, None, 0, None, None, None, None, 0.3, 0.0, -1, 0)
    args = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(), out.detach(),
            lse.detach(), None, 0, None, None, None, None, 0.3, 0.0, -1, 0)
    torch.library.opcheck(ops.cuda_attention_bwd, args)
    # the C++ op itself (tile lists passed in)
    torch.library.opcheck(emulation.attention_fwd, (q.detach(), k.detach(), v.detach(), None, None, 0, 0, None, 0,
                                                    None, 0.3, 0.0, -1, 0))
    layout = BlockLayout(lm, 16)

    def f(q, k, v):
        return effattn.attention(q, k, v, causal=True, window=6, layout=layout, backend="cuda")

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    ref = f(q, k, v)
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(ref.float().sum(), (q, k, v))):
        assert torch.equal(a, b)


def test_dispatch_on_cpu_only_when_named_and_reasons():
    q = torch.randn(1, 2, 8, 16).bfloat16()
    assert effattn.explain(q, q, q).chosen != "cuda"
    with pytest.raises(RuntimeError, match="dtype float32 not served"):
        effattn.attention(q.float(), q.float(), q.float(), backend="cuda")


def test_explain_names_the_alignment_copies():
    q = torch.randn(1, 2, 8, 5).half()
    ex = effattn.explain(q, q, q, backend="cuda")
    assert ex.can_serve("cuda") and "copied into zero-padded 16-byte rows" in ex.notes["cuda"]
    assert "only when asked for by name" in ex.notes["cuda"]
    assert "copied" not in effattn.explain(*(torch.randn(1, 2, 8, 16).half() for _ in range(3))).notes.get("cuda", "")


def test_unavailable_without_the_switch(monkeypatch):
    from effattn.backends.cuda import _available
    monkeypatch.delenv("EFFATTN_CUDA_EMU")
    assert "EFFATTN_CUDA_EMU=1" in _available(torch.device("cpu"))
