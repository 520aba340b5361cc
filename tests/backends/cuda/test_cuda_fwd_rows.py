"""The mma.sync forward's tile shapes (csrc/attention/fwd.cuh, FwdConfig): 128-row query tiles (4 warps of
32 rows, two m16 row blocks each) at head-dim buckets 32, 64, 128 (128 x 64 or 128 x 32 at 128), 64-row tiles
(16 rows per warp) at 256, with a layout at head dim 128 with key padding or dropout, and where two
128-row blocks do not fit an SM's shared memory; two barriers per key tile.
Run through the emulation against the float64 oracle, and bit for bit against the 64-row instance where the
key tiles are the same (each output element sums the same products in the same order; dropout draws per
element, so its keep-mask is the same at every tile shape)."""
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda import resources
from tests.core.test_attention import check_against_oracle

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]

# a device whose SM cannot hold two 128-row blocks at head dim 64 (2 x (32 + 1) KB) or 128 (2 x (48 + 1) KB)
SMALL_SM = 60 * 1024
# ... at head dim 128 only (every sm_80+ GPU has at least 99 KB: none of them runs 64-row tiles without a layout)
MID_SM = 80 * 1024


@pytest.fixture
def smem_limit():
    before = resources.set_emulated_smem(0)
    resources.set_emulated_smem(before)
    yield resources.set_emulated_smem
    resources.set_emulated_smem(before)


def forward_blocks(emulation, *args, **kw):
    """(out, lse, thread blocks the forward ran)."""
    emulation.emu_stats()
    out, lse = effattn.attention(*args, return_lse=True, backend="cuda", **kw)
    return out, lse, int(emulation.emu_stats()[0])


# id -> (B, H, Hkv, Lq, Lk, D, kwargs): several key tiles with a ragged last one, Lq not a multiple of 128
CASES = {
    "dense-q200-k150": (1, 2, 2, 200, 150, 32, {}),
    "dense-k-multiple-d64": (1, 1, 1, 130, 128, 64, {}),
    "causal-q150-k200-d128": (1, 1, 1, 150, 200, 128, dict(causal=True)),
    "window-gqa": (1, 4, 2, 200, 190, 40, dict(window=(50, 20))),
    "kpm-gqa": (2, 2, 1, 140, 150, 32, dict(kpm=0.3)),
    "causal-kpm-lq-gt-lk": (1, 2, 2, 200, 70, 64, dict(causal=True, kpm=0.2)),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_128_row_tiles_against_float64(case_id, emulation):
    """Forward, lse and the backward (which reads the forward's lse) against float64, on 128-row tiles (the
    block count says so)."""
    B, H, Hkv, Lq, Lk, D, kw = CASES[case_id]
    g = torch.Generator().manual_seed(hash(case_id) % 1000)
    q = torch.randn(B, H, Lq, D, generator=g).half()
    k, v = (torch.randn(B, Hkv, Lk, D, generator=g).half() for _ in range(2))
    kw = dict(kw)
    if "kpm" in kw:
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g) < kw.pop("kpm")
    _, _, blocks = forward_blocks(emulation, q, k, v, **kw)
    assert blocks == B * H * -(-Lq // 128), blocks
    check_against_oracle(q, k, v, kw, torch.float16, "cuda")


def test_128_rows_bitwise_equal_to_64_rows_every_kind_and_dropout(emulation, smem_limit):
    """Each mask kind (dense, window / ragged, key padding, dropout) at head dim 64 on 128-row tiles, then on
    a device whose SM holds one such block (the launcher takes 64-row tiles): outputs and lse bit for bit
    equal, dropout included."""
    g = torch.Generator().manual_seed(3)
    Lq, Lk, D = 200, 150, 64
    q = torch.randn(1, 2, Lq, D, generator=g).bfloat16()
    k, v = (torch.randn(1, 1, Lk, D, generator=g).bfloat16() for _ in range(2))
    kpm = torch.rand(1, Lk, generator=g) < 0.3
    for kw in (dict(), dict(causal=True), dict(window=(40, 10)), dict(key_padding_mask=kpm), dict(dropout_p=0.3),
               dict(causal=True, key_padding_mask=kpm, dropout_p=0.2)):
        torch.manual_seed(7)                             # the dropout seed tensor
        wide = forward_blocks(emulation, q, k, v, **kw)
        before = smem_limit(SMALL_SM)
        torch.manual_seed(7)
        narrow = forward_blocks(emulation, q, k, v, **kw)
        smem_limit(before)
        assert (wide[2], narrow[2]) == (2 * 2, 2 * 4), kw
        assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1]), kw


