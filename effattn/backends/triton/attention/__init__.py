"""The Triton backend for softmax attention: fused FlashAttention-2 kernels (Dao 2023), forward and
backward, with tile skipping for causal / window / block-sparse calls.

Layers, top to bottom:

1. ``@triton.jit`` kernels (math only): ``_fwd_kernel`` (FA-2 Alg. 1), ``_bwd_delta_kernel``
   (Delta = rowsum(dO * O), Alg. 2 line 4), ``_bwd_dkdv_kernel`` and ``_bwd_dq_kernel`` (Alg. 2 split
   in two passes so that no program accumulates into memory another one writes: deterministic).
2. launchers ``_fwd`` / ``_bwd``: allocate, build the tile plan, pick a config, launch.
3. ``torch.library`` ops ``effattn::triton_attention_fwd`` / ``_bwd`` with fake impls and autograd.
4. registration as backend ``"triton"``.

Which tiles a program visits ("skip, don't mask")
-------------------------------------------------
Query i sits at ``pos(i) = i + Lk - Lq`` (bottom-right) and may see key j iff
``pos(i) - left <= j <= pos(i) + right`` (``-1`` = unbounded; causal is ``right = 0``)::

    Lq = Lk = 4, causal            window (1, 0)          tiles of 2 x 2, causal
    1 . . .                        1 . . .                [F] .      F = full: no elementwise mask
    1 1 . .                        1 1 . .                [F] [P]    P = partial: masked in-kernel
    1 1 1 .                        . 1 1 .                 .  skipped
    1 1 1 1                        . . 1 1

Without a layout the key-tile range of a query tile (and the query-tile range of a key tile in the
dK/dV pass) is computed analytically in the kernel: a run of partial tiles, a run of full tiles, a
run of partial tiles. With a `BlockLayout`, the tile pairs some constraint allows are listed once
per (layout, lengths, tiles, window) on the device and cached, keyed on the layout's mask tensor
through a weakref: for each query tile the visible key tiles split into full and partial ones (and
the transposed lists for the dK/dV pass). Kernel tiles need not match the layout block: a partial
tile reads the layout block of each element. The last key tile is partial when ``Lk`` is not a
multiple of the tile. Work therefore scales with the number of visible tiles.

Numerics
--------
Scores and softmax statistics are fp32; products run on tensor cores in the input dtype. float32
inputs use IEEE fp32 dots unless torch's cuBLAS setting allows TF32
(``torch.backends.cuda.matmul.fp32_precision == "tf32"``, or the legacy ``allow_tf32``), in which
case they use TF32 (10-bit mantissa) like torch's own fp32 matmuls. The setting is read once per
call, at the forward, and the backward of that call uses the same. Dropout draws a Philox number
per (b, h, i, j) from the call's seed, so backward regenerates exactly the forward's mask, whatever
the tile sizes. No kernel uses atomics: every gradient element is written by one program.

Configs and reproducibility
---------------------------
Tile sizes are autotuned on the GPU: the first call of each kind (head dim, dtype, mask mode,
length bucket) times a handful of configs with ``triton.testing.do_bench`` (which synchronizes and
briefly allocates a 256 MB L2-flush buffer) and keeps the fastest for the process. Gradients are
bitwise reproducible for a fixed config. ``EFFATTN_TRITON_AUTOTUNE=0`` skips the timing and pins the
first config that fits, which makes results reproducible across processes too. Warm up outside
CUDA-graph capture (``torch.compile(mode="reduce-overhead")`` does so in its warm-up runs); a call
that meets an untuned kind while a stream is capturing takes the first config that fits, untimed,
and does not cache it.

Syncs and per-call work
-----------------------
No call waits for the GPU except: autotuning (first call per kind), and building a layout's tile
lists (first call per layout, lengths, tiles and window: ``torch.unique`` and two ``.max()`` read
sizes back, so that first call cannot happen during CUDA-graph capture); the lists are cached on
the device, keyed weakly on the layout's mask. The dropout seed is a CPU tensor (no sync).
Everything else per call is shape arithmetic in Python (about 25 us with the op dispatch, measured
without the launches) and the launches: one for the forward, three for the backward (Delta,
dK/dV, dQ).

Index arithmetic
----------------
Per-(batch, head) bases and per-tile row offsets are int64. Offsets inside a tile (row x stride +
column x stride) are int32 unless some tensor's span over its (length, head-dim) axes reaches 2**31
elements (e.g. a ``(L, B, H, D)`` tensor viewed as ``(B, H, L, D)`` with L*B*H*D > 2**31), in which
case the kernels are compiled with int64 offsets throughout (``IDX64``).
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from ...base import FEATURES, Backend, Capabilities, register
from ..runtime import _I32_MAX, _INTERPRET, _LOG2E, _available, _log, _next_pow2, _tf32_enabled, triton

if triton is not None:
    import triton.language as tl
    from triton.testing import do_bench

    from ..jit import cast, dot, i64, load_tile

# ---------------------------------------------------------------------------------------------
# Tile plan (Python, on the device): which (query tile, key tile) pairs are visible, which full.

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_pairs(Lq: int, Lk: int, block_m: int, block_n: int, left: int, right: int,
                layout_mask: Optional[Tensor], layout_block: int, device) -> Tuple[Tensor, Tensor]:
    """(visible, full): bool ``(Hl, ceil(Lq/block_m), ceil(Lk/block_n))`` for query tiles of
    ``block_m`` rows against key tiles of ``block_n`` keys. ``visible``: some pair (i, j) of the tile
    is allowed; ``full``: every pair with i < Lq is, and the tile ends before Lk, so the kernel needs
    no elementwise mask there. ``Hl`` is the layout's head count (1 without one).

    Exact, without a token-level mask: both axes are cut at tile and layout-block boundaries into
    cells, each inside one tile and one block; a cell pair is decided analytically (the window) and
    by one layout entry, and the tiles sum their cells."""
    bs = layout_block if layout_mask is not None else 0
    r0, r1, rt, rb = _cells(Lq, block_m, bs, device)
    c0, c1, ct, cb = _cells(Lk, block_n, bs, device)
    r0, r1, rb = r0[:, None], r1[:, None], rb[:, None]
    off = Lk - Lq
    # rows r0..r1 see the key interval [r0 + off - left, r1 + off + right] (their union) and all of
    # them see [r1 + off - left, r0 + off + right] (their intersection)
    cell_any = torch.ones(r0.shape[0], c0.shape[0], dtype=torch.bool, device=device)
    cell_all = cell_any
    if left >= 0:
        cell_any = cell_any & (c1 >= r0 + off - left)
        cell_all = cell_all & (c0 >= r1 + off - left)
    if right >= 0:
        cell_any = cell_any & (c0 <= r1 + off + right)
        cell_all = cell_all & (c1 <= r0 + off + right)
    heads = layout_mask if layout_mask is not None else [None]
    n_rt, n_ct = _cdiv(Lq, block_m), _cdiv(Lk, block_n)
    ones = torch.ones(r0.shape[0], c0.shape[0], dtype=torch.int32, device=device)
    cells_per_tile = _sum_cells(ones, rt, ct, n_rt, n_ct)
    ends_in_lk = (torch.arange(n_ct, device=device) + 1) * block_n <= Lk
    visible, full = [], []
    for m in heads:
        a, f = cell_any, cell_all
        if m is not None:
            on = m[rb, cb[None, :]]
            a, f = a & on, f & on
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


def _pack_lists(visible: Tensor, full: Tensor) -> Tuple[Tensor, int]:
    """Compressed rows: int32 ``(Hl, n_rows, 2 + Wf + Wp)`` holding ``[n_full, n_partial, full
    column indices (Wf slots), partial column indices (Wp slots)]``, indices ascending. Returns the
    tensor and Wf."""
    partial = visible & ~full
    parts = []
    for sel in (full, partial):
        count = sel.sum(-1, dtype=torch.int32)
        width = max(int(count.max()) if count.numel() else 0, 1)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)[..., :width]
        parts.append((count, order.to(torch.int32)))
    (nf, idx_f), (np_, idx_p) = parts
    packed = torch.cat([nf[..., None], np_[..., None], idx_f, idx_p], dim=-1).contiguous()
    return packed, idx_f.shape[-1]


class _LayoutPlan:
    """Per-layout device data: the block mask as uint8 and the packed tile lists per
    (Lq, Lk, tiles, window, direction)."""

    def __init__(self, mask: Tensor):
        self.mask_u8 = mask.to(torch.uint8).contiguous()
        self.lists: Dict[tuple, Tuple[Tensor, int]] = {}


_LAYOUT_PLANS = WeakTensorKeyDictionary()


def _layout_plan(mask: Tensor) -> _LayoutPlan:
    plan = _LAYOUT_PLANS.get(mask)
    if plan is None:
        plan = _LAYOUT_PLANS[mask] = _LayoutPlan(mask)
    return plan


def _layout_lists(mask: Tensor, bs: int, Lq: int, Lk: int, block_m: int, block_n: int, left: int,
                  right: int, by_key: bool) -> Tuple[Tensor, int]:
    """Packed lists (see `_pack_lists`) of visible key tiles per query tile, or with ``by_key`` of
    visible query tiles per key tile (the dK/dV pass). Cached per layout."""
    plan = _layout_plan(mask)
    key = (Lq, Lk, block_m, block_n, left, right, by_key)
    got = plan.lists.get(key)
    if got is None:
        visible, full = _tile_pairs(Lq, Lk, block_m, block_n, left, right, mask, bs, mask.device)
        if by_key:
            visible, full = visible.transpose(1, 2), full.transpose(1, 2)
        got = plan.lists[key] = _pack_lists(visible, full)
    return got


def visited_tiles(Lq: int, Lk: int, block_m: int, block_n: int, left: int = -1, right: int = -1,
                  layout_mask: Optional[Tensor] = None, layout_block: int = 0) -> Tuple[int, int]:
    """(full, partial) numbers of (query tile, key tile) pairs one (batch, head) of the forward
    visits, summed over the layout's heads (Hl). The same Python code that builds the kernels'
    tile lists; the in-kernel analytic bounds are tested against it."""
    device = layout_mask.device if layout_mask is not None else "cpu"
    visible, full = _tile_pairs(Lq, Lk, block_m, block_n, left, right, layout_mask, layout_block, device)
    return int(full.sum()), int((visible & ~full).sum())


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _visible(qi, kj, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr, IDX64: tl.constexpr):
        """Elementwise visibility for a partial tile. ``qi`` / ``kj``: query / key indices shaped to
        broadcast against each other ((M, 1) and (1, N), or transposed)."""
        ok = (qi < Lq) & (kj < Lk)
        pos = qi + off
        if HAS_LEFT:
            ok = ok & (kj >= pos - left)
        if HAS_RIGHT:
            ok = ok & (kj <= pos + right)
        if HAS_LAYOUT:
            blk = tl.load(lay_ptr + i64(qi // lay_bs, IDX64) * lay_nkb + kj // lay_bs, mask=ok, other=0)
            ok = ok & (blk != 0)
        return ok

    @triton.jit
    def _dropout_keep(seed, bh, qi, kj, drop_thresh):
        """Keep-mask from Philox(seed; counter = (i, j, b*H + h, 0)); keep with probability 1 - p."""
        c0 = (qi + kj * 0).to(tl.uint32)
        c1 = (kj + qi * 0).to(tl.uint32)
        c2 = c0 * 0 + bh.to(tl.uint32)
        r, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
        return (r >> 8).to(tl.int32) >= drop_thresh

    @triton.jit
    def _tile_index(row, base, i, lo, n_lo, hi, HAS_LAYOUT: tl.constexpr):
        """The i-th tile of a run: read from a packed list (`row`, entries from `base`) with a
        layout, else from the analytic ranges [lo, lo + n_lo) followed by [hi, ...)."""
        if HAS_LAYOUT:
            t = tl.load(row + base + i)
        else:
            t = tl.where(i < n_lo, lo + i, hi + i - n_lo)
        return t

    @triton.jit
    def _key_tile_range(m0, Lq, Lk, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Key tiles of query rows [m0, m0 + BLOCK_M): partial [t0, t1), full [t1, t2), partial [t2, t3)."""
        r1 = tl.minimum(m0 + BLOCK_M, Lq) - 1
        lo = 0          # union of the rows' key intervals: [lo, hi)
        hi = Lk
        flo = 0         # keys every row sees: [flo, fhi)
        fhi = Lk
        if HAS_LEFT:
            lo = tl.maximum(m0 + off - left, 0)
            flo = tl.maximum(r1 + off - left, 0)
        if HAS_RIGHT:
            hi = tl.maximum(tl.minimum(r1 + off + right + 1, Lk), 0)
            fhi = tl.maximum(tl.minimum(m0 + off + right + 1, Lk), 0)
        t0 = tl.minimum(lo, Lk) // BLOCK_N
        t3 = tl.where(hi > lo, (hi + BLOCK_N - 1) // BLOCK_N, t0)
        t1 = tl.minimum(tl.maximum((tl.minimum(flo, Lk) + BLOCK_N - 1) // BLOCK_N, t0), t3)
        t2 = tl.minimum(tl.maximum(fhi // BLOCK_N, t1), t3)
        return t0, t1, t2, t3

    @triton.jit
    def _key_tile_schedule(LISTS, h, pid_m, list_h, list_t, m0, Lq, Lk, off, left, right, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                           HAS_LAYOUT: tl.constexpr):
        """The key tiles query tile pid_m of head h visits, as `_tile_index` reads them: from the
        layout's cached lists (row, counts), or analytically from the causal/window bounds (runs
        partial [t0, t1), full [t1, t2), partial [t2, t3)). Shared by the forward and dQ kernels."""
        if HAS_LAYOUT:
            row = LISTS + h.to(tl.int64) * list_h + pid_m.to(tl.int64) * list_t
            n_full = tl.load(row)
            n_part = tl.load(row + 1)
            t0 = n_full * 0                                      # unused with a layout
            t1 = t0
            t2 = t0
        else:
            row = LISTS
            t0, t1, t2, t3 = _key_tile_range(m0, Lq, Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            n_full = t2 - t1
            n_part = (t1 - t0) + (t3 - t2)
        return row, n_full, n_part, t0, t1, t2

    @triton.jit
    def _kv_bases(K, V, KPM, LAY, b, h, hk, skb, skh, svb, svh, skpb, lay_h):
        """Base pointers of batch b's kv head hk (GQA: shared by its query heads), its padding row and
        query head h's layout."""
        return (K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh, V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh,
                KPM + b.to(tl.int64) * skpb, LAY + h.to(tl.int64) * lay_h)

    @triton.jit
    def _query_tile_range(n0, Lq, Lk, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Query tiles that see keys [n0, n0 + BLOCK_N): partial [t0, t1), full [t1, t2), partial [t2, t3).
        A query tile is full when every row < Lq sees every key of the tile (and the tile ends before Lk)."""
        n1 = tl.minimum(n0 + BLOCK_N, Lk) - 1
        lo = 0
        hi = Lq
        flo = 0
        fhi = Lq
        # i sees j iff j - off - right <= i <= j - off + left
        if HAS_RIGHT:
            lo = tl.maximum(n0 - off - right, 0)
            flo = tl.maximum(n1 - off - right, 0)
        if HAS_LEFT:
            hi = tl.maximum(tl.minimum(n1 - off + left + 1, Lq), 0)
            fhi = tl.maximum(tl.minimum(n0 - off + left + 1, Lq), 0)
        fhi = tl.where(n0 + BLOCK_N <= Lk, fhi, 0)
        t0 = tl.minimum(lo, Lq) // BLOCK_M
        t3 = tl.where(hi > lo, (hi + BLOCK_M - 1) // BLOCK_M, t0)
        t1 = tl.minimum(tl.maximum((tl.minimum(flo, Lq) + BLOCK_M - 1) // BLOCK_M, t0), t3)
        # the last query tile may end past Lq: it is full when its rows below Lq are
        t2 = tl.where(fhi == Lq, (fhi + BLOCK_M - 1) // BLOCK_M, fhi // BLOCK_M)
        t2 = tl.minimum(tl.maximum(t2, t1), t3)
        return t0, t1, t2, t3

    # --- forward ------------------------------------------------------------------------------

    @triton.jit
    def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                  skn, skd, svn, svd, skpn, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                  qk_scale, seed, bh, drop_thresh,
                  BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
                  HAS_RIGHT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                  DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                  DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, IDX64: tl.constexpr):
        """One key tile of the online softmax (FA-2 Alg. 1, lines 8-10)."""
        rel_n = i64(tl.arange(0, BLOCK_N), IDX64)
        offs_n = start_n + rel_n
        k_tile = k_base + start_n.to(tl.int64) * skn             # int64: long rows of a (B, L, H, D) view
        v_tile = v_base + start_n.to(tl.int64) * svn
        kt = load_tile(k_tile + offs_d[:, None] * skd + rel_n[None, :] * skn, offs_d, D, offs_n, Lk, PAD_D, MASK)
        s = dot(q, kt, DOT_PREC, UPCAST) * qk_scale            # S = Q K^T, in log2 units
        if MASK:
            ok = _visible(offs_m[:, None], offs_n[None, :], Lq, Lk, off, left, right, lay_ptr, lay_nkb,
                          lay_bs, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, IDX64)
            s = tl.where(ok, s, float("-inf"))
        if HAS_KPM:
            pad = tl.load(kpm_base + offs_n * skpn, mask=offs_n < Lk, other=1)
            s = tl.where(pad[None, :] == 0, s, float("-inf"))
        # m_new = max(m_old, rowmax(S)); a row that has seen nothing yet keeps m = -inf, and the
        # shift m_ref = 0 keeps exp2(-inf - m_ref) = 0 instead of NaN
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])                           # P~ = exp(S - m_new)
        alpha = tl.exp2(m_i - m_ref)                              # exp(m_old - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)                          # l = alpha l + rowsum(P~)
        if DROPOUT:  # the normalizer sums undropped probabilities; dropout acts on P V only
            p = tl.where(_dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], drop_thresh), p, 0.0)
        v = load_tile(v_tile + rel_n[:, None] * svn + offs_dv[None, :] * svd, offs_n, Lk, offs_dv, Dv, MASK, PAD_DV)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, UPCAST), v, DOT_PREC, UPCAST)  # O = alpha O + P~ V
        return acc, m_new, l_i

    @triton.jit(do_not_specialize=["seed"])
    def _fwd_kernel(Q, K, V, O, LSE, KPM, LAY, LISTS, COUNTS,
                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, skpb, skpn,
                    H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs, list_h, list_t, list_wf,
                    qk_scale, seed, drop_thresh, out_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HAS_LAYOUT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                    DROPOUT: tl.constexpr, COUNT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, IDX64: tl.constexpr):
        """O (B, H, Lq, Dv) and LSE (B, H, Lq), natural log, for one query tile of one (b, h).
        1-D grid of cdiv(Lq, BLOCK_M) * B * H programs, query tiles fastest (a grid's y and z sizes
        are limited to 65535, B * H is not)."""
        n_mt = tl.cdiv(Lq, BLOCK_M)
        pid = tl.program_id(0)
        pid_m = pid % n_mt
        bh = pid // n_mt
        b = bh // H
        h = bh % H
        hk = h // G                                               # GQA: the kv head of this q head
        m0 = pid_m * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
        offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
        rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
        q_ptrs = (Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + m0.to(tl.int64) * sqm + rel_m[:, None] * sqm
                  + offs_d[None, :] * sqd)
        q = load_tile(q_ptrs, offs_m, Lq, offs_d, D, True, PAD_D)
        k_base, v_base, kpm_base, lay_ptr = _kv_bases(K, V, KPM, LAY, b, h, hk, skb, skh, svb, svh, skpb, lay_h)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        row, n_full, n_part, t0, t1, t2 = _key_tile_schedule(LISTS, h, pid_m, list_h, list_t, m0, Lq, Lk, off, left,
                                                             right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT)
        for i in range(0, n_full):
            start_n = _tile_index(row, 2, i, t1, n_full, t1, HAS_LAYOUT) * BLOCK_N
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                                      skn, skd, svn, svd, skpn, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb,
                                      lay_bs, qk_scale, seed, bh, drop_thresh, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                                      LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, UPCAST, IDX64)
        for i in range(0, n_part):
            start_n = _tile_index(row, 2 + list_wf, i, t0, t1 - t0, t2, HAS_LAYOUT) * BLOCK_N
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                                      skn, skd, svn, svd, skpn, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb,
                                      lay_bs, qk_scale, seed, bh, drop_thresh, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                                      LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, UPCAST, IDX64)
        # FA-2 Alg. 1 lines 12-13: O = O / l, L = m + log(l); a row that saw no key: O = 0, L = -inf
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc * (out_scale / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
        row_ok = offs_m < Lq
        o_ptrs = O + (bh.to(tl.int64) * Lq + offs_m[:, None]) * Dv + offs_dv[None, :]
        tl.store(o_ptrs, cast(out, O.dtype.element_ty, UPCAST), mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
        tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)
        if COUNT:
            tl.store(COUNTS + bh * n_mt + pid_m, n_full + n_part)

    # --- backward -----------------------------------------------------------------------------

    @triton.jit
    def _bwd_delta_kernel(O, DO, DLSE, DELTA, sdob, sdoh, sdom, sdod, sdlb, sdlh, sdlm, H, Lq, Dv,
                          BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
                          IDX64: tl.constexpr):
        """Delta_i = rowsum(dO_i * O_i) - dlse_i (FA-2 Alg. 2 line 4; a gradient into lse enters as
        dS += dlse * P, i.e. as -dlse in Delta). O is contiguous. 1-D grid, like the forward's."""
        n_mt = tl.cdiv(Lq, BLOCK_M)
        pid = tl.program_id(0)
        pid_m = pid % n_mt
        bh = pid // n_mt
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
        offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
        ok = (offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv)
        o = tl.load(O + (bh.to(tl.int64) * Lq + offs_m[:, None]) * Dv + offs_dv[None, :], mask=ok, other=0.0)
        do = tl.load(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + (pid_m * BLOCK_M).to(tl.int64) * sdom
                     + rel_m[:, None] * sdom + offs_dv[None, :] * sdod, mask=ok, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if HAS_DLSE:
            dlse = tl.load(DLSE + b.to(tl.int64) * sdlb + h.to(tl.int64) * sdlh + i64(offs_m, IDX64) * sdlm,
                           mask=offs_m < Lq, other=0.0)
            delta -= dlse.to(tl.float32)
        tl.store(DELTA + bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)

    @triton.jit
    def _row_stats(lse_row, delta_row, offs_m, Lq):
        """A query tile's saved lse (in log2 units) and Delta for the backward passes. Rows past Lq or
        that saw no key get lse = +inf, so that P = exp2(S - lse) = 0 there."""
        lse = tl.load(lse_row + offs_m, mask=offs_m < Lq, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        return lse, tl.load(delta_row + offs_m, mask=offs_m < Lq, other=0.0)

    @triton.jit
    def _dkdv_tile(dk, dv, k, v, keep_k, q_base, do_base, lse_base, delta_base, start_m, offs_n, offs_d,
                   offs_dv, sqm, sqd, sdom, sdod, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                   qk_scale, seed, bh, drop_thresh, inv_keep,
                   BLOCK_M: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                   DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, IDX64: tl.constexpr):
        """dK, dV contributions of one query tile (FA-2 Alg. 2 lines 11-16, transposed: keys are rows)."""
        rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
        offs_m = start_m + rel_m
        q_tile = q_base + start_m.to(tl.int64) * sqm
        do_tile = do_base + start_m.to(tl.int64) * sdom
        q = load_tile(q_tile + rel_m[:, None] * sqm + offs_d[None, :] * sqd, offs_m, Lq, offs_d, D, True, PAD_D)
        do = load_tile(do_tile + rel_m[:, None] * sdom + offs_dv[None, :] * sdod, offs_m, Lq, offs_dv, Dv, True, PAD_DV)
        lse, delta = _row_stats(lse_base, delta_base, offs_m, Lq)
        st = dot(k, tl.trans(q), DOT_PREC, UPCAST) * qk_scale                 # S^T (BLOCK_N, BLOCK_M)
        if MASK:
            ok = _visible(offs_m[None, :], offs_n[:, None], Lq, Lk, off, left, right, lay_ptr, lay_nkb,
                          lay_bs, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, IDX64)
            st = tl.where(ok, st, float("-inf"))
        if HAS_KPM:
            st = tl.where(keep_k[:, None], st, float("-inf"))
        pt = tl.exp2(st - lse[None, :])                                          # P^T = exp(S - L)
        dpt = dot(v, tl.trans(do), DOT_PREC, UPCAST)                            # dP^T = V dO^T
        if DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], drop_thresh)
            pdt = tl.where(keep, pt * inv_keep, 0.0)
            dpt = tl.where(keep, dpt * inv_keep, 0.0)
        else:
            pdt = pt
        dv += dot(cast(pdt, do.dtype, UPCAST), do, DOT_PREC, UPCAST)         # dV += P_drop^T dO
        dst = pt * (dpt - delta[None, :])                                        # dS = P o (dP - Delta)
        dk += dot(cast(dst, q.dtype, UPCAST), q, DOT_PREC, UPCAST)           # dK += dS^T Q (scale later)
        return dk, dv

    @triton.jit(do_not_specialize=["seed"])
    def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, KPM, LAY, LISTS, COUNTS,
                         sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
                         sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, skpb, skpn,
                         H, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                         list_h, list_t, list_wf, scale, qk_scale, seed, drop_thresh, inv_keep,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                         HAS_LAYOUT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                         DROPOUT: tl.constexpr, COUNT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                         DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, IDX64: tl.constexpr):
        """dK, dV for one key tile of one (b, kv head): loops over the G query heads of the group and
        their visible query tiles, accumulating in registers (no atomics: deterministic). 1-D grid
        of cdiv(Lk, BLOCK_N) * B * Hkv programs, key tiles fastest."""
        n_nt = tl.cdiv(Lk, BLOCK_N)
        pid = tl.program_id(0)
        pid_n = pid % n_nt
        bhk = pid // n_nt
        b = bhk // Hkv
        hk = bhk % Hkv
        n0 = pid_n * BLOCK_N
        rel_n = i64(tl.arange(0, BLOCK_N), IDX64)
        offs_n = n0 + rel_n
        offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
        offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
        n0_64 = n0.to(tl.int64)
        k_ptrs = (K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + n0_64 * skn + rel_n[:, None] * skn
                  + offs_d[None, :] * skd)
        v_ptrs = (V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + n0_64 * svn + rel_n[:, None] * svn
                  + offs_dv[None, :] * svd)
        k = load_tile(k_ptrs, offs_n, Lk, offs_d, D, True, PAD_D)
        v = load_tile(v_ptrs, offs_n, Lk, offs_dv, Dv, True, PAD_DV)
        keep_k = offs_n < Lk
        if HAS_KPM:
            pad = tl.load(KPM + b.to(tl.int64) * skpb + offs_n * skpn, mask=offs_n < Lk, other=1)
            keep_k = pad == 0
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
        visits = tl.program_id(0) * 0                            # int32 counter (COUNT only)
        t0, t1, t2, t3 = _query_tile_range(n0, Lq, Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        n_full = t2 - t1
        n_part = (t1 - t0) + (t3 - t2)
        row = LISTS
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_base = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
            lse_base = LSE + bh.to(tl.int64) * Lq
            delta_base = DELTA + bh.to(tl.int64) * Lq
            lay_ptr = LAY + h.to(tl.int64) * lay_h
            if HAS_LAYOUT:
                row = LISTS + h.to(tl.int64) * list_h + pid_n.to(tl.int64) * list_t
                n_full = tl.load(row)
                n_part = tl.load(row + 1)
            for i in range(0, n_full):
                start_m = _tile_index(row, 2, i, t1, n_full, t1, HAS_LAYOUT) * BLOCK_M
                dk, dv = _dkdv_tile(dk, dv, k, v, keep_k, q_base, do_base, lse_base, delta_base, start_m, offs_n,
                                    offs_d, offs_dv, sqm, sqd, sdom, sdod, Lq, Lk, D, Dv, off, left, right, lay_ptr,
                                    lay_nkb, lay_bs, qk_scale, seed, bh, drop_thresh, inv_keep, BLOCK_M, False,
                                    HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, UPCAST,
                                    IDX64)
            for i in range(0, n_part):
                start_m = _tile_index(row, 2 + list_wf, i, t0, t1 - t0, t2, HAS_LAYOUT) * BLOCK_M
                dk, dv = _dkdv_tile(dk, dv, k, v, keep_k, q_base, do_base, lse_base, delta_base, start_m, offs_n,
                                    offs_d, offs_dv, sqm, sqd, sdom, sdod, Lq, Lk, D, Dv, off, left, right, lay_ptr,
                                    lay_nkb, lay_bs, qk_scale, seed, bh, drop_thresh, inv_keep, BLOCK_M, True,
                                    HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, UPCAST,
                                    IDX64)
            visits += n_full + n_part
        dk = dk * scale                                                          # dK = scale dS^T Q
        ok_k = offs_n[:, None] < Lk
        dk_ptrs = (DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + n0_64 * sdkn + rel_n[:, None] * sdkn
                   + offs_d[None, :] * sdkd)
        dv_ptrs = (DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + n0_64 * sdvn + rel_n[:, None] * sdvn
                   + offs_dv[None, :] * sdvd)
        tl.store(dk_ptrs, cast(dk, DK.dtype.element_ty, UPCAST), mask=ok_k & (offs_d[None, :] < D))
        tl.store(dv_ptrs, cast(dv, DV.dtype.element_ty, UPCAST), mask=ok_k & (offs_dv[None, :] < Dv))
        if COUNT:
            tl.store(COUNTS + bhk * n_nt + pid_n, visits)

    @triton.jit
    def _dq_tile(dq, q, do, lse, delta, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                 skn, skd, svn, svd, skpn, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                 qk_scale, seed, bh, drop_thresh, inv_keep,
                 BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                 DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                 DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, IDX64: tl.constexpr):
        """dQ contribution of one key tile (FA-2 Alg. 2 lines 11-15, 17: dQ += dS K)."""
        rel_n = i64(tl.arange(0, BLOCK_N), IDX64)
        offs_n = start_n + rel_n
        k_tile = k_base + start_n.to(tl.int64) * skn
        v_tile = v_base + start_n.to(tl.int64) * svn
        kt = load_tile(k_tile + offs_d[:, None] * skd + rel_n[None, :] * skn, offs_d, D, offs_n, Lk, PAD_D, MASK)
        vt = load_tile(v_tile + offs_dv[:, None] * svd + rel_n[None, :] * svn, offs_dv, Dv, offs_n, Lk, PAD_DV, MASK)
        s = dot(q, kt, DOT_PREC, UPCAST) * qk_scale
        if MASK:
            ok = _visible(offs_m[:, None], offs_n[None, :], Lq, Lk, off, left, right, lay_ptr, lay_nkb,
                          lay_bs, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, IDX64)
            s = tl.where(ok, s, float("-inf"))
        if HAS_KPM:
            pad = tl.load(kpm_base + offs_n * skpn, mask=offs_n < Lk, other=1)
            s = tl.where(pad[None, :] == 0, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        dp = dot(do, vt, DOT_PREC, UPCAST)
        if DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], drop_thresh)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += dot(cast(ds, kt.dtype, UPCAST), tl.trans(kt), DOT_PREC, UPCAST)
        return dq

    @triton.jit(do_not_specialize=["seed"])
    def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, KPM, LAY, LISTS,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
                       sdqb, sdqh, sdqm, sdqd, skpb, skpn,
                       H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs, list_h, list_t, list_wf,
                       scale, qk_scale, seed, drop_thresh, inv_keep,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       HAS_LAYOUT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                       DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
                       UPCAST: tl.constexpr, IDX64: tl.constexpr):
        """dQ for one query tile of one (b, h): loops over the visible key tiles, like the forward
        (and on the same 1-D grid)."""
        n_mt = tl.cdiv(Lq, BLOCK_M)
        pid = tl.program_id(0)
        pid_m = pid % n_mt
        bh = pid // n_mt
        b = bh // H
        h = bh % H
        hk = h // G
        m0 = pid_m * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
        offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
        rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
        m0_64 = m0.to(tl.int64)
        q = load_tile(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + m0_64 * sqm + rel_m[:, None] * sqm
                  + offs_d[None, :] * sqd, offs_m, Lq, offs_d, D, True, PAD_D)
        do = load_tile(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + m0_64 * sdom + rel_m[:, None] * sdom
                   + offs_dv[None, :] * sdod, offs_m, Lq, offs_dv, Dv, True, PAD_DV)
        lse, delta = _row_stats(LSE + bh.to(tl.int64) * Lq, DELTA + bh.to(tl.int64) * Lq, offs_m, Lq)
        k_base, v_base, kpm_base, lay_ptr = _kv_bases(K, V, KPM, LAY, b, h, hk, skb, skh, svb, svh, skpb, lay_h)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        row, n_full, n_part, t0, t1, t2 = _key_tile_schedule(LISTS, h, pid_m, list_h, list_t, m0, Lq, Lk, off, left,
                                                             right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT)
        for i in range(0, n_full):
            start_n = _tile_index(row, 2, i, t1, n_full, t1, HAS_LAYOUT) * BLOCK_N
            dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                          skn, skd, svn, svd, skpn, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                          qk_scale, seed, bh, drop_thresh, inv_keep, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                          LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, UPCAST, IDX64)
        for i in range(0, n_part):
            start_n = _tile_index(row, 2 + list_wf, i, t0, t1 - t0, t2, HAS_LAYOUT) * BLOCK_N
            dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                          skn, skd, svn, svd, skpn, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                          qk_scale, seed, bh, drop_thresh, inv_keep, BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                          LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, UPCAST, IDX64)
        dq = dq * scale
        dq_ptrs = (DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + m0_64 * sdqm + rel_m[:, None] * sdqm
                   + offs_d[None, :] * sdqd)
        tl.store(dq_ptrs, cast(dq, DQ.dtype.element_ty, UPCAST),
                 mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------
# Configs: (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M is the query tile, BLOCK_N the key
# tile, in every kernel. A handful per head-dim class (the larger of D and Dv, padded to a power of
# two) and element size; autotuned once per key on the GPU. The first of each list is the untimed
# default (EFFATTN_TRITON_AUTOTUNE=0, CUDA-graph capture). Chosen from offline compiles
# (`python -m benchmarks.kernel_resources`, tables in benchmarks/results/offline-sm90/) for sm_90
# and sm_80 with triton 3.6 (the H200's) and 3.9: the 2-byte lists fit sm_90's 227 KiB of shared
# memory, their first configs sm_80's 164 KiB. At D <= 128 every candidate uses wgmma on sm_90 and
# spills at most a stray register inside its tile loop in the causal case (the dK/dV pass holds two
# fp32 accumulators of BLOCK_N x D beside the transposed score tiles: 64 x 128 query x key tiles on
# 8 warps spill about 80 instructions per iteration at D = 128, so its query tile stays at 32
# there). At D = 256 the dK/dV pass runs on mma.sync (32-key tiles): every wgmma shape tried
# (64-key tiles) spills 48 to 600 instructions per iteration. 4-byte (fp32) inputs double the
# tiles' shared memory, so they get smaller tiles and fewer stages.
# tests/test_triton_attention.py::test_kernels_compile_for_sm90_and_sm80_offline checks the firsts.
_GPU_CONFIGS = {
    2: {"fwd": {64: [(128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
                128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
                256: [(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)]},
        "dkdv": {64: [(32, 128, 8, 2), (64, 128, 8, 1), (32, 128, 8, 3), (64, 64, 8, 1)],
                 128: [(32, 128, 8, 2), (32, 128, 8, 1), (16, 128, 8, 2), (32, 64, 8, 2)],
                 256: [(32, 32, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2)]},
        "dq": {64: [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
               128: [(128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
               256: [(64, 32, 8, 2), (32, 32, 4, 2), (64, 32, 4, 1)]}},
    4: {"fwd": {64: [(64, 64, 4, 2), (64, 32, 4, 2)],
                128: [(64, 32, 4, 2), (64, 64, 4, 2)],
                256: [(32, 32, 4, 2), (64, 32, 4, 1)]},
        "dkdv": {64: [(64, 64, 4, 2), (64, 128, 8, 2)],
                 128: [(32, 64, 4, 2), (32, 128, 8, 2)],
                 256: [(16, 32, 4, 1), (32, 32, 4, 2)]},
        "dq": {64: [(64, 64, 4, 3), (128, 64, 8, 2)],
               128: [(64, 32, 4, 2), (128, 32, 8, 2)],
               256: [(32, 32, 4, 2), (32, 32, 4, 1)]}},
}
# One config under the interpreter; tiles differ between passes so that the transposed tile
# plans are exercised with other sizes than the forward's.
_INTERPRET_CONFIGS = {"fwd": (32, 32, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
_TUNED: Dict[tuple, tuple] = {}

try:  # the compiler's "does not fit" (shared memory, registers); anything else is unexpected
    from triton.runtime.errors import OutOfResources as _OutOfResources
except ImportError:  # pragma: no cover
    _OutOfResources = ()


def _head_class(block_d: int) -> int:
    return 64 if block_d <= 64 else (128 if block_d <= 128 else 256)


def _candidates(kind: str, head_class: int, element_size: int):
    """The GPU configs tried for `kind` ("fwd", "dkdv", "dq"), best guess first."""
    return _GPU_CONFIGS[4 if element_size >= 4 else 2][kind][head_class]


def _delta_block(block_dv: int) -> int:
    """Rows per program of the Delta kernel: a (block, Dv) tile of O and of dO each; launched with
    Triton's default warps (4) and stages (3)."""
    return 32 if _INTERPRET or block_dv > 128 else 64


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch_tuned(kind: str, p: "_Problem", launch, device) -> None:
    """Launches `kind` with its config for this call's key, chosen once per process: the
    interpreter's; else the fastest candidate by ``do_bench``; with ``EFFATTN_TRITON_AUTOTUNE=0`` or
    while the stream is being captured into a CUDA graph, the first candidate that runs, untimed
    (not cached when capturing). Candidates the compiler or the GPU reject (e.g. out of shared
    memory for fp32 at head dim 256) are skipped and logged."""
    key = (kind,) + p.tune_key
    cfg = _TUNED.get(key)
    if cfg is None and _INTERPRET:
        cfg = _INTERPRET_CONFIGS[kind]
    if cfg is not None:
        launch(cfg)
        return
    capturing = _capturing(device)
    tune = not capturing and os.environ.get("EFFATTN_TRITON_AUTOTUNE", "1") != "0"
    timed, error = [], None
    for c in _candidates(kind, _head_class(max(p.block_d, p.block_dv)), p.element_size):
        try:
            if tune:
                timed.append((do_bench(lambda: launch(c), warmup=5, rep=20, return_mode="median"), c))
                continue
            launch(c)
        except Exception as e:  # noqa: BLE001 - a config that does not fit this GPU is skipped
            error = e
            (_log.info if isinstance(e, _OutOfResources) else _log.warning)(
                "effattn triton: %s config %s skipped for %s: %s: %s", kind, c, p.tune_key, type(e).__name__,
                str(e)[:300])
            continue
        if not capturing:
            _TUNED[key] = c
        return
    if not timed:
        raise RuntimeError(f"effattn triton backend: no {kind} config runs for {p.tune_key}") from error
    cfg = min(timed, key=lambda tc: tc[0])[1]
    _TUNED[key] = cfg
    launch(cfg)


# ---------------------------------------------------------------------------------------------
# Launchers

def _span(t: Optional[Tensor], dims) -> int:
    """Largest element offset within one (batch, head) slice of `t` along `dims`: the kernels'
    int32 in-tile offsets (row x stride + column x stride) stay at or below it."""
    if t is None:
        return 0
    return sum((t.shape[d] - 1) * abs(t.stride(d)) for d in dims if t.shape[d] > 0)


class _Problem:
    """Sizes and flags of a call, shared by the launchers (cheap to build: no device work)."""

    def __init__(self, q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32=False):
        self.B, self.H, self.Lq, self.D = q.shape
        self.Hkv, self.Lk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.H // self.Hkv
        self.off = self.Lk - self.Lq
        # a window wider than the sequences is no constraint: -1 keeps the kernels' int32 bound
        # arithmetic (pos + right + 1, ...) from overflowing for huge windows, and skips masking
        if left >= max(self.Lk - 1, 0):
            left = -1
        if right >= max(self.Lq - 1, 0):
            right = -1
        self.left, self.right = left, right
        self.block_d = max(16, _next_pow2(self.D))
        self.block_dv = max(16, _next_pow2(self.Dv))
        self.scale = scale
        self.qk_scale = scale * _LOG2E
        self.dropout_p = dropout_p
        if dropout_p > 0:
            s0, s1 = (int(x) for x in seed.tolist())                 # a CPU tensor: no GPU sync
            # one 64-bit Philox key; bit 62 set so that Triton always passes it as int64 (a value
            # below 2**31 would be specialized as int32 and compile a second kernel)
            self.seed = ((s0 << 31) ^ s1) | (1 << 62)
            self.drop_thresh = min(int(round(dropout_p * (1 << 24))), (1 << 24) - 1)
            self.inv_keep = 1.0 / (1.0 - dropout_p)
        else:
            self.seed, self.drop_thresh, self.inv_keep = 0, 0, 1.0
        self.layout_mask, self.layout_block = layout_mask, layout_block
        self.kpm = kpm.view(torch.uint8) if kpm is not None else None
        self.dot_prec = "tf32" if (tf32 and q.dtype == torch.float32 and not _INTERPRET) else "ieee"
        self.upcast = _INTERPRET and q.dtype == torch.bfloat16
        self.element_size = q.element_size()
        lay_per_head = 0
        if layout_mask is not None:
            plan = _layout_plan(layout_mask)
            self.lay = plan.mask_u8
            self.lay_h = plan.mask_u8.stride(0) if plan.mask_u8.shape[0] > 1 else 0
            self.lay_nkb = plan.mask_u8.shape[2]
            lay_per_head = plan.mask_u8.shape[1] * plan.mask_u8.shape[2]
        else:
            self.lay, self.lay_h, self.lay_nkb = None, 0, 1
        self.idx64 = max(_span(q, (2, 3)), _span(k, (2, 3)), _span(v, (2, 3)), _span(self.kpm, (1,)),
                         lay_per_head) > _I32_MAX
        # a layout's block size decides which tiles nest in its blocks (no per-element lookup)
        mode = f"layout{layout_block}" if layout_mask is not None else ("window" if left >= 0 else
                                                                        ("causal" if right == 0 else "dense"))
        # lengths bucketed separately: a decode call (Lq = 1) is not tuned like a prefill of its Lk
        self.tune_key = (self.block_d, self.block_dv, q.dtype, self.dot_prec, mode, dropout_p > 0,
                         kpm is not None, min(_next_pow2(self.Lq), 8192), min(_next_pow2(self.Lk), 8192))

    def widen(self, *tensors) -> None:
        """Switches to int64 in-tile offsets if one of the backward's extra tensors needs them."""
        self.idx64 = self.idx64 or max(_span(t, range(2, t.dim())) for t in tensors if t is not None) > _I32_MAX

    def lists(self, block_m, block_n, by_key):
        """(packed lists, list_h, list_t, list_wf) for the layout path; dummies without a layout."""
        if self.layout_mask is None:
            return None, 0, 0, 0
        packed, wf = _layout_lists(self.layout_mask, self.layout_block, self.Lq, self.Lk, block_m, block_n,
                                   self.left, self.right, by_key)
        return packed, (packed.stride(0) if packed.shape[0] > 1 else 0), packed.stride(1), wf

    def layout_mask_needed(self, block_m: int, block_n: int) -> bool:
        """Whether partial tiles must read the layout per element. Not when the kernel tiles nest in
        the layout's blocks (the block size a multiple of both): a listed tile then lies in one
        block that is on, and it is partial only through the window, causal or length bounds."""
        bs = self.layout_block
        return self.layout_mask is not None and (bs % block_m != 0 or bs % block_n != 0)

    def flags(self, cfg):
        block_m, block_n, warps, stages = cfg
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
                    HAS_LEFT=self.left >= 0, HAS_RIGHT=self.right >= 0,
                    HAS_LAYOUT=self.layout_mask is not None, LAYOUT_MASK=self.layout_mask_needed(block_m, block_n),
                    HAS_KPM=self.kpm is not None,
                    DROPOUT=self.dropout_p > 0, PAD_D=self.block_d != self.D, PAD_DV=self.block_dv != self.Dv,
                    DOT_PREC=self.dot_prec, UPCAST=self.upcast, IDX64=self.idx64,
                    num_warps=warps, num_stages=stages)


def _kpm_strides(p: _Problem):
    return (p.kpm.stride(0), p.kpm.stride(1)) if p.kpm is not None else (0, 0)


def _fwd(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32=False,
         config=None, counts=False):
    """out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq) fp32. With ``counts``, also an int32
    (B*H, n_query_tiles) tensor of the key tiles each program visited. Nothing is launched when
    there is no query row (Lq = 0 or B*H = 0); Lk = 0 launches and writes out = 0, lse = -inf."""
    p = _Problem(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32)
    out = torch.empty((p.B, p.H, p.Lq, p.Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    visits = [None]

    def launch(cfg):
        lists, list_h, list_t, list_wf = p.lists(cfg[0], cfg[1], by_key=False)
        n_mt = _cdiv(p.Lq, cfg[0])
        cnt = torch.zeros(p.B * p.H, n_mt, dtype=torch.int32, device=q.device) if counts else None
        _fwd_kernel[(n_mt * p.B * p.H,)](
            q, k, v, out, lse, _or(p.kpm, q), _or(p.lay, q), _or(lists, q), _or(cnt, q),
            *q.stride(), *k.stride(), *v.stride(), *_kpm_strides(p),
            p.H, p.G, p.Lq, p.Lk, p.D, p.Dv, p.off, p.left, p.right, p.lay_h, p.lay_nkb,
            max(p.layout_block, 1), list_h, list_t, list_wf, p.qk_scale, p.seed, p.drop_thresh,
            p.inv_keep, COUNT=counts, **p.flags(cfg))
        visits[0] = cnt

    if p.Lq > 0 and p.B * p.H > 0:
        with _on(q.device):
            if config is not None:
                launch(config)
            else:
                _launch_tuned("fwd", p, launch, q.device)
    return (out, lse, visits[0]) if counts else (out, lse)


def _bwd(dout, dlse, q, k, v, out, lse, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right,
         tf32=False, config_dkdv=None, config_dq=None, counts=False):
    """dq, dk, dv (same shapes and dtypes as q, k, v). With ``counts``, also the int32
    (B*Hkv, n_key_tiles) numbers of query tiles each dK/dV program visited (all G heads).
    `tf32` must be the forward's (the op's autograd passes it on)."""
    p = _Problem(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    visits = [None]
    if p.Lq == 0 or p.Lk == 0 or p.B * p.H == 0:       # no grid of size 0: nothing is launched
        for t in (dq, dk, dv):
            t.zero_()
        return (dq, dk, dv, visits[0]) if counts else (dq, dk, dv)
    out, lse = out.contiguous(), lse.contiguous()       # the kernels index them as the forward wrote them
    p.widen(dout, dq, dk, dv, dlse)
    delta = torch.empty((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    dl_strides = dlse.stride() if dlse is not None else (0, 0, 0)
    kps = _kpm_strides(p)

    def launch_dkdv(cfg):
        lists, list_h, list_t, list_wf = p.lists(cfg[0], cfg[1], by_key=True)
        n_nt = _cdiv(p.Lk, cfg[1])
        cnt = torch.zeros(p.B * p.Hkv, n_nt, dtype=torch.int32, device=q.device) if counts else None
        _bwd_dkdv_kernel[(n_nt * p.B * p.Hkv,)](
            q, k, v, dout, lse, delta, dk, dv, _or(p.kpm, q), _or(p.lay, q), _or(lists, q), _or(cnt, q),
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(), *kps,
            p.H, p.Hkv, p.G, p.Lq, p.Lk, p.D, p.Dv, p.off, p.left, p.right, p.lay_h, p.lay_nkb,
            max(p.layout_block, 1), list_h, list_t, list_wf, p.scale, p.qk_scale, p.seed, p.drop_thresh,
            p.inv_keep, COUNT=counts, **p.flags(cfg))
        visits[0] = cnt

    def launch_dq(cfg):
        lists, list_h, list_t, list_wf = p.lists(cfg[0], cfg[1], by_key=False)
        _bwd_dq_kernel[(_cdiv(p.Lq, cfg[0]) * p.B * p.H,)](
            q, k, v, dout, lse, delta, dq, _or(p.kpm, q), _or(p.lay, q), _or(lists, q),
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(), *kps,
            p.H, p.G, p.Lq, p.Lk, p.D, p.Dv, p.off, p.left, p.right, p.lay_h, p.lay_nkb,
            max(p.layout_block, 1), list_h, list_t, list_wf, p.scale, p.qk_scale, p.seed,
            p.drop_thresh, p.inv_keep, **p.flags(cfg))

    with _on(q.device):
        block = _delta_block(p.block_dv)
        _bwd_delta_kernel[(_cdiv(p.Lq, block) * p.B * p.H,)](
            out, dout, _or(dlse, lse), delta, *dout.stride(), *dl_strides, p.H, p.Lq, p.Dv,
            BLOCK_M=block, BLOCK_DV=p.block_dv, HAS_DLSE=dlse is not None, IDX64=p.idx64)
        if config_dkdv is not None:
            launch_dkdv(config_dkdv)
        else:
            _launch_tuned("dkdv", p, launch_dkdv, q.device)
        if config_dq is not None:
            launch_dq(config_dq)
        else:
            _launch_tuned("dq", p, launch_dq, q.device)
    return (dq, dk, dv, visits[0]) if counts else (dq, dk, dv)


def _or(t, dummy):
    """A pointer argument the kernel does not read (its feature flag is off)."""
    return t if t is not None else dummy


def _on(device):
    """Launch on the tensors' GPU (Triton launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile, with fake impls and an autograd formula.

if triton is not None:

    @torch.library.custom_op("effattn::triton_attention_fwd", mutates_args=())
    def triton_attention_fwd(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                             key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float,
                             dropout_p: float, window_left: int, window_right: int,
                             allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
        return _fwd(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p,
                    window_left, window_right, allow_tf32)

    @triton_attention_fwd.register_fake
    def _(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p, window_left,
          window_right, allow_tf32=False):
        B, H, Lq, _ = q.shape
        return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)

    @torch.library.custom_op("effattn::triton_attention_bwd", mutates_args=())
    def triton_attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                             out: Tensor, lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                             key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float,
                             dropout_p: float, window_left: int, window_right: int,
                             allow_tf32: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        return _bwd(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask, seed,
                    scale, dropout_p, window_left, window_right, allow_tf32)

    @triton_attention_bwd.register_fake
    def _(grad_out, grad_lse, q, k, v, *args):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _setup_context(ctx, inputs, output):
        q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32 = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, layout_mask, kpm, seed)
        ctx.static = (layout_block, scale, dropout_p, left, right, tf32)   # tf32: the forward's, not re-read

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, layout_mask, kpm, seed = ctx.saved_tensors
        layout_block, scale, dropout_p, left, right, tf32 = ctx.static
        dq, dk, dv = triton_attention_bwd(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, kpm,
                                          seed, scale, dropout_p, left, right, tf32)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None

    triton_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _run(call):
    """(out, lse): out (B, H, Lq, Dv) in the input dtype, lse (B, H, Lq) fp32. The TF32 setting is
    read here, once per call; the backward reuses it."""
    lay = call.layout
    tf32 = call.q.dtype == torch.float32 and _tf32_enabled()      # ignored by the interpreter
    return triton_attention_fwd(call.q, call.k, call.v, lay.mask if lay is not None else None,
                                lay.block_size if lay is not None else 0, call.key_padding_mask, call.seed,
                                call.scale, call.dropout_p, call.window_left, call.window_right, tf32)


BACKEND = register(Backend(
    name="triton", op="attention", priority=10,
    caps=Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_head_dim=256,
        features=FEATURES["attention"],
        min_compute_capability=(8, 0)),           # mma on bf16 tensor cores: Ampere or newer
    run=_run, available=_available,
    # the interpreter is correct but far slower than the torch reference: CPU only when named
    explicit_only_devices=frozenset({"cpu"})))
