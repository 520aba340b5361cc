"""Kernels for calls with score terms (softcap, sinks, ALiBi, a relative table, adaptive span, a
dense bias): FlashAttention-2's forward and backward (Dao 2023, Alg. 1 and 2) with the terms
evaluated in the tile after the scale (`_tile_scores`), in the order of docs/conventions.md ("Scores").

Causal / window bounds choose the tiles (`key_tile_range`, `query_tile_range`; a layout is read
per element); the adaptive span's horizon is folded into the left window bound by the launcher
(both bounds for a bidirectional span), so key tiles beyond every head's span are skipped, and each
kernel tightens it per head to ``z[h] + ramp`` (`_span_window`). A tile is masked and its terms
evaluated elementwise (`_add_terms`) unless the window bounds show all of it and every term is
constant on it (`_const_tile`: beyond a relative table's clip, inside a span's flat part; softcap
and sinks alone are constant everywhere): such a tile adds one scalar to the soft-capped scores and
nothing else (`_tile_scores`), the same bits as the elementwise path. ALiBi, a dense bias, a layout
or key padding keep every tile elementwise (the launcher's ``FAST``). Packed sequences (``VARLEN``:
the plain packed kernels' (segment, tile) work lists) run every step above, constant tiles
included, in each segment's coordinates.

Deterministic, no atomics: `score_bwd_kernel` is one launch of dK/dV programs (one per key tile of a
(b, kv head), looping over the group's query heads) and dQ programs (one per query tile of a (b, h)).
The dQ programs also reduce the gradient of the biased scores ``dT = P o (dP - Delta)`` to the terms'
parameters: per program fp32 partial sums (ALiBi: one number, span: one number, relative table: one
per table entry, via the tile's distinct clamped distances) written to their own slots, which the
launcher sums in a fixed order; the dense bias's gradient is ``dT`` itself, written by the program
that owns the row block. The sinks' gradient needs only lse and Delta (the launcher computes it).
"""
import triton
import triton.language as tl

from ..jit import cast, dot, i64, load_tile
from .schedule import dropout_keep, key_tile_range, query_tile_range, visible, work_item

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh from exp, saturating to +-1 without overflow to NaN; below |x| = 1/8 its Taylor series to
    x^7 (truncation error < 1e-8 relative; about an ulp in float32), where (1 - e) / (1 + e) would cancel: at |x| ~ 1e-5 (a softcap
    of 1e6) that form was wrong by ~1e-2 relative."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(ax < 0.125, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _visible(offs_m, offs_n, h, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs, kpm_base, kpm_l, Z, ramp,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr, HAS_KPM: tl.constexpr,
             SPAN: tl.constexpr, SPAN_BIDIR: tl.constexpr, IDX64: tl.constexpr):
    """The visibility of a (BLOCK_M, BLOCK_N) tile elementwise: window, layout, padding, beyond the span."""
    ok = visible(offs_m[:, None], offs_n[None, :], Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                 HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, IDX64)
    if SPAN:
        d = (offs_m[:, None] + off) - offs_n[None, :]
        ok = ok & (_span_ratio(d, tl.load(Z + h).to(tl.float32), ramp, SPAN_BIDIR) > 0)
    if HAS_KPM:
        pad = tl.load(kpm_base + offs_n * kpm_l, mask=offs_n < Lk, other=1)
        ok = ok & (pad[None, :] == 0)
    return ok


@triton.jit
def _seen_keys(offs_n, m0, m_hi, Lk, off, left, right, Z, h, ramp, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SPAN: tl.constexpr, SPAN_BIDIR: tl.constexpr):
    """(BLOCK_N,) the keys some row of [m0, m_hi] sees, per key without the tile (no layout, no
    padding: the calls with constant tiles): the rows whose window holds key j form a run, and the
    span's ratio is largest at the run's row nearest to j; the same keys as `_visible` marks."""
    lo = offs_n * 0 + m0
    hi = offs_n * 0 + m_hi
    if HAS_RIGHT:
        lo = tl.maximum(lo, offs_n - off - right)
    if HAS_LEFT:
        hi = tl.minimum(hi, offs_n - off + left)
    seen = (lo <= hi) & (offs_n < Lk)
    if SPAN:
        near = lo                                         # smallest d = pos(i) - j on the run
        if SPAN_BIDIR:
            near = tl.minimum(tl.maximum(offs_n - off, lo), hi)   # smallest |d|
        seen = seen & (_span_ratio(near + off - offs_n, tl.load(Z + h).to(tl.float32), ramp, SPAN_BIDIR) > 0)
    return seen


