"""Kernels for calls with score terms (softcap, sinks, ALiBi, a relative table, adaptive span, a
dense bias): FlashAttention-2's forward and backward (Dao 2023, Alg. 1 and 2) with the terms
evaluated in the tile after the scale (`_scores`), in the order of docs/conventions.md ("Scores").

Every visited tile is masked elementwise (causal / window bounds choose the tiles: `key_tile_range`,
`query_tile_range`; a layout is read per element); the adaptive span's horizon is folded into the
left window bound by the launcher, so key tiles beyond every head's span are skipped, and each
kernel tightens it per head to ``z[h] + ramp`` (`_span_left`).

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
def _scores(q, kt, offs_m, offs_n, b, h, bh, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs, kpm_base, kpm_l,
            scale, softcap, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q, bias_k,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr, HAS_KPM: tl.constexpr,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr,
            SPAN: tl.constexpr, DENSE: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr,
            IDX64: tl.constexpr):
    """(s, tanh, d, ok, kt, seen) of a (BLOCK_M, BLOCK_N) tile in natural units: the scaled scores with
    the soft-cap and every bias term, -inf where invisible; tanh of the soft-capped scores (for the
    backward; s itself without softcap); the distances d = pos(i) - j; the visibility; the keys
    ``kt`` with the columns of keys no row of the tile sees zeroed, and ``seen (BLOCK_N,)`` those
    keys some row sees. With a mask (window, layout, padding, span) the callers zero the V rows of
    the unseen keys too, so that whatever an ignored key holds (NaN, inf in padding) gives 0 * 0 in
    a product (and a finite tanh), never 0 * NaN."""
    d = (offs_m[:, None] + off) - offs_n[None, :]
    ok = visible(offs_m[:, None], offs_n[None, :], Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                 HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, IDX64)
    if SPAN:
        zh = tl.load(Z + h).to(tl.float32)
        ratio = (ramp + zh - d.to(tl.float32)) / ramp
        ok = ok & (ratio > 0)
    if HAS_KPM:
        pad = tl.load(kpm_base + offs_n * kpm_l, mask=offs_n < Lk, other=1)
        ok = ok & (pad[None, :] == 0)
    seen = offs_n < Lk                  # without a mask every key in bounds is seen (the others load as 0)
    if (HAS_LEFT or HAS_RIGHT) or (HAS_LAYOUT or (HAS_KPM or SPAN)):
        seen = tl.max(ok.to(tl.int32), 0) > 0
        kt = tl.where(seen[None, :], kt, tl.zeros_like(kt))
    s = dot(q, kt, DOT_PREC, INTERP_BF16) * scale
    t = s
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = t * softcap
    if ALIBI:
        slope = tl.load(SL + b * alibi_b + h * alibi_h).to(tl.float32)
        s = s - slope * tl.abs(d).to(tl.float32)
    if REL:
        if REL_BIDIR:
            idx = tl.minimum(tl.maximum(d, -max_dist), max_dist) + max_dist
        else:
            idx = tl.minimum(tl.maximum(d, 0), max_dist)
        s = s + tl.load(TAB + h * tab_h + idx).to(tl.float32)
    if SPAN:
        s = s + tl.log(tl.minimum(tl.maximum(ratio, 1e-30), 1.0))
    if DENSE:
        bias = tl.load(BIAS + b.to(tl.int64) * bias_b + h.to(tl.int64) * bias_h + i64(offs_m, IDX64)[:, None] * bias_q
                       + i64(offs_n, IDX64)[None, :] * bias_k, mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk),
                       other=0.0)
        s = s + bias.to(tl.float32)
    s = tl.where(ok, s, float("-inf"))
    return s, t, d, ok, kt, seen


@triton.jit
def _span_left(left, Z, h, ramp, SPAN: tl.constexpr):
    """Head h's left window bound: with an adaptive span, keys at d >= z[h] + ramp are invisible, so
    the head's tiles stop at d <= floor(z[h] + ramp) (the launcher's bound, from max_span, is the
    largest over heads): compute follows the sum of the heads' spans, not the largest. Visibility
    itself stays with `_scores` (ratio > 0), so the bound only has to be no tighter than it: for an
    integer d, fl(x - d) > 0 implies d < x, hence d <= floor(x)."""
    if SPAN:
        left = tl.minimum(left, (tl.load(Z + h).to(tl.float32) + ramp).to(tl.int32))
    return left


@triton.jit
def _zero_unseen(x, seen, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                 HAS_KPM: tl.constexpr, SPAN: tl.constexpr):
    """A V tile ``x`` with the keys no row of the tile sees zeroed (with a mask); ``seen`` from
    `_scores`, shaped to broadcast along the tile's key axis."""
    if (HAS_LEFT or HAS_RIGHT) or (HAS_LAYOUT or (HAS_KPM or SPAN)):
        x = tl.where(seen, x, tl.zeros_like(x))
    return x


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
def score_fwd_kernel(Q, K, V, O, LSE, KPM, LAY, SINKS, SL, TAB, Z, BIAS, ITEMS,
                     q_strides, k_strides, v_strides, kpm_strides, alibi_b, alibi_h, tab_h, bias_strides,
                     H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                     scale, softcap, max_dist, ramp, seed, drop_thresh, inv_keep, drop_q0, drop_k0, drop_h0, drop_H,
                     rows_q,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                     HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, SINKS_ON: tl.constexpr,
                     ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr, SPAN: tl.constexpr,
                     DENSE: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
                     VARLEN: tl.constexpr = False):
    """O (B, H, rows_q, Dv) and LSE (B, H, rows_q) natural log, for one query tile of one (b, h); grid
    cdiv(Lq, BLOCK_M) * B * H, query tiles fastest. ``VARLEN`` (packed sequences, B = 1, no layout,
    key padding or dense bias): ``Lq`` is ``n_items * BLOCK_M`` and ITEMS the (segment, query tile)
    work list of the plain packed kernels (`schedule.work_item`); a program works in its segment's
    coordinates (its lengths, bottom-right offset, first rows), so the terms read segment-local
    distances and dropout draws at the packed rows. ``rows_q``: the rows of O and LSE per (b, h).

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
    t0, _t1, _t2, t3 = key_tile_range(m0, Lq, Lk, off, _span_left(left, Z, h, ramp, SPAN), right, BLOCK_M,
                                      BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for tile in range(t0, t3):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        on = i64(offs_n, IDX64)
        kt = load_tile(k_base + offs_d[:, None] * k_d + on[None, :] * k_l, offs_d, D, offs_n, Lk, True, True)
        s, _t, _d, _ok, _kt, seen = _scores(q, kt, offs_m, offs_n, b, h, bh, Lq, Lk, off, left, right, lay_ptr,
                                            lay_nkb, lay_bs, kpm_base, kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB,
                                            tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q, bias_k, HAS_LEFT, HAS_RIGHT,
                                            HAS_LAYOUT, HAS_KPM, SOFTCAP, ALIBI, REL, REL_BIDIR, SPAN, DENSE,
                                            DOT_PREC, INTERP_BF16, IDX64)
        s = s * LOG2E
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(seed, b * drop_H + drop_h0 + h, offs_m[:, None] + (q_row0 + drop_q0),
                                      offs_n[None, :] + (k_row0 + drop_k0), drop_thresh), p * inv_keep, 0.0)
        v = load_tile(v_base + on[:, None] * v_l + offs_dv[None, :] * v_d, offs_n, Lk, offs_dv, Dv, True, True)
        v = _zero_unseen(v, seen[:, None], HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SPAN)
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


@triton.jit
def _probs(q, kt, do, vt, lse, delta, offs_m, offs_n, b, h, bh, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
           kpm_base, kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q, bias_k,
           seed, drop_thresh, inv_keep, drop_bh, drop_q0, drop_k0,
           HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr, HAS_KPM: tl.constexpr,
           DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, REL: tl.constexpr,
           REL_BIDIR: tl.constexpr, SPAN: tl.constexpr, DENSE: tl.constexpr, DOT_PREC: tl.constexpr,
           INTERP_BF16: tl.constexpr, IDX64: tl.constexpr):
    """The backward's recomputation for a (BLOCK_M, BLOCK_N) tile: (P with dropout applied, dT the
    gradient of the biased scores, dS the gradient of the scaled scores, d, ok, the keys ``kt`` with
    those no row sees zeroed). The V tile's unseen keys are zeroed too, so dP, dT and dS are 0 there.
    Dropout draws at head ``drop_bh``, rows and keys moved by ``drop_q0`` / ``drop_k0``."""
    s, t, d, ok, kt, seen = _scores(q, kt, offs_m, offs_n, b, h, bh, Lq, Lk, off, left, right, lay_ptr, lay_nkb,
                          lay_bs, kpm_base, kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB, tab_h, max_dist, Z, ramp, BIAS,
                          bias_b, bias_h, bias_q, bias_k, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SOFTCAP, ALIBI, REL,
                          REL_BIDIR, SPAN, DENSE, DOT_PREC, INTERP_BF16, IDX64)
    p = tl.exp2(s * LOG2E - lse[:, None])
    vt = _zero_unseen(vt, seen[None, :], HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, SPAN)
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
    return pd, dt, ds, d, ok, kt


@triton.jit
def _row_stats(LSE, DELTA, row0, offs_m, Lq):
    """lse (log2 units; +inf where no row or no key, so P = 0) and Delta of a query tile whose row 0
    is row ``row0`` of LSE and DELTA."""
    lse = tl.load(LSE + row0 + offs_m, mask=offs_m < Lq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    return lse, tl.load(DELTA + row0 + offs_m, mask=offs_m < Lq, other=0.0)


@triton.jit(do_not_specialize=["drop_q0", "drop_k0", "drop_h0", "drop_H"])
def score_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, KPM, LAY, SL, TAB, Z, BIAS, PART, DBIAS, ITEMS1, ITEMS2,
                     q_strides, k_strides, v_strides, do_strides, kpm_strides, alibi_b, alibi_h, tab_h, bias_strides,
                     B, H, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                     scale, softcap, max_dist, ramp, seed, drop_thresh, inv_keep, drop_q0, drop_k0, drop_h0, drop_H,
                     n_part, rows_q, rows_k,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_P: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr,
                     HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                     ALIBI: tl.constexpr, REL: tl.constexpr, REL_BIDIR: tl.constexpr, SPAN: tl.constexpr,
                     DENSE: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
                     VARLEN: tl.constexpr = False):
    """The first ``cdiv(Lk, BLOCK_N) * B * Hkv`` programs: dK, dV of one key tile of one (b, kv head);
    the remaining ``cdiv(Lq, BLOCK_M) * B * H``: dQ of one query tile of one (b, h) and its partial
    parameter sums, written to ``PART[bh, tile, :]`` (slot 0 ALiBi, 1 span, 2.. the table), and
    dT to DBIAS (B, H, Lq, Lk) with a dense bias. Outputs contiguous, ``rows_q`` / ``rows_k`` rows per
    (b, head); DK, DV fp32. ``VARLEN`` (as the forward's): ``Lk`` / ``Lq`` count the key / query work
    lists ITEMS1 / ITEMS2 in rows (``n_items * BLOCK``), each program works in its item's segment, and
    a dQ program's partial sums go to the slot of its item (``PART[bh, item, :]``).

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
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            t0, _t1, _t2, t3 = query_tile_range(n0, Lq, Lk, off, _span_left(left, Z, h, ramp, SPAN), right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            q_base = Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h + q_row0.to(tl.int64) * q_l
            do_base = DO + b.to(tl.int64) * do_b + h.to(tl.int64) * do_h + q_row0.to(tl.int64) * do_l
            for tile in range(t0, t3):
                offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
                om = i64(offs_m, IDX64)
                q = load_tile(q_base + om[:, None] * q_l + offs_d[None, :] * q_d, offs_m, Lq, offs_d, D, True, True)
                do = load_tile(do_base + om[:, None] * do_l + offs_dv[None, :] * do_d, offs_m, Lq, offs_dv, Dv,
                               True, True)
                lse, delta = _row_stats(LSE, DELTA, bh.to(tl.int64) * rows_q + q_row0, offs_m, Lq)
                pd, dt, ds, d, ok, _kz = _probs(q, kt, do, vt, lse, delta, offs_m, offs_n, b, h, bh, Lq, Lk, off,
                                           left, right, LAY + h.to(tl.int64) * lay_h, lay_nkb, lay_bs,
                                           KPM + b.to(tl.int64) * kpm_b, kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB,
                                           tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q, bias_k, seed, drop_thresh,
                                           inv_keep, b * drop_H + drop_h0 + h, q_row0 + drop_q0, k_row0 + drop_k0,
                                           HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, DROPOUT, SOFTCAP,
                                           ALIBI, REL, REL_BIDIR, SPAN, DENSE, DOT_PREC, INTERP_BF16, IDX64)
                dv += dot(tl.trans(cast(pd, do.dtype, INTERP_BF16)), do, DOT_PREC, INTERP_BF16)
                dk += dot(tl.trans(cast(ds, q.dtype, INTERP_BF16)), q, DOT_PREC, INTERP_BF16)
        ok_k = offs_n[:, None] < Lk
        rows = (bhk.to(tl.int64) * rows_k + k_row0 + offs_n[:, None])
        tl.store(DK + rows * D + offs_d[None, :], dk * scale, mask=ok_k & (offs_d[None, :] < D))
        tl.store(DV + rows * Dv + offs_dv[None, :], dv, mask=ok_k & (offs_dv[None, :] < Dv))
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
        t0, _t1, _t2, t3 = key_tile_range(m0, Lq, Lk, off, _span_left(left, Z, h, ramp, SPAN), right, BLOCK_M,
                                          BLOCK_N, HAS_LEFT, HAS_RIGHT)
        for tile in range(t0, t3):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            on = i64(offs_n, IDX64)
            kt = load_tile(k_base + offs_d[:, None] * k_d + on[None, :] * k_l, offs_d, D, offs_n, Lk, True, True)
            vt = load_tile(v_base + offs_dv[:, None] * v_d + on[None, :] * v_l, offs_dv, Dv, offs_n, Lk, True, True)
            pd, dt, ds, d, ok, kz = _probs(q, kt, do, vt, lse, delta, offs_m, offs_n, b, h, bh, Lq, Lk, off, left,
                                       right, LAY + h.to(tl.int64) * lay_h, lay_nkb, lay_bs,
                                       KPM + b.to(tl.int64) * kpm_b, kpm_l, scale, softcap, SL, alibi_b, alibi_h, TAB,
                                       tab_h, max_dist, Z, ramp, BIAS, bias_b, bias_h, bias_q, bias_k, seed, drop_thresh,
                                       inv_keep, b * drop_H + drop_h0 + h, q_row0 + drop_q0, k_row0 + drop_k0,
                                       HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, HAS_KPM, DROPOUT, SOFTCAP, ALIBI, REL, REL_BIDIR, SPAN, DENSE,
                                       DOT_PREC, INTERP_BF16, IDX64)
            dq += dot(cast(ds, kz.dtype, INTERP_BF16), tl.trans(kz), DOT_PREC, INTERP_BF16)
            dt = tl.where(ok, dt, 0.0)
            if ALIBI:
                part += tl.where(slots == 0, -tl.sum(tl.sum(dt * tl.abs(d).to(tl.float32), 1), 0), 0.0)
            if SPAN:
                zh = tl.load(Z + h).to(tl.float32)
                ratio = (ramp + zh - d.to(tl.float32)) / ramp
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
        tl.store(DQ + (row0 + offs_m[:, None]) * D + offs_d[None, :], cast(dq * scale, DQ.dtype.element_ty,
                 INTERP_BF16), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
        tl.store(PART + (bh.to(tl.int64) * n_mt + slot) * n_part + slots, part, mask=slots < n_part)
