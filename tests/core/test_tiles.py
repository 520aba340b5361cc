"""The tile plan (effattn/tiles.py) against a brute-force count from the token-level oracle mask.

The plan is plain torch: these tests need no kernel and no interpreter. The kernels' visit counts
are checked against the plan in tests/backends/triton/test_triton_attention.py.
"""
import gc
import math
import random

import pytest
import torch

from effattn import tiles
from effattn.layouts import BlockLayout
from effattn.testing.oracle import visibility


def rand_layout(H, Lq, Lk, bs, density, seed):
    g = torch.Generator().manual_seed(seed)
    return BlockLayout(torch.rand(H, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < density, bs)


def oracle_kwargs(left, right):
    """The oracle's keywords for a (left, right) window (-1: unbounded; causal is right = 0)."""
    if left < 0 and right < 0:
        return {}
    if right == 0 and left < 0:
        return dict(causal=True)
    return dict(window=(left if left >= 0 else 10**6, right if right >= 0 else 10**6))


def brute_force(Lq, Lk, bm, bn, left, right, layout):
    """(visible, full) bool (Hl, n_query_tiles, n_key_tiles) by inspecting every token of every tile."""
    tok = visibility(Lq, Lk, layout=layout, H=layout.num_heads if layout else 1, **oracle_kwargs(left, right))[0]
    n_rt, n_ct = math.ceil(Lq / bm), math.ceil(Lk / bn)
    visible = torch.zeros(tok.shape[0], n_rt, n_ct, dtype=torch.bool)
    full = torch.zeros_like(visible)
    for h in range(tok.shape[0]):
        for a in range(n_rt):
            for b in range(n_ct):
                blk = tok[h, a * bm:(a + 1) * bm, b * bn:(b + 1) * bn]
                visible[h, a, b] = bool(blk.any())
                full[h, a, b] = bool(blk.all()) and (b + 1) * bn <= Lk
    return visible, full


def random_case(rng):
    Lq, Lk = rng.randint(1, 90), rng.randint(1, 90)
    bm, bn = rng.choice((16, 32, 64)), rng.choice((16, 32, 64))
    left, right = rng.choice((-1, 0, 3, 17, 40)), rng.choice((-1, 0, 5, 20))
    layout = None
    if rng.random() < 0.5:
        layout = rand_layout(rng.choice((1, 2)), Lq, Lk, rng.choice((8, 16, 24, 48, 64)), rng.uniform(0.2, 0.9),
                             seed=rng.randint(0, 10**6))
    return Lq, Lk, bm, bn, left, right, layout


@pytest.mark.parametrize("seed", range(4))
def test_tile_pairs_equal_a_brute_force_count(seed):
    """Random lengths, tiles, windows and layouts (tiles nested in layout blocks or straddling them):
    the plan's visible / full grids and their counts equal the token-by-token brute force."""
    rng = random.Random(seed)
    for _ in range(12):
        Lq, Lk, bm, bn, left, right, layout = case = random_case(rng)
        lm, lb = (layout.mask, layout.block_size) if layout else (None, 0)
        visible, full = tiles.tile_pairs(Lq, Lk, bm, bn, left, right, lm, lb)
        want_visible, want_full = brute_force(*case)
        assert torch.equal(visible, want_visible), case
        assert torch.equal(full, want_full), case
        n_full, n_partial = tiles.visited_tiles(Lq, Lk, bm, bn, left, right, lm, lb)
        assert (n_full, n_partial) == (int(want_full.sum()), int((want_visible & ~want_full).sum())), case


def test_visits_equal_closed_form_counts():
    """The plan counts what a closed form says: causal n(n+1)/2 tiles (n of them diagonal, partial),
    a causal window of 2 tiles: min(t, 2) + 1 tiles for query tile t, dense all, partial last column."""
    T, n = 16, 7
    assert tiles.visited_tiles(n * T, n * T, T, T, -1, 0) == (n * (n - 1) // 2, n)
    full, part = tiles.visited_tiles(n * T, n * T, T, T, 2 * T, 0)
    assert full + part == sum(min(t, 2) + 1 for t in range(n))
    assert part == n + (n - 2)             # the diagonal tile and the window's first tile are cut
    assert tiles.visited_tiles(5 * T, 5 * T + 3, T, T) == (5 * 5, 5)   # Lk not a multiple: last column partial
    layout = rand_layout(2, 80, 80, T, 0.4, seed=1)                     # layout block = tile: all full
    assert tiles.visited_tiles(80, 80, T, T, layout_mask=layout.mask, layout_block=T) == (int(layout.mask.sum()), 0)


@pytest.mark.parametrize("Lq,Lk,bs,bm,bn,left,right,per_head", [
    (64, 64, 16, 32, 32, -1, -1, False),
    (70, 50, 16, 16, 32, -1, 0, True),
    (90, 90, 48, 32, 16, 20, 0, True),
    (45, 100, 24, 16, 64, 30, 5, False),
    (128, 128, 128, 32, 16, -1, -1, True),
], ids=lambda x: str(x))
def test_layout_lists_match_brute_force(Lq, Lk, bs, bm, bn, left, right, per_head):
    """The packed lists (forward: key tiles per query tile; by_key: query tiles per key tile, the
    transpose) hold exactly the brute-force full and partial tiles, ascending, and are cached."""
    layout = rand_layout(3 if per_head else 1, Lq, Lk, bs, 0.45, seed=Lq + Lk)
    visible, full = brute_force(Lq, Lk, bm, bn, left, right, layout)
    for by_key in (False, True):
        lists = tiles.layout_tile_lists(layout.mask, bs, Lq, Lk, bm, bn, left, right, by_key)
        assert tiles.layout_tile_lists(layout.mask, bs, Lq, Lk, bm, bn, left, right, by_key) is lists, "not cached"
        assert lists.packed.dtype == torch.int32 and lists.packed.is_contiguous()
        vis, ful = (visible.transpose(1, 2), full.transpose(1, 2)) if by_key else (visible, full)
        for h in range(vis.shape[0]):
            for r in range(vis.shape[1]):
                want_full = torch.nonzero(ful[h, r]).flatten().tolist()
                want_partial = torch.nonzero(vis[h, r] & ~ful[h, r]).flatten().tolist()
                assert lists.row(h, r) == (want_full, want_partial), (h, r, by_key)


def test_layout_plan_cache_is_weak_and_keyed_on_everything():
    layout = rand_layout(1, 64, 64, 16, 0.5, seed=1)
    a = tiles.layout_tile_lists(layout.mask, 16, 64, 64, 32, 32, -1, -1, False)
    assert tiles.layout_tile_lists(layout.mask, 16, 64, 64, 32, 16, -1, -1, False) is not a      # other tiles
    assert tiles.layout_tile_lists(layout.mask, 16, 64, 64, 32, 32, -1, 0, False) is not a       # other window
    assert tiles.layout_plan(layout.mask).mask_u8.dtype == torch.uint8
    gc.collect()                 # earlier tests' layouts held only by garbage cycles go first, not in the count below
    before = len(tiles._LAYOUT_PLANS)
    del layout
    gc.collect()
    assert len(tiles._LAYOUT_PLANS) == before - 1


@pytest.mark.parametrize("Lq,Lk,bs,left,right", [(320, 300, 64, -1, -1), (192, 250, 64, -1, 0), (200, 200, 32, 90, 40)],
                         ids=lambda x: str(x))
def test_wide_rows_are_the_union_of_their_halves(Lq, Lk, bs, left, right):
    """``wide_m`` rows (the CUDA forward's 128-row tiles) after the 64-row ones, in one packing: each wide
    tile's key tiles are those either 64-row half lists, full only where both halves' lists have them full (a
    half past Lq counts as full), and the 64-row rows are unchanged; brute force for the wide ones too."""
    layout = rand_layout(2, Lq, Lk, bs, 0.45, seed=Lq)
    lists = tiles.layout_tile_lists(layout.mask, bs, Lq, Lk, 64, 64, left, right, False, wide_m=128)
    n64, n128 = -(-Lq // 64), -(-Lq // 128)
    assert lists.packed.shape[1] == n64 + n128
    vis128, full128 = brute_force(Lq, Lk, 128, 64, left, right, layout)
    for h in range(2):
        for r in range(n64):
            assert lists.row(h, r) == tiles.layout_tile_lists(layout.mask, bs, Lq, Lk, 64, 64, left, right).row(h, r)
        for mt in range(n128):
            halves = [lists.row(h, r) for r in (2 * mt, 2 * mt + 1) if r < n64]
            want_full = sorted(set.intersection(*(set(f) for f, _ in halves)))
            want_all = set().union(*(set(f) | set(p) for f, p in halves))
            want = (want_full, sorted(want_all - set(want_full)))
            assert lists.row(h, n64 + mt) == want, (h, mt)
            assert want == (torch.nonzero(full128[h, mt]).flatten().tolist(),
                            torch.nonzero(vis128[h, mt] & ~full128[h, mt]).flatten().tolist())