@triton.jit
def _add_terms(s, ok, offs_m, offs_n, b, h, Lq, Lk, off, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS,
               bias_b, bias_h, bias_q, bias_k, ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr,
               SPAN: tl.constexpr, SPAN_BIDIR: tl.constexpr, DENSE: tl.constexpr, IDX64: tl.constexpr):
    """The soft-capped scores ``s`` of a tile evaluated elementwise with every bias term added at the
    distances d = pos(i) - j, and -inf where not ``ok``."""
    d = (offs_m[:, None] + off) - offs_n[None, :]
    if ALIBI:
        slope = tl.load(SL + b * alibi_b + h * alibi_h).to(tl.float32)
        s = s - slope * tl.abs(d).to(tl.float32)
    if REL:
        if REL_BIDIR:
            idx = tl.minimum(tl.maximum(d, -max_dist), max_dist) + max_dist
        else:
            idx = tl.minimum(tl.maximum(d, 0), max_dist)
        s = s + tl.load(TAB + h * tab_h + idx).to(tl.float32)
    if SPAN:            # exactly 0 on the flat part (ratio >= 1), as `_const_tile` assumes
        ratio = _span_ratio(d, tl.load(Z + h).to(tl.float32), ramp, SPAN_BIDIR)
        s = s + tl.where(ratio < 1.0, tl.log(tl.maximum(ratio, 1e-30)), 0.0)
    if DENSE:
        bias = tl.load(BIAS + b.to(tl.int64) * bias_b + h.to(tl.int64) * bias_h + i64(offs_m, IDX64)[:, None] * bias_q
                       + i64(offs_n, IDX64)[None, :] * bias_k, mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk),
                       other=0.0)
        s = s + bias.to(tl.float32)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _tile_scores(fast, c, q, kt, v, offs_m, offs_n, m0, m_hi, b, h, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                 kpm_base, kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS, bias_b,
                 bias_h, bias_q, bias_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_KEYS: tl.constexpr,
                 FAST: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                 HAS_KPM: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, REL: tl.constexpr,
                 REL_BIDIR: tl.constexpr, SPAN: tl.constexpr, SPAN_BIDIR: tl.constexpr, DENSE: tl.constexpr,
                 DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr):
    """(s, tanh, ok, kt, v) of a (BLOCK_M, BLOCK_N) tile of rows [m0, m_hi] (m_hi < Lq) in natural
    units: the scaled scores with the soft-cap and every bias term, -inf where invisible; tanh of the
    soft-capped scores (for the backward; s itself without softcap); the visibility; the K and V tiles
    with the keys no row of the tile sees zeroed (``V_KEYS``: the V tile's key axis), so that whatever
    an ignored key holds (NaN, inf in padding) gives 0 * 0 in a product (and a finite tanh), never
    0 * NaN. With ``FAST`` the keys seen come per key (`_seen_keys`) and a constant tile (``fast``,
    `_const_tile`) skips the elementwise visibility and terms: the terms are the one scalar ``c``;
    the product and the soft-cap are shared, so its bits are those of the elementwise path. (Only
    the scores branch: with the product or the K / V tiles inside the branch, sm_90 compiles spilled
    in the tile loop.)"""
    masked: tl.constexpr = (HAS_LEFT or HAS_RIGHT) or (HAS_LAYOUT or (HAS_KPM or SPAN))
    if FAST:
        if masked:
            seen = _seen_keys(offs_n, m0, m_hi, Lk, off, left, right, Z, h, ramp, HAS_LEFT, HAS_RIGHT, SPAN,
                              SPAN_BIDIR)
    else:
        ok = _visible(offs_m, offs_n, h, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs, kpm_base, kpm_l, Z, ramp,
                      HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SPAN, SPAN_BIDIR, IDX64)
        if masked:
            seen = tl.max(ok.to(tl.int32), 0) > 0
    if masked:
        kt = tl.where(seen[None, :], kt, tl.zeros_like(kt))
        if V_KEYS == 0:
            v = tl.where(seen[:, None], v, tl.zeros_like(v))
        else:
            v = tl.where(seen[None, :], v, tl.zeros_like(v))
    s, t = _capped(q, kt, scale, softcap, SOFTCAP, DOT_PREC, INTERP_BF16)
    if FAST:
        if fast:
            s = _add_const(s, c, REL)
            ok = tl.full((BLOCK_M, BLOCK_N), True, tl.int1)
        else:
            ok = _visible(offs_m, offs_n, h, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs, kpm_base, kpm_l, Z,
                          ramp, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SPAN, SPAN_BIDIR, IDX64)
            s = _add_terms(s, ok, offs_m, offs_n, b, h, Lq, Lk, off, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z,
                           ramp, BIAS, bias_b, bias_h, bias_q, bias_k, ALIBI, REL, REL_BIDIR, SPAN, SPAN_BIDIR, DENSE,
                           IDX64)
    else:
        s = _add_terms(s, ok, offs_m, offs_n, b, h, Lq, Lk, off, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp,
                       BIAS, bias_b, bias_h, bias_q, bias_k, ALIBI, REL, REL_BIDIR, SPAN, SPAN_BIDIR, DENSE, IDX64)
    return s, t, ok, kt, v


