"""In-kernel tile schedule and elementwise visibility, shared by the forward and backward kernels.

Which tiles a program visits follows `effattn.tiles` (full tiles, then partial ones): read from the
layout's packed `TileLists` with a block layout, else computed here from the window bounds as a run
of partial tiles, a run of full tiles and a run of partial tiles.
"""
import triton
import triton.language as tl

from ..jit import i64

# `effattn.lsh.SELF_SCORE` (-1e5) in the kernels' log2 units: the score of a query against a key at its
# own position under `positions_scores`
SELF_SCORE_LOG2 = tl.constexpr(-1e5 * 1.4426950408889634)


@triton.jit
def visible(qi, kj, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
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
def mask_scores(s, offs_m, offs_n, kpm_base, skpn, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                HAS_KPM: tl.constexpr, IDX64: tl.constexpr):
    """Scores ``s (BLOCK_M, BLOCK_N)`` of a key tile with invisible pairs at -inf (partial tiles:
    elementwise; key padding: per key), and ``seen (BLOCK_N,)``: the keys some query row of the
    tile sees. Where a tile is masked the kernels zero the K / V rows of the other keys, so that
    whatever an ignored key holds (NaN, inf in padding) gives 0 * 0 in a product, never 0 * NaN."""
    seen = offs_n < Lk
    if HAS_KPM:
        pad = tl.load(kpm_base + offs_n * skpn, mask=offs_n < Lk, other=1)
        seen = pad == 0
    if PARTIAL:
        ok = visible(offs_m[:, None], offs_n[None, :], Lq, Lk, off, left, right, lay_ptr, lay_nkb,
                     lay_bs, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, IDX64) & seen[None, :]
        s = tl.where(ok, s, float("-inf"))
        seen = tl.max(ok.to(tl.int32), 0) > 0
    elif HAS_KPM:
        s = tl.where(seen[None, :], s, float("-inf"))
    return s, seen


@triton.jit
def load_positions(ptr, offs, n):
    """int32 positions at ``offs`` of one (b, h) row of ``q_pos`` / ``k_pos``; -1 (never visible as a
    key) past ``n``."""
    return tl.load(ptr + offs, mask=offs < n, other=-1)


@triton.jit
def positions_scores(s, qp, kp, POS_CAUSAL: tl.constexpr):
    """The per-pair positions rule on scores ``s`` in log2 units (``positions``: the LSH rows of
    `effattn.lsh`), ``qp`` / ``kp`` the query / key positions shaped to broadcast (``(M, 1)`` and
    ``(1, N)``, or transposed): key hidden where its position is negative or (``POS_CAUSAL``) after
    the query's; where the positions are equal the score is the constant `SELF_SCORE_LOG2` (no
    gradient flows to q or k there). Returns (scores, visible, is_self)."""
    ok = kp >= 0
    if POS_CAUSAL:
        ok = ok & (kp <= qp)
    is_self = kp == qp
    s = tl.where(is_self, SELF_SCORE_LOG2, s)
    return tl.where(ok, s, float("-inf")), ok, is_self


@triton.jit
def dropout_keep(seed, bh, qi, kj, drop_thresh):
    """Keep-mask from Philox(seed; counter = (i, j, b*H + h, 0)); keep with probability 1 - p."""
    c0 = (qi + kj * 0).to(tl.uint32)
    c1 = (kj + qi * 0).to(tl.uint32)
    c2 = c0 * 0 + bh.to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
    return (r >> 8).to(tl.int32) >= drop_thresh


@triton.jit
def work_item(ITEMS, i):
    """Item ``i`` of a packed call's work list (int32 rows of first query, end query, first key, end
    key, tile): (first query row, first key row, the segment's Lq and Lk, the tile)."""
    item = ITEMS + i * 5
    q_row0 = tl.load(item)
    k_row0 = tl.load(item + 2)
    return q_row0, k_row0, tl.load(item + 1) - q_row0, tl.load(item + 3) - k_row0, tl.load(item + 4)


@triton.jit
def program_tile(pid, n_tiles, heads_per_group, ORDER: tl.constexpr):
    """`slice_tile` on a grid that holds only this kernel's ``n_tiles`` x ``n_slices`` programs."""
    return slice_tile(pid, n_tiles, tl.num_programs(0) // n_tiles, heads_per_group, ORDER)


@triton.jit
def slice_tile(pid, n_tiles, n_slices, heads_per_group, ORDER: tl.constexpr):
    """(tile, slice) of program `pid` among ``n_tiles`` tiles x ``n_slices`` (b, h) slices.
    ``ORDER = 0``: tiles fastest, ascending. Otherwise heaviest first (longest processing time
    first, as FlashAttention-3's tile scheduler): the slices go in groups of ``heads_per_group``
    (few enough that their K and V stay in L2 together), and inside a group the same tile of every
    slice runs before the next tile, from the last tile down (``ORDER = 1``: work grows with the
    tile index, e.g. causal query tiles) or from the first up (``ORDER = -1``: it shrinks, e.g.
    causal key tiles)."""
    if ORDER == 0:
        tile = pid % n_tiles
        bh = pid // n_tiles
    else:
        per_group = n_tiles * heads_per_group
        group = pid // per_group
        r = pid - group * per_group
        in_group = tl.minimum(heads_per_group, n_slices - group * heads_per_group)   # the last may be short
        tile = r // in_group
        if ORDER > 0:
            tile = n_tiles - 1 - tile
        bh = group * heads_per_group + r % in_group
    return tile, bh


@triton.jit
def first_listed(row, base, n, HAS_LAYOUT: tl.constexpr):
    """With a layout, the first entry of a packed list (`row`, entries from `base`, `n` of them),
    read before its loop starts (see `tile_index`); 0 otherwise."""
    if HAS_LAYOUT:
        t = tl.load(row + base, mask=n > 0, other=0)
    else:
        t = n * 0
    return t


@triton.jit
def tile_index(row, base, i, n, lo, n_lo, hi, listed, HAS_LAYOUT: tl.constexpr):
    """The i-th of `n` tiles of a run, and the value to carry to the next iteration. With a layout,
    `listed` holds entry i of the packed list (read one iteration ahead, so its load is in flight
    while the tile computes, instead of a copy the loop's pipeline would wait for) and entry i + 1
    is read for the next iteration; without one, the analytic ranges [lo, lo + n_lo) followed by
    [hi, ...)."""
    if HAS_LAYOUT:
        t = listed
        listed = tl.load(row + base + i + 1, mask=i + 1 < n, other=0)
    else:
        t = tl.where(i < n_lo, lo + i, hi + i - n_lo)
    return t, listed


@triton.jit
def key_tile_range(m0, Lq, Lk, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
def key_tile_schedule(LISTS, h, pid_m, lists_head_stride, lists_row_stride, m0, Lq, Lk, off, left, right,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                      HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr):
    """The key tiles query tile pid_m of head h visits, as `tile_index` reads them: from the
    layout's cached lists (row, counts), or analytically from the causal/window bounds (runs
    partial [t0, t1), full [t1, t2), partial [t2, t3)). Shared by the forward and dQ kernels."""
    if HAS_LAYOUT:
        row = LISTS + h.to(tl.int64) * lists_head_stride + pid_m.to(tl.int64) * lists_row_stride
        n_full = tl.load(row)
        n_part = tl.load(row + 1)
        t0 = n_full * 0                                      # unused with a layout
        t1 = t0
        t2 = t0
    else:
        row = LISTS
        t0, t1, t2, t3 = key_tile_range(m0, Lq, Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        n_full = t2 - t1
        n_part = (t1 - t0) + (t3 - t2)
    return row, n_full, n_part, t0, t1, t2


@triton.jit
def kv_bases(K, V, KPM, LAY, b, h, hk, skb, skh, svb, svh, skpb, lay_h):
    """Base pointers of batch b's kv head hk (GQA: shared by its query heads), its padding row and
    query head h's layout."""
    return (K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh, V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh,
            KPM + b.to(tl.int64) * skpb, LAY + h.to(tl.int64) * lay_h)


@triton.jit
def query_tile_range(n0, Lq, Lk, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