def test_head_dim_128_keep_mask_same_on_both_shapes(emulation, smem_limit):
    """Head dim 128 runs key tiles of 32 on 128-row tiles (64 on 64-row ones), so the sums differ in order;
    dropout's keep-mask, read off the output with V = identity, is the same bit for bit, and both shapes
    match float64."""
    g = torch.Generator().manual_seed(8)
    Lq, Lk = 150, 128
    q, k = (0.5 * torch.randn(1, 2, L, 128, generator=g) for L in (Lq, Lk))
    eye = torch.eye(Lk).expand(1, 2, Lk, Lk).contiguous()
    masks = []
    for limit in (None, MID_SM):
        before = smem_limit(limit) if limit else None
        torch.manual_seed(5)
        out, _, blocks = forward_blocks(emulation, q.half(), k.half(), eye.half(), dropout_p=0.25, causal=True)
        masks.append((out != 0, blocks))
        check_against_oracle(q.half(), k.half(), torch.randn(1, 2, Lk, 128, generator=g).half(), dict(causal=True),
                             torch.float16, "cuda")
        if before:
            smem_limit(before)
    assert [b for _, b in masks] == [2 * 2, 2 * 3]
    assert torch.equal(masks[0][0], masks[1][0]) and masks[0][0].any()


def test_layouts_and_head_dim_256_keep_64_rows(emulation):
    """A block layout of 32-row blocks with key padding at head dim 128 (kAny: its 128 x 32 tile reads no lists) and
    head dim 256 run the 64-row tiles, against float64."""
    from effattn.layouts import BlockLayout
    g = torch.Generator().manual_seed(5)
    kpm = torch.rand(1, 70, generator=g) < 0.2
    for D, Lq, kw in ((128, 70, dict(layout=BlockLayout(torch.rand(2, 3, 3, generator=g) < 0.6, 32), key_padding_mask=kpm)),
                      (256, 130, dict(causal=True))):
        q, k, v = (torch.randn(1, 2, Lq, D, generator=g).half() for _ in range(3))
        _, _, blocks = forward_blocks(emulation, q, k, v, **kw)
        assert blocks == 2 * -(-Lq // 64), (D, blocks)
        check_against_oracle(q, k, v, kw, torch.float16, "cuda")


def test_explain_names_the_tile(smem_limit):
    q = torch.randn(1, 2, 100, 128).half()
    assert ("query tiles of 128 rows (4 warps x 32), key tiles of 64 (two softmax steps of 32)"
            in str(effattn.explain(q, q, q, backend="cuda")))
    for kw in (dict(dropout_p=0.1), dict(key_padding_mask=torch.zeros(1, 100, dtype=torch.bool))):
        assert "query tiles of 128 rows (4 warps x 32), key tiles of 32" in str(effattn.explain(q, q, q, backend="cuda",
                                                                                                  **kw))
    q96 = torch.randn(1, 2, 96, 128).half()                # kDense with key tiles of 32 (96 % 64 == 32)
    assert "key tiles of 32" in str(effattn.explain(q96, q96, q96, backend="cuda"))
    from effattn.layouts import BlockLayout
    for D, bs, kw, words in ((64, 128, {}, "query tiles of 128 rows (4 warps x 32), key tiles of 64"),
                             (64, 64, {}, "query tiles of 128 rows"), (64, 128, dict(causal=True), "query tiles of 128 rows"),
                             (128, 128, {}, "query tiles of 128 rows (4 warps x 32), key tiles of 64 (two softmax"),
                             (128, 128, dict(dropout_p=0.1), "query tiles of 64 rows")):
        x = torch.randn(1, 1, 200, D).half()
        lay = BlockLayout(torch.ones(1, 2, 2, dtype=torch.bool), bs) if bs == 128 else BlockLayout(
            torch.ones(1, 4, 4, dtype=torch.bool), bs)
        assert words in str(effattn.explain(x, x, x, layout=lay, backend="cuda", **kw)), (D, bs, kw)
    before = smem_limit(99 * 1024)                         # sm_86 / sm_89 / sm_120: two 128 x 64 blocks do not fit
    assert "query tiles of 128 rows (4 warps x 32), key tiles of 32" in str(effattn.explain(q, q, q, backend="cuda"))
    smem_limit(before)
    before = smem_limit(MID_SM)
    assert "query tiles of 64 rows (4 warps x 16), key tiles of 64" in str(effattn.explain(q, q, q, backend="cuda"))
    q64 = torch.randn(1, 2, 100, 64).half()
    assert "query tiles of 128 rows" in str(effattn.explain(q64, q64, q64, backend="cuda"))
    smem_limit(before)
    for optin in (99 * 1024, 163 * 1024, 227 * 1024):      # sm_86 / sm_89 / sm_120, sm_80, sm_90 / sm_100
        limits = resources.Limits("x", optin, 65536)
        assert [resources.fwd_rows(hd, limits) for hd in (32, 64, 128, 256)] == [128, 128, 128, 64]
        assert resources.fwd_rows(64, limits, layout=True) == resources.fwd_rows(64, limits, terms=True) == 64
    mid = resources.Limits("x", MID_SM, 65536)
    assert [resources.fwd_rows(hd, mid) for hd in (32, 64, 128, 256)] == [128, 128, 64, 64]


def last_fwd_keys():
    """The emulation's record of the key tile the last forward ran (64: the 128 x 64 tile; 0: the instance's
    default), through the kernels' library (csrc/attention/launchers.cuh)."""
    import ctypes

    from effattn.backends.cuda import _ext
    return ctypes.CDLL(_ext.build_kernels()).effattn_emu_last_fwd_keys()


# id -> (Lq, Lk, kwargs, key tile of the call on a 227 KB device): kDense (Lk a multiple of 64, or of 32 only:
# kDense's full 32-key tiles), kCausal, kWindow (ragged Lk)
LONG_KEYS = {
    "dense": (130, 192, {}, 64),
    "dense-lk-96": (70, 96, {}, 0),
    "causal": (150, 200, dict(causal=True), 64),
    "window-ragged": (130, 170, dict(window=(40, 30)), 64),
}


@pytest.mark.parametrize("case_id", list(LONG_KEYS))
def test_head_dim_128_on_128_x_64_tiles(case_id, emulation, smem_limit):
    """Head dim 128 without dropout or key padding runs the 128 x 64 tile (two softmax steps of 32 keys per tile)
    where two such blocks fit an SM (the emulated H100), the 128 x 32 one on a 99 KB device: the record says which
    ran, and the two (and the general instance, kAny with dropout on 128 x 32) give the same bits: the softmax
    steps are the 32-key tiles' in the same order. Against float64 on the 128 x 64 tile."""
    from tests.backends.cuda.test_cuda_instances import kernels_record
    Lq, Lk, kw, keys = LONG_KEYS[case_id]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 1, Lq, 128, generator=g).half()
    k, v = (torch.randn(1, 1, Lk, 128, generator=g).half() for _ in range(2))
    out, lse, blocks = forward_blocks(emulation, q, k, v, **kw)
    assert (blocks, last_fwd_keys()) == (-(-Lq // 128), keys), (blocks, last_fwd_keys())
    before = smem_limit(99 * 1024)
    narrow = forward_blocks(emulation, q, k, v, **kw)
    smem_limit(before)
    assert (narrow[2], last_fwd_keys()) == (-(-Lq // 128), 0)
    _, general = kernels_record("fwd")
    general(1)
    try:
        ref = forward_blocks(emulation, q, k, v, **kw)
    finally:
        general(0)
    for o, l, _ in (narrow, ref):
        assert torch.equal(out, o) and torch.equal(lse, l)
    if case_id in ("causal", "window-ragged"):
        check_against_oracle(q, k, v, kw, torch.float16, "cuda")
        assert last_fwd_keys() == 64


# id -> (D, layout block, kwargs, (rows, key tile record) on the emulated H100): a layout takes 128-row tiles through
# its lists' 128-row tiles' rows (fwd.cuh fwd_layout_wide: any block size, any window), at head dim 128 on the
# 128 x 64 tile and without key padding (kLayout)
LAYOUT_TILES = {
    "bs128-d64": (64, 128, {}, (128, 0)),
    "bs128-d64-kpm": (64, 128, dict(kpm=0.3), (128, 0)),
    "bs256-d128": (128, 256, {}, (128, 64)),
    "bs128-d128-kpm": (128, 128, dict(kpm=0.3), (64, 0)),
    "bs128-d64-causal": (64, 128, dict(causal=True), (128, 0)),
}


@pytest.mark.parametrize("case_id", list(LAYOUT_TILES))
def test_layout_tiles_of_128_rows_where_blocks_allow(case_id, emulation, smem_limit):
    """A block layout's forward on 128-row tiles, 64 rows at head dim 128 with key padding (the block count and the
    key tile record say which ran); bitwise equal to the 64-row tiles (a device that holds one 128-row block per SM)
    where the key tiles and their order are the same (head dim 64, blocks of 128 rows, no window: both halves' lists
    are the tile's), else against float64."""
    D, bs, kw, (rows, keys) = LAYOUT_TILES[case_id]
    from effattn.layouts import BlockLayout
    g = torch.Generator().manual_seed(13)
    Lq, Lk = 260, 300                                      # ragged last query and key tiles
    kw = dict(kw)
    kw["layout"] = BlockLayout(torch.rand(2, -(-Lq // bs), -(-Lk // bs), generator=g) < 0.6, bs)
    q = torch.randn(1, 2, Lq, D, generator=g).half()
    k, v = (torch.randn(1, 2, Lk, D, generator=g).half() for _ in range(2))
    if "kpm" in kw:
        kw["key_padding_mask"] = torch.rand(1, Lk, generator=g) < kw.pop("kpm")
    out, lse, blocks = forward_blocks(emulation, q, k, v, **kw)
    assert (blocks, last_fwd_keys()) == (2 * -(-Lq // rows), keys), (blocks, last_fwd_keys())
    if D == 64 and rows == 128 and bs % 128 == 0 and "causal" not in kw:
        before = smem_limit(SMALL_SM)
        narrow = forward_blocks(emulation, q, k, v, **kw)
        smem_limit(before)
        assert narrow[2] == 2 * -(-Lq // 64)
        assert torch.equal(out, narrow[0]) and torch.equal(lse, narrow[1])
    else:                                                  # (bitwise the 64-row tiles above)
        check_against_oracle(q, k, v, kw, torch.float16, "cuda")


def _random_layout(H, Lq, Lk, bs, seed, empty_row=None):
    from effattn.layouts import BlockLayout
    m = torch.rand(H, -(-Lq // bs), -(-Lk // bs), generator=torch.Generator().manual_seed(seed)) < 0.5
    if empty_row is not None:
        m[:, empty_row] = False                            # its rows see no key: 0 and lse -inf
    return BlockLayout(m, bs)


def _builder(name, H, Lq, Lk):
    from effattn import layouts
    if name == "fixed":
        return layouts.fixed((Lq, Lk), 64, stride=3, summary=1, causal=True, num_heads=H, vary_heads=True)
    if name == "bigbird":
        return layouts.bigbird((Lq, Lk), 64, num_window_blocks=3, num_global_blocks=1, num_random_blocks=1, seed=2,
                               num_heads=H)
    return layouts.longformer((Lq, Lk), 64, window_blocks=1, global_blocks=(1,))


# id -> (B, H, Hkv, Lq, Lk, D, layout, kwargs, (rows, key tile record) on the emulated H100): layouts of 64-row
# (and 32-row) blocks on 128-row tiles through the union lists (fwd.cuh fwd_wide_lists): the Sparse Transformer /
# BigBird / Longformer builders, Lq = 64 x odd (a last 128-row tile with one live half), GQA, key padding (kAny's
# 128-row instance; batch 1 wholly padded: rows with no key), a window, a block row with no key, head dim 128 (the
# 128 x 64 tile, kLayout); key padding at head dim 128 keeps 64 rows (test_layouts_and_head_dim_256_keep_64_rows)
LAYOUT64 = {
    "fixed-gqa-d64": (1, 4, 2, 192, 192, 64, "fixed", {}, (128, 0)),
    "bigbird-kpm-d32": (2, 2, 2, 192, 230, 32, "bigbird", dict(kpm=0.3), (128, 0)),
    "longformer-window-d128": (1, 2, 2, 192, 192, 128, "longformer", dict(window=(90, 40)), (128, 64)),
    "bs64-empty-row-causal-d64": (1, 2, 1, 320, 250, 64, "empty", dict(causal=True), (128, 0)),
    "bs32-d64": (1, 2, 2, 192, 200, 64, "bs32", {}, (128, 0)),
}


@pytest.mark.parametrize("case_id", list(LAYOUT64))
def test_layouts_of_64_row_blocks_on_128_row_tiles(case_id, emulation):
    """Against float64 (outputs NaN-poisoned under the emulation; gradients too), on the tile the block count
    and the key-tile record say ran, and explain names it."""
    B, H, Hkv, Lq, Lk, D, name, kw, (rows, keys) = LAYOUT64[case_id]
    g = torch.Generator().manual_seed(17)
    kw = dict(kw)
    if name in ("empty", "bs32"):
        kw["layout"] = _random_layout(H, Lq, Lk, 64 if name == "empty" else 32, 3, 1 if name == "empty" else None)
    else:
        kw["layout"] = _builder(name, H, Lq, Lk)
    q = torch.randn(B, H, Lq, D, generator=g).half()
    k, v = (torch.randn(B, Hkv, Lk, D, generator=g).half() for _ in range(2))
    if "kpm" in kw:
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g) < kw.pop("kpm")
        if B > 1:
            kw["key_padding_mask"][B - 1] = True           # the last batch entry sees no key at all
    out, lse, blocks = forward_blocks(emulation, q, k, v, **kw)
    assert (blocks, last_fwd_keys()) == (B * H * -(-Lq // rows), keys), (blocks, last_fwd_keys())
    words = "each tile's key list is the union" if rows == 128 else "layout on 64-row tiles"
    assert words in str(effattn.explain(q, k, v, backend="cuda", **kw))
    from effattn.testing.oracle import naive_attention
    ref, ref_lse = naive_attention(q, k, v, **kw)
    seen = torch.isfinite(ref_lse)
    assert not seen.all() or name != "empty"               # the case has rows with no key
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen])) and torch.isinf(lse[~seen]).all()
    check_against_oracle(q, k, v, kw, torch.float16, "cuda")


def test_layout_of_64_row_blocks_with_dropout_on_128_row_tiles(emulation, smem_limit):
    """Dropout (kLayout's 128-row instance with dropout, head dim 64) on a Sparse Transformer layout: the keep-mask,
    read off the output with V = identity, is the 64-row tiles' bit for bit, and the output is float64's with it."""
    from effattn.testing.oracle import naive_attention
    g = torch.Generator().manual_seed(19)
    H, Lq, Lk, D, p = 2, 192, 192, 64, 0.25
    lay = _builder("fixed", H, Lq, Lk)
    q, k, v = (torch.randn(1, H, L, D, generator=g).half() for L in (Lq, Lk, Lk))
    eye = torch.eye(Lk).expand(1, H, Lk, Lk).half()
    masks = []
    for limit in (None, SMALL_SM):
        before = smem_limit(limit) if limit else None
        cols, blocks = [], []
        for c in range(0, Lk, D):                          # identity columns c.. c + 64: the same head-dim bucket
            torch.manual_seed(5)
            out, _, n = forward_blocks(emulation, q, k, eye[..., c:c + D].contiguous(), layout=lay, dropout_p=p)
            cols.append(out != 0)
            blocks.append(n)
        masks.append((torch.cat(cols, -1), blocks[0]))
        words = "do not fit an SM of this device" if limit else "each tile's key list is the union"
        assert words in str(effattn.explain(q, k, v, layout=lay, dropout_p=p, backend="cuda"))
        if before:
            smem_limit(before)
    assert [b for _, b in masks] == [H * 2, H * 3]
    keep = masks[0][0]
    assert torch.equal(keep, masks[1][0]) and keep.any()
    torch.manual_seed(5)
    out = effattn.attention(q, k, v, layout=lay, dropout_p=p, backend="cuda")
    # the keep-mask where a probability is 0 (invisible) reads as dropped: the same product
    ref, _ = naive_attention(q, k, v, layout=lay, dropout_keep=keep, dropout_p=p)
    assert (out.double() - ref).abs().max().item() < 2e-2
