"""The CUDA attention kernels' tiles (csrc/attention.h): the head-dim buckets they are compiled for,
the tile shapes of each pass, and a layout's tile lists for them (the shared tile plan of
`effattn.tiles`, which the Triton kernels read too)."""
from __future__ import annotations

from typing import Tuple

from ....tiles import layout_tile_lists  # the shared tile plan (packed full/partial lists)
from ....visibility import clamp_window

BLOCK_M = 64          # query rows per tile, every pass (csrc/attention.h: kBlockM)
HOPPER_TILES = (128, 64)   # the Hopper forward's (query, key) tile for layouts: the cp.async kernel's (FwdSm90Config)
HOPPER_TMA_TILES = (128, 128)   # the TMA kernel's, every instance (FwdTmaConfig, kFwdTmaKeyTile)
BUCKETS = (32, 64, 128, 256)
WIDE_ROWS = 128      # the mma.sync forward's 128-row query tiles (FwdConfig<HD, 32>): rows of their own in the lists


def bucket(D: int, Dv: int) -> int:
    """The head-dim bucket the kernels are compiled for: max(D, Dv) rounded up to 8, then to a bucket."""
    d = max(-(-D // 8) * 8, -(-Dv // 8) * 8)
    return next(b for b in BUCKETS if d <= b)


def tiles(D: int, Dv: int, by_key: bool) -> Tuple[int, int]:
    """(query tile, key tile) of the forward and dQ passes, or with `by_key` of the dK/dV pass
    (csrc/attention.h; FwdConfig / BwdConfig)."""
    hd = bucket(D, Dv)
    if by_key:
        return (32 if hd >= 128 else 64), 64
    return BLOCK_M, (32 if hd >= 256 else 64)


def layout_lists(q, k, v, layout_mask, layout_block, left, right, by_key, hopper=False, tma=False):
    """(lists, wf, layout_check) for a layout; (None, 0, 0) without one. ``hopper``: for the Hopper
    forward's tiles (HOPPER_TILES; with ``tma``, its TMA kernel's HOPPER_TMA_TILES: a 128-key tile over two
    64-key layout blocks is full only if both are, partial if either is)."""
    if layout_mask is None:
        return None, 0, 0
    Lq, Lk = q.shape[2], k.shape[2]
    left, right = clamp_window(left, right, Lq, Lk)
    bm, bn = (HOPPER_TMA_TILES if tma else HOPPER_TILES) if hopper else tiles(q.shape[3], v.shape[3], by_key)
    # the mma.sync forward's 128-row tiles' rows after the 64-row ones (csrc/attention/fwd.cuh fwd_layout_wide)
    wide = 0 if by_key or hopper else WIDE_ROWS
    lists, wf = layout_tile_lists(layout_mask, layout_block, Lq, Lk, bm, bn, left, right, by_key, wide)
    # partial tiles read the layout per element unless every pass's tiles nest in its blocks
    return lists, wf, int(layout_block % (HOPPER_TILES[0] if hopper else BLOCK_M) != 0)