@triton.jit
def _capped(q, kt, scale, softcap, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """(s, tanh): the scaled scores of a tile with the soft-cap, and tanh of the soft-capped scores
    (s itself without softcap), shared by constant and elementwise tiles (`_tile_scores`)."""
    s = dot(q, kt, DOT_PREC, INTERP_BF16) * scale
    t = s
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = t * softcap
    return s, t


@triton.jit
def _span_ratio(d, zh, ramp, SPAN_BIDIR: tl.constexpr):
    """The adaptive span's ``(ramp + z[h] - d) / ramp`` (``|d|`` when bidirectional): the key is
    visible iff > 0, on the ramp iff in (0, 1], on the flat part (the term adds 0) iff >= 1."""
    if SPAN_BIDIR:
        d = tl.abs(d)
    return (ramp + zh - d.to(tl.float32)) / ramp


@triton.jit
def _span_window(left, right, Z, h, ramp, SPAN: tl.constexpr, SPAN_BIDIR: tl.constexpr):
    """Head h's window bounds: with an adaptive span, keys at d >= z[h] + ramp (and at -d >= z[h] +
    ramp when bidirectional) are invisible, so the head's tiles stop at d <= floor(z[h] + ramp) (the
    launcher's bounds, from max_span, are the largest over heads): compute follows the sum of the
    heads' spans, not the largest. Visibility itself stays with `_visible` (ratio > 0), so the bound
    only has to be no tighter than it: for an integer d, fl(x - d) > 0 implies d < x, hence
    d <= floor(x). The launcher makes both bounds finite (HAS_LEFT, and HAS_RIGHT when bidirectional)."""
    if SPAN:
        hz = (tl.load(Z + h).to(tl.float32) + ramp).to(tl.int32)
        left = tl.minimum(left, hz)
        if SPAN_BIDIR:
            right = tl.minimum(right, hz)
    return left, right


@triton.jit
def _const_tile(full, m_lo, m_hi, n_lo, n_hi, off, h, TAB, tab_h, max_dist, Z, ramp, FAST: tl.constexpr,
                REL: tl.constexpr, REL_BIDIR: tl.constexpr, SPAN: tl.constexpr, SPAN_BIDIR: tl.constexpr):
    """Whether every term is constant on rows [m_lo, m_hi] x keys [n_lo, n_hi] of a tile that is
    ``full`` (the window bounds show every pair), and then the one scalar the terms add there: (fast,
    the table's entry (0.0 without a table), its index). A relative table is constant where every
    distance clamps to one entry (beyond the clip); a span where the largest distance (|d| when
    bidirectional) still has ratio > 1 (its flat part: the term adds exactly 0 and no gradient, and
    every key is visible): the clamped index and the ratio are monotone in d, so the tile's corners
    decide, in the arithmetic `_add_terms` uses. ``FAST`` (the launcher's) is False where a term never
    is (ALiBi, a dense bias) or visibility is per element (a layout, key padding): no tile is fast."""
    fast = full & FAST
    c = 0.0
    ci = off * 0
    if FAST:
        d_lo = m_lo + off - n_hi
        d_hi = m_hi + off - n_lo
        if REL:
            if REL_BIDIR:
                ci = tl.minimum(tl.maximum(d_lo, -max_dist), max_dist) + max_dist
                c_hi = tl.minimum(tl.maximum(d_hi, -max_dist), max_dist) + max_dist
            else:
                ci = tl.minimum(tl.maximum(d_lo, 0), max_dist)
                c_hi = tl.minimum(tl.maximum(d_hi, 0), max_dist)
            fast = fast & (ci == c_hi)
            c = tl.load(TAB + h * tab_h + ci).to(tl.float32)
        if SPAN:
            far = d_hi
            if SPAN_BIDIR:
                far = tl.maximum(d_hi, -d_lo)
            fast = fast & (_span_ratio(far, tl.load(Z + h).to(tl.float32), ramp, False) > 1.0)
    return fast, c, ci


@triton.jit
def _add_const(s, c, REL: tl.constexpr):
    """The soft-capped scores of a constant tile with its terms: the table's entry ``c`` as one scalar
    (a span adds 0 on its flat part; softcap and sinks alone add nothing)."""
    if REL:
        s = s + c
    return s


@triton.jit
def _query_tile(pid, Q, ITEMS, q_b, q_h, q_l, q_d, H, G, Lq, Lk, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                IDX64: tl.constexpr, VARLEN: tl.constexpr):
    """Query tile `pid` of cdiv(Lq, BLOCK_M) x B * H (tiles fastest): (the program's tile slot, the
    tile, bh, b, h, kv head, its rows, the rows as offsets, the Q tile, the first query and key rows, Lq, Lk).
    ``VARLEN``: the slot is an item of the work list ITEMS (`schedule.work_item`), and the rows, Lq
    and Lk are its segment's (the first rows added to every pointer)."""
    n_mt = tl.cdiv(Lq, BLOCK_M)
    slot = pid % n_mt
    bh = pid // n_mt
    b = bh // H
    h = bh % H
    pid_m = slot
    q_row0 = slot * 0
    k_row0 = slot * 0
    if VARLEN:
        q_row0, k_row0, Lq, Lk, pid_m = work_item(ITEMS, slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    om = i64(offs_m, IDX64)
    offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
    q = load_tile(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h + q_row0.to(tl.int64) * q_l + om[:, None] * q_l
                  + offs_d[None, :] * q_d, offs_m, Lq, offs_d, D, True, True)
    return slot, pid_m, bh, b, h, h // G, offs_m, om, q, q_row0, k_row0, Lq, Lk


@triton.jit(do_not_specialize=["drop_q0", "drop_k0", "drop_h0", "drop_H"])
def score_fwd_kernel(Q, K, V, O, LSE, KPM, LAY, SINKS, SL, TAB, Z, BIAS, CNT, ITEMS,
                     q_strides, k_strides, v_strides, kpm_strides, alibi_b, alibi_h, tab_h, bias_strides,
                     H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                     scale, softcap, max_dist, ramp, seed, drop_thresh, inv_keep, drop_q0, drop_k0, drop_h0, drop_H,
                     rows_q,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                     HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, SINKS_ON: tl.constexpr,
                     ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr, SPAN: tl.constexpr,
                     SPAN_BIDIR: tl.constexpr, DENSE: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr,
                     DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
                     VARLEN: tl.constexpr = False):
    """O (B, H, rows_q, Dv) and LSE (B, H, rows_q) natural log, for one query tile of one (b, h); grid
    cdiv(Lq, BLOCK_M) * B * H, query tiles fastest. The full tiles on which every term is constant
    (`_const_tile`; ``FAST``) skip the elementwise steps of `_tile_scores`; with ``COUNT`` (a test
    hook) each program writes the number of such tiles to ``CNT[pid]``. ``VARLEN`` (packed
    sequences, B = 1, no layout, key padding or dense bias): ``Lq`` is ``n_items * BLOCK_M`` and
    ITEMS the (segment, query tile) work list of the plain packed kernels (`schedule.work_item`); a
    program works in its segment's coordinates (its lengths, bottom-right offset, first rows), so the
    terms, the window's tile ranges and the constant tiles read segment-local distances and dropout
    draws at the packed rows. ``rows_q``: the rows of O and LSE per (b, h).

    Scalar arguments named as the C++ `AttnParams` fields where it has them (csrc/attention/attention.h:
    ``scale``, ``softcap``, ``alibi_b``, the sizes, bounds and dropout numbers) and passed by name;
    the strides travel as tuples ``<tensor>_strides`` = (``_b``, ``_h``, ``_l``, ``_d``), their
    elements named as the C++ fields (``kpm_strides`` = (kpm_b, kpm_l); ``bias_strides`` = (bias_b,
    bias_h, bias_q, bias_k) of the dense bias). Without a C++ field: ``q_d``, ``k_d``, ``v_d``, the
    slopes' head stride ``alibi_h``, the relative table's ``tab_h`` and ``max_dist``, the span's
    ``ramp`` and the dense bias's strides; ``seed`` is C++'s seed_lo / seed_hi. Dropout draws at row
    ``drop_q0 + i``, key ``drop_k0 + j``, head ``b * drop_H + drop_h0 + h`` (C++'s drop_at: a chunk's
    positions, a head shard's global heads)."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    kpm_b, kpm_l = kpm_strides
    bias_b, bias_h, bias_q, bias_k = bias_strides
    _, pid_m, bh, b, h, hk, offs_m, _, q, q_row0, k_row0, Lq, Lk = _query_tile(
        tl.program_id(0), Q, ITEMS, q_b, q_h, q_l, q_d, H, G, Lq, Lk, D, BLOCK_M, BLOCK_D, IDX64, VARLEN)
    if VARLEN:
        off = Lk - Lq
    m0 = pid_m * BLOCK_M
    offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
    offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
    k_base = K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h + k_row0.to(tl.int64) * k_l
    v_base = V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h + k_row0.to(tl.int64) * v_l
    kpm_base = KPM + b.to(tl.int64) * kpm_b
    lay_ptr = LAY + h.to(tl.int64) * lay_h
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    h_left, h_right = _span_window(left, right, Z, h, ramp, SPAN, SPAN_BIDIR)
    t0, t1, t2, t3 = key_tile_range(m0, Lq, Lk, off, h_left, h_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    m_hi = tl.minimum(m0 + BLOCK_M, Lq) - 1
    n_fast = t0 * 0
    for tile in range(t0, t3):
        n0 = tile * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        on = i64(offs_n, IDX64)
        kt = load_tile(k_base + offs_d[:, None] * k_d + on[None, :] * k_l, offs_d, D, offs_n, Lk, True, True)
        v = load_tile(v_base + on[:, None] * v_l + offs_dv[None, :] * v_d, offs_n, Lk, offs_dv, Dv, True, True)
        fast, c, _ci = _const_tile((tile >= t1) & (tile < t2), m0, m_hi, n0, n0 + BLOCK_N - 1, off, h, TAB, tab_h,
                                   max_dist, Z, ramp, FAST, REL, REL_BIDIR, SPAN, SPAN_BIDIR)
        s, _t, _ok, _kz, v = _tile_scores(fast, c, q, kt, v, offs_m, offs_n, m0, m_hi, b, h, Lq, Lk, off, left, right,
                                          lay_ptr, lay_nkb, lay_bs, kpm_base, kpm_l, scale, softcap, SL, alibi_b,
                                          alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q, bias_k,
                                          BLOCK_M, BLOCK_N, 0, FAST, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SOFTCAP, ALIBI, REL,
                                          REL_BIDIR, SPAN, SPAN_BIDIR, DENSE, DOT_PREC, INTERP_BF16, IDX64)
        if COUNT:
            n_fast += fast.to(tl.int32)
        s = s * LOG2E
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(seed, b * drop_H + drop_h0 + h, offs_m[:, None] + (q_row0 + drop_q0),
                                      offs_n[None, :] + (k_row0 + drop_k0), drop_thresh), p * inv_keep, 0.0)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERP_BF16), v, DOT_PREC, INTERP_BF16)
        m_i = m_new
    if SINKS_ON:        # the sink's exp joins the normalizer: lse = log(sum exp(s) + exp(sink))
        sink = tl.load(SINKS + h).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        scale_old = tl.exp2(m_i - m_fin)
        l_i = l_i * scale_old + tl.exp2(sink - m_fin)
        acc = acc * scale_old[:, None]
        m_i = m_fin
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / LOG2E)
    row_ok = offs_m < Lq
    rows = bh.to(tl.int64) * rows_q + q_row0 + offs_m
    tl.store(O + rows[:, None] * Dv + offs_dv[None, :], cast(out, O.dtype.element_ty, INTERP_BF16),
             mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + rows, lse, mask=row_ok)
    if COUNT:
        tl.store(CNT + tl.program_id(0), n_fast)


@triton.jit
def _grads_of(s, t, do, vt, lse, delta, offs_m, offs_n, drop_bh, drop_q0, drop_k0, seed, drop_thresh, inv_keep,
              DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """(P with dropout applied, dT, dS) of a tile from its scores ``s`` and tanh ``t``
    (`_tile_scores`) and its V tile ``vt`` (unseen keys zeroed)."""
    p = tl.exp2(s * LOG2E - lse[:, None])
    dp = dot(do, vt, DOT_PREC, INTERP_BF16)
    pd = p
    if DROPOUT:
        keep = dropout_keep(seed, drop_bh, offs_m[:, None] + drop_q0, offs_n[None, :] + drop_k0, drop_thresh)
        dp = tl.where(keep, dp * inv_keep, 0.0)
        pd = tl.where(keep, p * inv_keep, 0.0)
    dt = p * (dp - delta[:, None])
    ds = dt
    if SOFTCAP:
        ds = dt * (1.0 - t * t)
    return pd, dt, ds


@triton.jit
def _row_stats(LSE, DELTA, row0, offs_m, Lq):
    """lse (log2 units; +inf where no row or no key, so P = 0) and Delta of a query tile whose row 0
    is row ``row0`` of LSE and DELTA."""
    lse = tl.load(LSE + row0 + offs_m, mask=offs_m < Lq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    return lse, tl.load(DELTA + row0 + offs_m, mask=offs_m < Lq, other=0.0)


@triton.jit(do_not_specialize=["drop_q0", "drop_k0", "drop_h0", "drop_H"])
def score_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, KPM, LAY, SL, TAB, Z, BIAS, PART, DBIAS, CNT, ITEMS1,
                     ITEMS2,
                     q_strides, k_strides, v_strides, do_strides, kpm_strides, alibi_b, alibi_h, tab_h, bias_strides,
                     B, H, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                     scale, softcap, max_dist, ramp, seed, drop_thresh, inv_keep, drop_q0, drop_k0, drop_h0, drop_H,
                     n_part, rows_q, rows_k,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_P: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                     HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                     ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr, SPAN: tl.constexpr,
                     SPAN_BIDIR: tl.constexpr, DENSE: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr,
                     DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
                     VARLEN: tl.constexpr = False):
    """The first ``cdiv(Lk, BLOCK_N) * B * Hkv`` programs: dK, dV of one key tile of one (b, kv head);
    the remaining ``cdiv(Lq, BLOCK_M) * B * H``: dQ of one query tile of one (b, h) and its partial
    parameter sums, written to ``PART[bh, tile, :]`` (slot 0 ALiBi, 1 span, 2.. the table), and
    dT to DBIAS (B, H, Lq, Lk) with a dense bias. Outputs contiguous, ``rows_q`` / ``rows_k`` rows per
    (b, head); DK, DV fp32. Tiles on which every term is constant skip the elementwise steps as in the
    forward (a table's gradient then goes to its one entry; a span's flat part has none); ``COUNT``:
    their number per program in ``CNT[pid]``. ``VARLEN`` (as the forward's): ``Lk`` / ``Lq`` count
    the key / query work lists ITEMS1 / ITEMS2 in rows (``n_items * BLOCK``), each program works in
    its item's segment, and a dQ program's partial sums go to the slot of its item
    (``PART[bh, item, :]``).

    Arguments as `score_fwd_kernel`'s, and ``do_strides`` (``do_d`` has no C++ field), ``Hkv`` (C++:
    H / G) and ``n_part`` (the parameter slots per program), which have none."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    do_b, do_h, do_l, do_d = do_strides
    kpm_b, kpm_l = kpm_strides
    bias_b, bias_h, bias_q, bias_k = bias_strides
    pid = tl.program_id(0)
    n_nt = tl.cdiv(Lk, BLOCK_N)
    n_mt = tl.cdiv(Lq, BLOCK_M)
    n_kv = n_nt * B * Hkv
    offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
    offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
    if pid < n_kv:
        pid_n = pid % n_nt
        bhk = pid // n_nt
        b = bhk // Hkv
        hk = bhk % Hkv
        q_row0 = pid_n * 0
        k_row0 = pid_n * 0
        if VARLEN:              # (segment, key tile) work list, as the plain packed kernels'
            q_row0, k_row0, Lq, Lk, pid_n = work_item(ITEMS1, pid_n)
            off = Lk - Lq
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        on = i64(offs_n, IDX64)
        k_base = K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h + k_row0.to(tl.int64) * k_l
        v_base = V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h + k_row0.to(tl.int64) * v_l
        kt = load_tile(k_base + offs_d[:, None] * k_d + on[None, :] * k_l, offs_d, D, offs_n, Lk, True, True)
        vt = load_tile(v_base + offs_dv[:, None] * v_d + on[None, :] * v_l, offs_dv, Dv, offs_n, Lk, True, True)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
        n_fast = pid * 0
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            h_left, h_right = _span_window(left, right, Z, h, ramp, SPAN, SPAN_BIDIR)
            t0, t1, t2, t3 = query_tile_range(n0, Lq, Lk, off, h_left, h_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            q_base = Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h + q_row0.to(tl.int64) * q_l
            do_base = DO + b.to(tl.int64) * do_b + h.to(tl.int64) * do_h + q_row0.to(tl.int64) * do_l
            for tile in range(t0, t3):
                m0 = tile * BLOCK_M
                offs_m = m0 + tl.arange(0, BLOCK_M)
                om = i64(offs_m, IDX64)
                q = load_tile(q_base + om[:, None] * q_l + offs_d[None, :] * q_d, offs_m, Lq, offs_d, D, True, True)
                do = load_tile(do_base + om[:, None] * do_l + offs_dv[None, :] * do_d, offs_m, Lq, offs_dv, Dv,
                               True, True)
                lse, delta = _row_stats(LSE, DELTA, bh.to(tl.int64) * rows_q + q_row0, offs_m, Lq)
                m_hi = tl.minimum(m0 + BLOCK_M, Lq) - 1
                fast, c, _ci = _const_tile((tile >= t1) & (tile < t2), m0, m_hi, n0, n0 + BLOCK_N - 1, off, h, TAB,
                                           tab_h, max_dist, Z, ramp, FAST, REL, REL_BIDIR, SPAN, SPAN_BIDIR)
                s, t, _ok, _kz, vz = _tile_scores(fast, c, q, kt, vt, offs_m, offs_n, m0, m_hi, b, h, Lq, Lk, off, left,
                                                  right,
                                                  LAY + h.to(tl.int64) * lay_h, lay_nkb, lay_bs,
                                                  KPM + b.to(tl.int64) * kpm_b, kpm_l, scale, softcap, SL, alibi_b,
                                                  alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q,
                                                  bias_k, BLOCK_M, BLOCK_N, 1, FAST, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT,
                                                  HAS_KPM,
                                                  SOFTCAP, ALIBI, REL, REL_BIDIR, SPAN, SPAN_BIDIR, DENSE, DOT_PREC,
                                                  INTERP_BF16, IDX64)
                pd, dt, ds = _grads_of(s, t, do, vz, lse, delta, offs_m, offs_n, b * drop_H + drop_h0 + h,
                                       q_row0 + drop_q0, k_row0 + drop_k0, seed, drop_thresh, inv_keep,
                                       DROPOUT, SOFTCAP, DOT_PREC, INTERP_BF16)
                if COUNT:
                    n_fast += fast.to(tl.int32)
                dv += dot(tl.trans(cast(pd, do.dtype, INTERP_BF16)), do, DOT_PREC, INTERP_BF16)
                dk += dot(tl.trans(cast(ds, q.dtype, INTERP_BF16)), q, DOT_PREC, INTERP_BF16)
        ok_k = offs_n[:, None] < Lk
        rows = (bhk.to(tl.int64) * rows_k + k_row0 + offs_n[:, None])
        tl.store(DK + rows * D + offs_d[None, :], dk * scale, mask=ok_k & (offs_d[None, :] < D))
        tl.store(DV + rows * Dv + offs_dv[None, :], dv, mask=ok_k & (offs_dv[None, :] < Dv))
        if COUNT:
            tl.store(CNT + pid, n_fast)
    else:
        slot, pid_m, bh, b, h, hk, offs_m, om, q, q_row0, k_row0, Lq, Lk = _query_tile(
            pid - n_kv, Q, ITEMS2, q_b, q_h, q_l, q_d, H, G, Lq, Lk, D, BLOCK_M, BLOCK_D, IDX64, VARLEN)
        if VARLEN:
            off = Lk - Lq
        m0 = pid_m * BLOCK_M
        do = load_tile(DO + b.to(tl.int64) * do_b + h.to(tl.int64) * do_h + q_row0.to(tl.int64) * do_l
                       + om[:, None] * do_l + offs_dv[None, :] * do_d, offs_m, Lq, offs_dv, Dv, True, True)
        row0 = bh.to(tl.int64) * rows_q + q_row0
        lse, delta = _row_stats(LSE, DELTA, row0, offs_m, Lq)
        k_base = K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h + k_row0.to(tl.int64) * k_l
        v_base = V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h + k_row0.to(tl.int64) * v_l
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        slots = tl.arange(0, BLOCK_P)
        part = tl.zeros((BLOCK_P,), tl.float32)
        h_left, h_right = _span_window(left, right, Z, h, ramp, SPAN, SPAN_BIDIR)
        t0, t1, t2, t3 = key_tile_range(m0, Lq, Lk, off, h_left, h_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        m_hi = tl.minimum(m0 + BLOCK_M, Lq) - 1
        n_fast = t0 * 0
        for tile in range(t0, t3):
            n0 = tile * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            on = i64(offs_n, IDX64)
            kt = load_tile(k_base + offs_d[:, None] * k_d + on[None, :] * k_l, offs_d, D, offs_n, Lk, True, True)
            vt = load_tile(v_base + offs_dv[:, None] * v_d + on[None, :] * v_l, offs_dv, Dv, offs_n, Lk, True, True)
            fast, c, ci = _const_tile((tile >= t1) & (tile < t2), m0, m_hi, n0, n0 + BLOCK_N - 1, off, h, TAB, tab_h,
                                      max_dist, Z, ramp, FAST, REL, REL_BIDIR, SPAN, SPAN_BIDIR)
            s, t, ok, kz, vz = _tile_scores(fast, c, q, kt, vt, offs_m, offs_n, m0, m_hi, b, h, Lq, Lk, off, left, right,
                                            LAY + h.to(tl.int64) * lay_h, lay_nkb, lay_bs, KPM + b.to(tl.int64) * kpm_b,
                                            kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp,
                                            BIAS, bias_b, bias_h, bias_q, bias_k, BLOCK_M, BLOCK_N, 1, FAST, HAS_LEFT,
                                            HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SOFTCAP, ALIBI, REL, REL_BIDIR, SPAN,
                                            SPAN_BIDIR, DENSE, DOT_PREC, INTERP_BF16, IDX64)
            pd, dt, ds = _grads_of(s, t, do, vz, lse, delta, offs_m, offs_n, b * drop_H + drop_h0 + h, q_row0 + drop_q0,
                                   k_row0 + drop_k0, seed, drop_thresh, inv_keep, DROPOUT, SOFTCAP, DOT_PREC,
                                   INTERP_BF16)
            dq += dot(cast(ds, kz.dtype, INTERP_BF16), tl.trans(kz), DOT_PREC, INTERP_BF16)
            if fast:
                part = _const_partials(part, slots, dt, ci, REL)
            else:
                part = _param_partials(part, slots, dt, ok, offs_m, offs_n, bh, h, Lq, Lk, off, max_dist, Z, ramp,
                                       DBIAS, ALIBI, REL, REL_BIDIR, SPAN, SPAN_BIDIR, DENSE)
            if COUNT:
                n_fast += fast.to(tl.int32)
        tl.store(DQ + (row0 + offs_m[:, None]) * D + offs_d[None, :], cast(dq * scale, DQ.dtype.element_ty,
                 INTERP_BF16), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
        tl.store(PART + (bh.to(tl.int64) * n_mt + slot) * n_part + slots, part, mask=slots < n_part)
        if COUNT:
            tl.store(CNT + pid, n_fast)


@triton.jit
def _const_partials(part, slots, dt, ci, REL: tl.constexpr):
    """`_param_partials` of a constant tile: it reads one table entry ``ci``, whose partial takes the
    tile's whole dT (the masked sum `_param_partials` takes, without the mask); a span's flat part
    has no gradient."""
    if REL:
        part += tl.where(slots == ci + 2, tl.sum(tl.sum(dt, 1), 0), 0.0)
    return part


@triton.jit
def _param_partials(part, slots, dt, ok, offs_m, offs_n, bh, h, Lq, Lk, off, max_dist, Z, ramp, DBIAS,
                    ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr, SPAN: tl.constexpr,
                    SPAN_BIDIR: tl.constexpr, DENSE: tl.constexpr):
    """A dQ program's parameter partial sums ``part`` (slot 0 ALiBi, 1 span, 2.. the table) with a
    per-element tile's dT added; with a dense bias, dT stored to DBIAS."""
    d = (offs_m[:, None] + off) - offs_n[None, :]
    dt = tl.where(ok, dt, 0.0)
    if ALIBI:
        part += tl.where(slots == 0, -tl.sum(tl.sum(dt * tl.abs(d).to(tl.float32), 1), 0), 0.0)
    if SPAN:
        ratio = _span_ratio(d, tl.load(Z + h).to(tl.float32), ramp, SPAN_BIDIR)
        on_ramp = (ratio > 0) & (ratio <= 1)
        g_sp = tl.where(on_ramp, dt / tl.where(on_ramp, ratio, 1.0), 0.0)
        part += tl.where(slots == 1, tl.sum(tl.sum(g_sp, 1), 0) / ramp, 0.0)
    if REL:
        if REL_BIDIR:
            idx = tl.minimum(tl.maximum(d, -max_dist), max_dist) + max_dist
        else:
            idx = tl.minimum(tl.maximum(d, 0), max_dist)
        # the tile's table entries form one run [lo, hi]: one masked sum per entry
        lo = tl.min(tl.min(idx, 1), 0)
        hi = tl.max(tl.max(idx, 1), 0)
        for c in range(lo, hi + 1):
            part += tl.where(slots == c + 2, tl.sum(tl.sum(tl.where(idx == c, dt, 0.0), 1), 0), 0.0)
    if DENSE:
        tl.store(DBIAS + (bh.to(tl.int64) * Lq + offs_m[:, None]) * Lk + offs_n[None, :], dt,
                 mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))
    return part
