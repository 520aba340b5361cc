"""The tile plan: which (query tile, key tile) pairs a fused attention kernel computes, and which of
them need an elementwise mask. Backend-neutral (plain torch); the Triton kernels read it and a CUDA
backend reads the same lists.

Visibility
----------
Query i sits at ``pos(i) = i + Lk - Lq`` (bottom-right) and may see key j iff
``pos(i) - left <= j <= pos(i) + right`` (``-1`` = unbounded; causal is ``right = 0``), and, with a
block layout of block size ``bs``, iff ``layout_mask[h, i // bs, j // bs]``.

Tiles
-----
A kernel cuts the queries into tiles of ``block_m`` rows and the keys into tiles of ``block_n``
keys (independent of the layout's block size). A (query tile, key tile) pair is

- **skipped** when no (i, j) in it is visible: the kernel never loads it;
- **full** when every (i, j) with ``i < Lq`` is visible and the key tile ends at or before ``Lk``:
  the kernel computes it with no elementwise mask;
- **partial** otherwise: the kernel masks it elementwise (window bounds, the layout's block of each
  element when tiles straddle layout blocks, the ragged end of ``Lk``)::

    Lq = Lk = 4, causal    tiles of 2 x 2
    1 . . .                [F]  .        F = full, P = partial, . = skipped
    1 1 . .                [F] [P]
    1 1 1 .
    1 1 1 1

Like FlexAttention's ``BlockMask`` (``full_kv_num_blocks`` / ``full_kv_indices`` beside
``kv_num_blocks`` / ``kv_indices``), full and partial tiles are listed separately so a kernel runs
two loops, the first without any masking code. The backward's dK/dV pass iterates the other way
(for each key tile, the query tiles that see it): its lists are the transpose (``by_key=True``,
FlexAttention's ``q_num_blocks`` / ``q_indices``).

Packed lists
------------
`TileLists.packed` is int32 ``(Hl, n_rows, 2 + full_slots + partial_slots)``; row ``r`` of head
``h`` (a query tile, or a key tile with ``by_key``) holds::

    [n_full, n_partial, full tile indices (full_slots entries), partial tile indices (rest)]

indices ascending; slots past the counts hold arbitrary indices that a kernel never reads. ``Hl`` is
the layout's head count (1 for a layout shared by all heads). `layout_tile_lists` builds them once per
(layout, lengths, tile sizes, window, direction) on the layout's device and caches them keyed
weakly on the layout's mask tensor: the first call syncs with the device (sizes are read back), the
following ones are a dictionary lookup.

Without a layout, kernels need no lists: the visible key tiles of a query tile are a run of partial
tiles, a run of full tiles and a run of partial tiles, computed in-kernel from the window bounds;
`tile_pairs` (``layout_mask=None``) gives the same sets, and the tests check kernels against it.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from .visibility import Rule

__all__ = ["TileLists", "LayoutPlan", "tile_pairs", "pack_lists", "layout_plan", "layout_tile_lists",
           "visited_tiles"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_pairs(Lq: int, Lk: int, block_m: int, block_n: int, left: int = -1, right: int = -1,
               layout_mask: Optional[Tensor] = None, layout_block: int = 0, device=None) -> Tuple[Tensor, Tensor]:
    """(visible, full): bool ``(Hl, ceil(Lq / block_m), ceil(Lk / block_n))`` for query tiles of
    ``block_m`` rows against key tiles of ``block_n`` keys (see the module docstring). ``Hl`` is the
    layout's head count (1 without one). On ``device`` (default: the layout's, else the CPU).

    Exact without a token-level mask: both axes are cut at tile and layout-block boundaries into
    cells, each inside one tile and one layout block; a pair of cells is decided analytically (the
    window) and by one layout entry, and each tile sums its cells."""
    if device is None:
        device = layout_mask.device if layout_mask is not None else "cpu"
    bs = layout_block if layout_mask is not None else 0
    r0, r1, rt, rb = _cells(Lq, block_m, bs, device)
    c0, c1, ct, cb = _cells(Lk, block_n, bs, device)
    r0, r1, rb = r0[:, None], r1[:, None], rb[:, None]
    rule = Rule(Lq, Lk, left, right)
    # rows r0..r1 see the key interval [first_key(r0), last_key(r1)] (their union) and all of them
    # see [first_key(r1), last_key(r0)] (their intersection)
    cell_any = torch.ones(r0.shape[0], c0.shape[0], dtype=torch.bool, device=device)
    cell_all = cell_any
    if left >= 0:
        cell_any = cell_any & (c1 >= rule.first_key(r0))
        cell_all = cell_all & (c0 >= rule.first_key(r1))
    if right >= 0:
        cell_any = cell_any & (c0 <= rule.last_key(r1))
        cell_all = cell_all & (c1 <= rule.last_key(r0))
    heads = layout_mask if layout_mask is not None else [None]
    n_rt, n_ct = cdiv(Lq, block_m), cdiv(Lk, block_n)
    ones = torch.ones(r0.shape[0], c0.shape[0], dtype=torch.int32, device=device)
    cells_per_tile = _sum_cells(ones, rt, ct, n_rt, n_ct)
    ends_in_lk = (torch.arange(n_ct, device=device) + 1) * block_n <= Lk
    visible, full = [], []
    for m in heads:
        a, f = cell_any, cell_all
        if m is not None:
            block_on = m[rb, cb[None, :]]
            a, f = a & block_on, f & block_on
        visible.append(_sum_cells(a.to(torch.int32), rt, ct, n_rt, n_ct) > 0)
        full.append((_sum_cells(f.to(torch.int32), rt, ct, n_rt, n_ct) == cells_per_tile) & ends_in_lk)
    visible = torch.stack(visible)
    return visible, torch.stack(full) & visible


def _cells(L: int, tile: int, block: int, device):
    """Cut [0, L) at multiples of `tile` and of `block` (0: none): first and last index of each
    cell, and the tile and block it lies in."""
    starts = torch.arange(0, L, tile, device=device)
    if block:
        starts = torch.unique(torch.cat([starts, torch.arange(0, L, block, device=device)]))
    ends = torch.cat([starts[1:], starts.new_tensor([L])])[:starts.shape[0]] - 1
    return starts, ends, starts // tile, starts // max(block, 1)


def _sum_cells(x: Tensor, row_tile: Tensor, col_tile: Tensor, n_rt: int, n_ct: int) -> Tensor:
    """Sums an int32 (cells, cells) grid into (n_rt, n_ct) tiles."""
    rows = torch.zeros(n_rt, x.shape[1], dtype=torch.int32, device=x.device).index_add_(0, row_tile, x)
    return torch.zeros(n_rt, n_ct, dtype=torch.int32, device=x.device).index_add_(1, col_tile, rows)


class TileLists(NamedTuple):
    """Packed full / partial tile lists (layout in the module docstring)."""
    packed: Tensor          # int32 (Hl, n_rows, 2 + full_slots + partial_slots), contiguous
    full_slots: int         # entries reserved for full-tile indices; partial ones start at 2 + full_slots

    def row(self, h: int, r: int) -> Tuple[List[int], List[int]]:
        """(full, partial) tile indices of row `r` of head `h`, as Python lists (host side, syncs)."""
        x = self.packed[h, r].tolist()
        return x[2:2 + x[0]], x[2 + self.full_slots:2 + self.full_slots + x[1]]


def pack_lists(visible: Tensor, full: Tensor) -> TileLists:
    """Packs bool ``(Hl, n_rows, n_cols)`` visible / full tile grids into `TileLists`, one row per
    ``n_rows`` entry (transpose the grids first for by-key lists)."""
    partial = visible & ~full
    parts = []
    for sel in (full, partial):
        count = sel.sum(-1, dtype=torch.int32)
        width = max(int(count.max()) if count.numel() else 0, 1)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)[..., :width]
        parts.append((count, order.to(torch.int32)))
    (n_full, idx_full), (n_partial, idx_partial) = parts
    packed = torch.cat([n_full[..., None], n_partial[..., None], idx_full, idx_partial], dim=-1).contiguous()
    return TileLists(packed, idx_full.shape[-1])


class LayoutPlan:
    """Per-layout data: the block mask as uint8 (for kernels that look up the layout block of each
    element of a partial tile), the packed tile lists per (layout block, Lq, Lk, tiles, window,
    direction), and `backend_cache`, where a backend keeps host data it derives per layout (launch
    metadata), freed with the layout."""

    def __init__(self, mask: Tensor):
        self.mask_u8 = mask.to(torch.uint8).contiguous()
        self.lists: Dict[tuple, TileLists] = {}
        self.backend_cache: Dict[tuple, object] = {}


_LAYOUT_PLANS = WeakTensorKeyDictionary()


def layout_plan(mask: Tensor) -> LayoutPlan:
    """The `LayoutPlan` of a layout's mask ``(Hl, nqb, nkb)``, built once and kept while the mask
    tensor lives."""
    plan = _LAYOUT_PLANS.get(mask)
    if plan is None:
        plan = _LAYOUT_PLANS[mask] = LayoutPlan(mask)
    return plan


def layout_tile_lists(mask: Tensor, layout_block: int, Lq: int, Lk: int, block_m: int, block_n: int,
                      left: int = -1, right: int = -1, by_key: bool = False, wide_m: int = 0) -> TileLists:
    """`TileLists` of the visible key tiles per query tile, or with ``by_key`` of the visible query
    tiles per key tile (the dK/dV pass), for a layout's ``mask`` (on its device). Cached per layout.
    ``wide_m`` (not with ``by_key``): after the ``ceil(Lq / block_m)`` rows, ``ceil(Lq / wide_m)`` rows
    for query tiles of ``wide_m`` rows against the same key tiles (one packing, so one ``full_slots``):
    a wide tile's key tile is full where it is full for every ``block_m`` tile in it, listed where
    any of them lists it."""
    plan = layout_plan(mask)
    key = (layout_block, Lq, Lk, block_m, block_n, left, right, by_key, wide_m)
    got = plan.lists.get(key)
    if got is None:
        visible, full = tile_pairs(Lq, Lk, block_m, block_n, left, right, mask, layout_block, mask.device)
        if by_key:
            visible, full = visible.transpose(1, 2), full.transpose(1, 2)
        elif wide_m:
            wv, wfull = tile_pairs(Lq, Lk, wide_m, block_n, left, right, mask, layout_block, mask.device)
            visible, full = torch.cat([visible, wv], 1), torch.cat([full, wfull], 1)
        got = plan.lists[key] = pack_lists(visible, full)
    return got


def visited_tiles(Lq: int, Lk: int, block_m: int, block_n: int, left: int = -1, right: int = -1,
                  layout_mask: Optional[Tensor] = None, layout_block: int = 0) -> Tuple[int, int]:
    """(full, partial): the numbers of (query tile, key tile) pairs one (batch, head) of the forward
    visits, summed over the layout's heads (Hl)."""
    visible, full = tile_pairs(Lq, Lk, block_m, block_n, left, right, layout_mask, layout_block)
    return int(full.sum()), int((visible & ~full).sum())
