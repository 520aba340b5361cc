"""Backward kernels (FlashAttention-2, Alg. 2), deterministic: every gradient element is written by
one program, no atomics.

- `delta_kernel`: Delta = rowsum(dO * O) - dlse (Alg. 2 line 4), a pre-pass: the dK/dV work needs
  Delta of every query row it visits, which no program of the main launch could wait for;
- `bwd_kernel`: the rest in one launch, whose programs are of two kinds (as in FlexAttention's
  backward): `_dkdv_program`, per key tile, dK and dV over the visible query tiles of the query
  heads of its kv head (the transposed tile lists), and `_dq_program`, per query tile, dQ over the
  visible key tiles (the forward's tile lists). With few kv heads (GQA) a key tile's query heads
  may be split over several programs that write fp32 partial sums (`n_split`), added up after.
"""
import triton
import triton.language as tl

from ..jit import UNSPECIALIZED_BWD_ARGS, cast, dot, i64, load_tile
from .schedule import (
    dropout_keep,
    first_listed,
    key_tile_schedule,
    kv_bases,
    load_positions,
    mask_scores,
    positions_scores,
    query_tile_range,
    slice_tile,
    tile_index,
    visible,
    work_item,
)


@triton.jit
def _row_tile(pid, Lq, H, BLOCK_M: tl.constexpr):
    """(query tile, b * H + h, b, h) of program `pid` of a 1-D grid of query tiles, tiles fastest."""
    n_mt = tl.cdiv(Lq, BLOCK_M)
    bh = pid // n_mt
    return pid % n_mt, bh, bh // H, bh % H


@triton.jit
def delta_kernel(O, DO, DLSE, DELTA, do_strides, dl_strides, H, Lq, Dv,
                 BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
                 IDX64: tl.constexpr):
    """Delta_i = rowsum(dO_i * O_i) - dlse_i (FA-2 Alg. 2 line 4; a gradient into lse enters as
    dS += dlse * P, i.e. as -dlse in Delta). O is contiguous. 1-D grid, like the forward's.

    Scalar arguments as the C++ `AttnParams` fields, strides as tuples: ``do_strides`` = (do_b,
    do_h, do_l, do_d), ``dl_strides`` = (dl_b, dl_h, dl_l); ``do_d`` (unit there) has no C++ field."""
    do_b, do_h, do_l, do_d = do_strides
    dl_b, dl_h, dl_l = dl_strides
    pid_m, bh, b, h = _row_tile(tl.program_id(0), Lq, H, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
    offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
    ok = (offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv)
    o = tl.load(O + (bh.to(tl.int64) * Lq + offs_m[:, None]) * Dv + offs_dv[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * do_b + h.to(tl.int64) * do_h + (pid_m * BLOCK_M).to(tl.int64) * do_l
                 + rel_m[:, None] * do_l + offs_dv[None, :] * do_d, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        dlse = tl.load(DLSE + b.to(tl.int64) * dl_b + h.to(tl.int64) * dl_h + i64(offs_m, IDX64) * dl_l,
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
def _dkdv_tile(dk, dv, k, v, keep_k, k_ptrs, q_base, do_base, lse_base, delta_base, dqp_base, start_m, offs_n,
               offs_d,
               offs_dv, q_l, q_d, do_l, do_d, dqp_l, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
               qk_scale, seed, bh, q_row0, k_row0, drop_thresh, inv_keep,
               BLOCK_M: tl.constexpr, PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
               DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
               DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
               FOLD_SCALE: tl.constexpr, FIVE: tl.constexpr, qpos_base, kpos, POS: tl.constexpr,
               POS_CAUSAL: tl.constexpr):
    """dK, dV contributions of one query tile (FA-2 Alg. 2 lines 11-16, transposed: keys are rows).
    ``PARTIAL``: a partial tile, masked elementwise; ``FOLD_SCALE``: the scale folded into exp2's
    argument (one FMA per score; ``qk_scale > 0``). ``FIVE``: also this key tile's share of the query
    tile's dQ (dS K, unscaled: FA-2 Alg. 2 line 17 as a fifth product), stored in fp32 at
    ``dqp_base`` (the tile's rows of its slot in the partial buffer; `dq_reduce_kernel` adds them).
    ``POS``: the positions rule (`schedule.positions_scores`) on every tile, the query rows'
    positions read at ``qpos_base``, the keys' ``kpos``; no gradient into q or k at a self score."""
    rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
    offs_m = start_m + rel_m
    q_tile = q_base + start_m.to(tl.int64) * q_l
    do_tile = do_base + start_m.to(tl.int64) * do_l
    q = load_tile(q_tile + rel_m[:, None] * q_l + offs_d[None, :] * q_d, offs_m, Lq, offs_d, D, True, PAD_D)
    do = load_tile(do_tile + rel_m[:, None] * do_l + offs_dv[None, :] * do_d, offs_m, Lq, offs_dv, Dv, True, PAD_DV)
    lse, delta = _row_stats(lse_base, delta_base, offs_m, Lq)
    st = dot(k, tl.trans(q), DOT_PREC, INTERP_BF16)                        # S^T (BLOCK_N, BLOCK_M)
    if not FOLD_SCALE:
        st = st * qk_scale
    if PARTIAL:
        ok = visible(offs_m[None, :], offs_n[:, None], Lq, Lk, off, left, right, lay_ptr, lay_nkb,
                      lay_bs, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, IDX64)
        st = tl.where(ok, st, float("-inf"))
    if HAS_KPM:
        st = tl.where(keep_k[:, None], st, float("-inf"))
    if POS:
        qpos = load_positions(qpos_base, offs_m, Lq)
        st, pos_ok, pos_self = positions_scores(st, qpos[None, :], kpos[:, None], POS_CAUSAL)
    if FOLD_SCALE:
        pt = tl.exp2(st * qk_scale - lse[None, :])                            # P^T = exp(S - L)
    else:
        pt = tl.exp2(st - lse[None, :])
    dpt = dot(v, tl.trans(do), DOT_PREC, INTERP_BF16)                            # dP^T = V dO^T
    if DROPOUT:
        keep = dropout_keep(seed, bh, q_row0 + offs_m[None, :], k_row0 + offs_n[:, None], drop_thresh)
        pdt = tl.where(keep, pt * inv_keep, 0.0)
        dpt = tl.where(keep, dpt * inv_keep, 0.0)
    else:
        pdt = pt
    dv += dot(cast(pdt, do.dtype, INTERP_BF16), do, DOT_PREC, INTERP_BF16)         # dV += P_drop^T dO
    dst = pt * (dpt - delta[None, :])                                        # dS = P o (dP - Delta)
    if PARTIAL:                   # an invisible key's dP may be NaN (from its V): 0, not 0 * NaN
        dst = tl.where(ok, dst, 0.0)
    if POS:                       # the self score is a constant: no gradient
        dst = tl.where(pos_ok & (pos_self == 0), dst, 0.0)
    ds = cast(dst, q.dtype, INTERP_BF16)
    dk += dot(ds, q, DOT_PREC, INTERP_BF16)                                  # dK += dS^T Q (scale later)
    if FIVE:
        kz = k                    # its rows of keys no query sees are zeros (`_dkdv_program`)
        if PARTIAL and LAYOUT_MASK:   # a layout read per element may hide keys inside the tile from every
            seen = (tl.max(ok.to(tl.int32), 1) > 0) & keep_k      # row: read those K rows again as zeros,
            kz = tl.load(k_ptrs, mask=seen[:, None] & (offs_d[None, :] < D), other=0.0)   # so NaN there give 0
        if POS:                   # keys the positions hide from every row of the tile: zeros likewise
            kz = tl.where(tl.max(pos_ok.to(tl.int32), 1)[:, None] > 0, kz, tl.zeros_like(kz))
        dqp = dot(tl.trans(ds), kz, DOT_PREC, INTERP_BF16)                   # dS K of this key tile
        tl.store(dqp_base + start_m.to(tl.int64) * dqp_l + rel_m[:, None] * dqp_l + offs_d[None, :], dqp,
                 mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
    return dk, dv


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
             k_l, k_d, v_l, v_d, kpm_l, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
             qk_scale, seed, bh, q_row0, k_row0, drop_thresh, inv_keep,
             BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
             DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
             DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
             FOLD_SCALE: tl.constexpr, qpos, kpos_base, POS: tl.constexpr, POS_CAUSAL: tl.constexpr):
    """dQ contribution of one key tile (FA-2 Alg. 2 lines 11-15, 17: dQ += dS K). ``PARTIAL``: a
    partial tile, masked elementwise; ``FOLD_SCALE`` and ``POS`` as in `_dkdv_tile`."""
    rel_n = i64(tl.arange(0, BLOCK_N), IDX64)
    offs_n = start_n + rel_n
    k_tile = k_base + start_n.to(tl.int64) * k_l
    v_tile = v_base + start_n.to(tl.int64) * v_l
    kt = load_tile(k_tile + offs_d[:, None] * k_d + rel_n[None, :] * k_l, offs_d, D, offs_n, Lk, PAD_D, PARTIAL)
    vt = load_tile(v_tile + offs_dv[:, None] * v_d + rel_n[None, :] * v_l, offs_dv, Dv, offs_n, Lk, PAD_DV, PARTIAL)
    s = dot(q, kt, DOT_PREC, INTERP_BF16)
    if not FOLD_SCALE:
        s = s * qk_scale
    s, seen = mask_scores(s, offs_m, offs_n, kpm_base, kpm_l, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                          PARTIAL, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, IDX64)
    if POS:
        kpos = load_positions(kpos_base, offs_n, Lk)
        s, pos_ok, pos_self = positions_scores(s, qpos[:, None], kpos[None, :], POS_CAUSAL)
        seen = seen & (tl.max(pos_ok.to(tl.int32), 0) > 0)
    if PARTIAL or HAS_KPM or POS:  # keys no row sees: zero K and V, so NaN / inf in them give 0 * 0
        kt = tl.where(seen[None, :], kt, tl.zeros_like(kt))
        vt = tl.where(seen[None, :], vt, tl.zeros_like(vt))
    if FOLD_SCALE:
        p = tl.exp2(s * qk_scale - lse[:, None])
    else:
        p = tl.exp2(s - lse[:, None])
    dp = dot(do, vt, DOT_PREC, INTERP_BF16)
    if DROPOUT:
        keep = dropout_keep(seed, bh, q_row0 + offs_m[:, None], k_row0 + offs_n[None, :], drop_thresh)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    if POS:                       # the self score is a constant: no gradient
        ds = tl.where(pos_ok & (pos_self == 0), ds, 0.0)
    dq += dot(cast(ds, kt.dtype, INTERP_BF16), tl.trans(kt), DOT_PREC, INTERP_BF16)
    return dq



@triton.jit
def _dkdv_program(pid, n_slices, n_split, heads_per_group, Q, K, V, DO, LSE, DELTA, DK, DV, DQP, KPM, LAY, LISTS,
                  COUNTS, ITEMS, QPOS, KPOS, rows_out,
                  q_b, q_h, q_l, q_d, k_b, k_h, k_l, k_d, v_b, v_h, v_l, v_d, do_b, do_h, do_l, do_d,
                  dk_s, dk_b, dk_h, dk_l, dk_d, dv_s, dv_b, dv_h, dv_l, dv_d, dqp_t, dqp_b, dqp_h, dqp_l, kpm_b, kpm_l,
                  H, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                  list_h, list_t, list_wf, scale, qk_scale, seed, drop_q0, drop_k0, drop_h0, drop_H, drop_thresh,
                  inv_keep,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  HAS_LAYOUT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                  DROPOUT: tl.constexpr, COUNT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                  DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
                  FOLD_SCALE: tl.constexpr, ORDER: tl.constexpr, VARLEN: tl.constexpr, FIVE: tl.constexpr,
                  POS: tl.constexpr, POS_CAUSAL: tl.constexpr):
    """dK, dV of one key tile of one (b, kv head) over its share of the group's G query heads and
    their visible query tiles, accumulated in registers (no atomics: deterministic). The
    ``n_slices = B * Hkv * n_split`` slices are (b, kv head, split): with ``n_split > 1`` the G
    heads are cut into n_split runs of ceil(G / n_split), and each split writes its fp32 partial
    sums at ``DK + split * dk_s`` (the launcher adds them in a fixed order). ``FIVE``: each visited
    (query tile, head) also gets this key tile's dQ share, in fp32 at ``DQP + key tile * dqp_t +
    b * dqp_b + h * dqp_h + row * dqp_l`` (unit stride along D; no VARLEN)."""
    n_nt = tl.cdiv(Lk, BLOCK_N)
    pid_n, slc = slice_tile(pid, n_nt, n_slices, heads_per_group, ORDER)
    bhk = slc // n_split
    split = slc % n_split
    b = bhk // Hkv
    hk = bhk % Hkv
    g_run = tl.cdiv(G, n_split)
    g0 = split * g_run
    g1 = tl.minimum(g0 + g_run, G)
    q_row0, k_row0 = pid_n * 0, pid_n * 0
    if VARLEN:                   # (segment, key tile) work list, as the forward's (forward.py)
        q_row0, k_row0, Lq, Lk, pid_n = work_item(ITEMS, pid_n)
        off = Lk - Lq
    n0 = pid_n * BLOCK_N
    rel_n = i64(tl.arange(0, BLOCK_N), IDX64)
    offs_n = n0 + rel_n
    offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
    offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
    n0_64 = (k_row0 + n0).to(tl.int64)
    k_ptrs = (K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h + n0_64 * k_l + rel_n[:, None] * k_l
              + offs_d[None, :] * k_d)
    v_ptrs = (V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h + n0_64 * v_l + rel_n[:, None] * v_l
              + offs_dv[None, :] * v_d)
    k = load_tile(k_ptrs, offs_n, Lk, offs_d, D, True, PAD_D)
    v = load_tile(v_ptrs, offs_n, Lk, offs_dv, Dv, True, PAD_DV)
    keep_k = offs_n < Lk
    if HAS_KPM:
        pad = tl.load(KPM + b.to(tl.int64) * kpm_b + offs_n * kpm_l, mask=offs_n < Lk, other=1)
        keep_k = pad == 0
        k = tl.where(keep_k[:, None], k, tl.zeros_like(k))    # padded keys: zeros, whatever they hold
        v = tl.where(keep_k[:, None], v, tl.zeros_like(v))
    if FIVE:                     # keys no query sees (the window's bounds): zero K rows, whatever they hold
        seen_any = keep_k        # (NaN, inf), as the dQ products take every row of K
        if HAS_LEFT:
            seen_any = seen_any & (offs_n >= off - left)
        if HAS_RIGHT:
            seen_any = seen_any & (offs_n <= Lq - 1 + off + right)
        k = tl.where(seen_any[:, None], k, tl.zeros_like(k))
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    visits = pid * 0                                         # int32 counter (COUNT only)
    t0, t1, t2, t3 = query_tile_range(n0, Lq, Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    n_full = t2 - t1
    n_part = (t1 - t0) + (t3 - t2)
    row = LISTS
    for g in range(g0, g1):
        h = hk * G + g
        bh = b * H + h
        q_base = Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h + q_row0.to(tl.int64) * q_l
        do_base = DO + b.to(tl.int64) * do_b + h.to(tl.int64) * do_h + q_row0.to(tl.int64) * do_l
        lse_base = LSE + bh.to(tl.int64) * rows_out + q_row0
        delta_base = DELTA + bh.to(tl.int64) * rows_out + q_row0
        dqp_base = DQP + pid_n.to(tl.int64) * dqp_t + b.to(tl.int64) * dqp_b + h.to(tl.int64) * dqp_h
        lay_ptr = LAY + h.to(tl.int64) * lay_h
        qpos_base, kpos = QPOS, offs_n
        if POS:                  # positions are per query head
            qpos_base = QPOS + bh.to(tl.int64) * Lq
            kpos = load_positions(KPOS + bh.to(tl.int64) * Lk, offs_n, Lk)
        if HAS_LAYOUT:
            row = LISTS + h.to(tl.int64) * list_h + pid_n.to(tl.int64) * list_t
            n_full = tl.load(row)
            n_part = tl.load(row + 1)
        listed = first_listed(row, 2, n_full, HAS_LAYOUT)
        for i in range(0, n_full):
            tile, listed = tile_index(row, 2, i, n_full, t1, n_full, t1, listed, HAS_LAYOUT)
            start_m = tile * BLOCK_M
            dk, dv = _dkdv_tile(dk, dv, k, v, keep_k, k_ptrs, q_base, do_base, lse_base, delta_base, dqp_base, start_m,
                                offs_n, offs_d, offs_dv, q_l, q_d, do_l, do_d, dqp_l, Lq, Lk, D, Dv, off, left, right,
                                lay_ptr,
                                lay_nkb, lay_bs, qk_scale, seed, b * drop_H + drop_h0 + h, q_row0 + drop_q0, k_row0 + drop_k0,
                                drop_thresh, inv_keep,
                                BLOCK_M, False, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV,
                                DOT_PREC, INTERP_BF16, IDX64, FOLD_SCALE, FIVE, qpos_base, kpos, POS, POS_CAUSAL)
        listed = first_listed(row, 2 + list_wf, n_part, HAS_LAYOUT)
        for i in range(0, n_part):
            tile, listed = tile_index(row, 2 + list_wf, i, n_part, t0, t1 - t0, t2, listed, HAS_LAYOUT)
            start_m = tile * BLOCK_M
            dk, dv = _dkdv_tile(dk, dv, k, v, keep_k, k_ptrs, q_base, do_base, lse_base, delta_base, dqp_base, start_m,
                                offs_n, offs_d, offs_dv, q_l, q_d, do_l, do_d, dqp_l, Lq, Lk, D, Dv, off, left, right,
                                lay_ptr,
                                lay_nkb, lay_bs, qk_scale, seed, b * drop_H + drop_h0 + h, q_row0 + drop_q0, k_row0 + drop_k0,
                                drop_thresh, inv_keep,
                                BLOCK_M, True, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV,
                                DOT_PREC, INTERP_BF16, IDX64, FOLD_SCALE, FIVE, qpos_base, kpos, POS, POS_CAUSAL)
        visits += n_full + n_part
    dk = dk * scale                                                          # dK = scale dS^T Q
    ok_k = offs_n[:, None] < Lk
    dk_ptrs = (DK + split.to(tl.int64) * dk_s + b.to(tl.int64) * dk_b + hk.to(tl.int64) * dk_h + n0_64 * dk_l
               + rel_n[:, None] * dk_l + offs_d[None, :] * dk_d)
    dv_ptrs = (DV + split.to(tl.int64) * dv_s + b.to(tl.int64) * dv_b + hk.to(tl.int64) * dv_h + n0_64 * dv_l
               + rel_n[:, None] * dv_l + offs_dv[None, :] * dv_d)
    tl.store(dk_ptrs, cast(dk, DK.dtype.element_ty, INTERP_BF16), mask=ok_k & (offs_d[None, :] < D))
    tl.store(dv_ptrs, cast(dv, DV.dtype.element_ty, INTERP_BF16), mask=ok_k & (offs_dv[None, :] < Dv))
    if COUNT:
        tl.store(COUNTS + slc * n_nt + pid_n, visits)


@triton.jit
def _dq_program(pid, n_slices, heads_per_group, Q, K, V, DO, LSE, DELTA, DQ, KPM, LAY, LISTS, COUNTS, ITEMS, QPOS,
                KPOS, rows_out,
                q_b, q_h, q_l, q_d, k_b, k_h, k_l, k_d, v_b, v_h, v_l, v_d, do_b, do_h, do_l, do_d,
                dq_b, dq_h, dq_l, dq_d, kpm_b, kpm_l,
                H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                list_h, list_t, list_wf,
                scale, qk_scale, seed, drop_q0, drop_k0, drop_h0, drop_H, drop_thresh, inv_keep,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_LAYOUT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
                DROPOUT: tl.constexpr, COUNT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
                FOLD_SCALE: tl.constexpr, ORDER: tl.constexpr, VARLEN: tl.constexpr, POS: tl.constexpr,
                POS_CAUSAL: tl.constexpr):
    """dQ of one query tile of one (b, h) over its visible key tiles, like the forward; its
    ``n_slices = B * H`` slices are ordered as the forward's."""
    n_mt = tl.cdiv(Lq, BLOCK_M)
    pid_m, bh = slice_tile(pid, n_mt, n_slices, heads_per_group, ORDER)
    b = bh // H
    h = bh % H
    hk = h // G
    q_row0, k_row0 = pid_m * 0, pid_m * 0
    if VARLEN:                   # (segment, query tile) work list, as the forward's
        q_row0, k_row0, Lq, Lk, pid_m = work_item(ITEMS, pid_m)
        off = Lk - Lq
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
    offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
    rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
    m0_64 = (q_row0 + m0).to(tl.int64)
    q = load_tile(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h + m0_64 * q_l + rel_m[:, None] * q_l
                  + offs_d[None, :] * q_d, offs_m, Lq, offs_d, D, True, PAD_D)
    do = load_tile(DO + b.to(tl.int64) * do_b + h.to(tl.int64) * do_h + m0_64 * do_l + rel_m[:, None] * do_l
                   + offs_dv[None, :] * do_d, offs_m, Lq, offs_dv, Dv, True, PAD_DV)
    lse, delta = _row_stats(LSE + bh.to(tl.int64) * rows_out + q_row0, DELTA + bh.to(tl.int64) * rows_out + q_row0,
                            offs_m, Lq)
    k_base, v_base, kpm_base, lay_ptr = kv_bases(K, V, KPM, LAY, b, h, hk, k_b, k_h, v_b, v_h, kpm_b, lay_h)
    if VARLEN:
        k_base += k_row0.to(tl.int64) * k_l
        v_base += k_row0.to(tl.int64) * v_l
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    qpos, kpos_base = offs_m, KPOS
    if POS:
        qpos = load_positions(QPOS + bh.to(tl.int64) * Lq, offs_m, Lq)
        kpos_base = KPOS + bh.to(tl.int64) * Lk
    row, n_full, n_part, t0, t1, t2 = key_tile_schedule(LISTS, h, pid_m, list_h, list_t, m0, Lq,
                                                        Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                                        HAS_LAYOUT)
    listed = first_listed(row, 2, n_full, HAS_LAYOUT)
    for i in range(0, n_full):
        tile, listed = tile_index(row, 2, i, n_full, t1, n_full, t1, listed, HAS_LAYOUT)
        start_n = tile * BLOCK_N
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                      k_l, k_d, v_l, v_d, kpm_l, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                      qk_scale, seed, b * drop_H + drop_h0 + h, q_row0 + drop_q0, k_row0 + drop_k0, drop_thresh, inv_keep,
                      BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                      LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, INTERP_BF16, IDX64, FOLD_SCALE,
                      qpos, kpos_base, POS, POS_CAUSAL)
    listed = first_listed(row, 2 + list_wf, n_part, HAS_LAYOUT)
    for i in range(0, n_part):
        tile, listed = tile_index(row, 2 + list_wf, i, n_part, t0, t1 - t0, t2, listed, HAS_LAYOUT)
        start_n = tile * BLOCK_N
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, kpm_base, start_n, offs_m, offs_d, offs_dv,
                      k_l, k_d, v_l, v_d, kpm_l, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
                      qk_scale, seed, b * drop_H + drop_h0 + h, q_row0 + drop_q0, k_row0 + drop_k0, drop_thresh, inv_keep,
                      BLOCK_N, True, HAS_LEFT, HAS_RIGHT,
                      LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV, DOT_PREC, INTERP_BF16, IDX64, FOLD_SCALE,
                      qpos, kpos_base, POS, POS_CAUSAL)
    dq = dq * scale
    dq_ptrs = (DQ + b.to(tl.int64) * dq_b + h.to(tl.int64) * dq_h + m0_64 * dq_l + rel_m[:, None] * dq_l
               + offs_d[None, :] * dq_d)
    tl.store(dq_ptrs, cast(dq, DQ.dtype.element_ty, INTERP_BF16),
             mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
    if COUNT:
        tl.store(COUNTS + bh * n_mt + pid_m, n_full + n_part)


@triton.jit(do_not_specialize=["seed", "drop_q0", "drop_k0", "drop_h0", "drop_H"] + UNSPECIALIZED_BWD_ARGS)
def bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, DQP, KPM, LAY, LISTS1, LISTS2, COUNTS, ITEMS1, ITEMS2, QPOS, KPOS,
               q_strides, k_strides, v_strides, do_strides, dq_strides, dk_strides, dv_strides, dqp_strides,
               kpm_strides,
               B, H, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
               listk_h, listk_t, listk_wf, list_h, list_t, list_wf,
               scale, qk_scale, seed, drop_q0, drop_k0, drop_h0, drop_H, drop_thresh, inv_keep, n_split, group1, group2,
               rows_out,
               BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_LAYOUT: tl.constexpr, LAYOUT_MASK1: tl.constexpr, LAYOUT_MASK2: tl.constexpr,
               HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, COUNT: tl.constexpr, PAD_D: tl.constexpr,
               PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
               FOLD_SCALE: tl.constexpr, ORDER1: tl.constexpr, ORDER2: tl.constexpr, VARLEN: tl.constexpr = False,
               FIVE: tl.constexpr = False, POS: tl.constexpr = False, POS_CAUSAL: tl.constexpr = False):
    """The whole backward but Delta in one launch (as FlexAttention's): a 1-D grid whose first
    ``cdiv(Lk, BLOCK_N1) * B * Hkv * n_split`` programs each compute dK, dV of one key tile
    (`_dkdv_program`, tiles BLOCK_M1 x BLOCK_N1, tile lists LISTS1 by key) and whose remaining
    ``cdiv(Lq, BLOCK_M2) * B * H`` programs each compute dQ of one query tile (`_dq_program`, tiles
    BLOCK_M2 x BLOCK_N2, LISTS2 by query). The two kinds share no output, so no program waits for
    another and none uses atomics. The heavier dK/dV programs (a loop over a group's query heads)
    come first, each kind heaviest first within itself (ORDER1 / ORDER2). COUNTS (COUNT only): the
    tiles each program visited, dK/dV programs' first. ``VARLEN``: ``Lk`` / ``Lq`` count the key /
    query work lists ITEMS1 / ITEMS2 (in tiles of BLOCK_N1 / BLOCK_M2), as in the forward.

    The scalar arguments carry the names of the C++ `AttnParams` fields (csrc/attention/attention.h;
    ``listk_*`` are its tile lists by key, LISTS1) and the launcher (`LaunchPlan.bwd_args`) passes
    them by name; the element strides travel as tuples ``<tensor>_strides`` = (``_b``, ``_h``,
    ``_l``, ``_d``), whose elements the kernel names as the C++ fields (``kpm_strides`` = (kpm_b,
    kpm_l)). Without a C++ field: the last-dim strides ``q_d``, ``k_d``, ``v_d``, ``do_d``; the
    strides of DQ and of the (n_split, B, Hkv, Lk, D) dK / dV buffers (``dq_*``, ``dk_s``, ``dk_*``,
    ``dv_*``: C++ writes them contiguous); ``Hkv`` (C++: H / G); ``n_split``, ``group1`` /
    ``group2`` (the L2 head groups of the two kinds of programs) and ``rows_out`` (rows of LSE and
    Delta per (b, h)); ``seed`` is C++'s seed_lo / seed_hi; ``drop_q0``, ``drop_k0``, ``drop_h0``,
    ``drop_H`` (no C++ field): where dropout draws, as in `fwd_kernel`.

    ``FIVE`` (the five-product backward, FlashAttention-3's count): the grid holds only the dK/dV
    programs, which also compute dQ = dS K per visited tile pair into the fp32 partial buffer DQP
    ``(key tiles, B, H, Lq, D)`` (``dqp_strides`` = (dqp_t, dqp_b, dqp_h, dqp_l)); `dq_reduce_kernel`
    then sums each query tile's partials in a fixed order (deterministic, no atomics). The dQ
    programs' S and dP products (the seven-product backward's extra two) are gone.

    ``POS``: the forward's positions (`fwd_kernel`: int32 ``QPOS (B*H, Lq)``, ``KPOS (B*H, Lk)``,
    ``POS_CAUSAL``) in both kinds of programs; a self score passes no gradient to q or k."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    do_b, do_h, do_l, do_d = do_strides
    dq_b, dq_h, dq_l, dq_d = dq_strides
    dk_s, dk_b, dk_h, dk_l, dk_d = dk_strides
    dv_s, dv_b, dv_h, dv_l, dv_d = dv_strides
    kpm_b, kpm_l = kpm_strides
    dqp_t, dqp_b, dqp_h, dqp_l = dqp_strides
    pid = tl.program_id(0)
    n_slices1 = B * Hkv * n_split
    n_kv = tl.cdiv(Lk, BLOCK_N1) * n_slices1
    if FIVE or pid < n_kv:
        _dkdv_program(pid, n_slices1, n_split, group1, Q, K, V, DO, LSE, DELTA, DK, DV, DQP, KPM, LAY, LISTS1,
                      COUNTS, ITEMS1, QPOS, KPOS, rows_out,
                      q_b, q_h, q_l, q_d, k_b, k_h, k_l, k_d, v_b, v_h, v_l, v_d, do_b, do_h, do_l, do_d,
                      dk_s, dk_b, dk_h, dk_l, dk_d, dv_s, dv_b, dv_h, dv_l, dv_d, dqp_t, dqp_b, dqp_h, dqp_l,
                      kpm_b, kpm_l, H, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                      listk_h, listk_t, listk_wf, scale, qk_scale, seed, drop_q0, drop_k0, drop_h0, drop_H, drop_thresh,
                      inv_keep, BLOCK_M1, BLOCK_N1, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT,
                      LAYOUT_MASK1, HAS_KPM, DROPOUT, COUNT, PAD_D, PAD_DV, DOT_PREC, INTERP_BF16, IDX64,
                      FOLD_SCALE, ORDER1, VARLEN, FIVE, POS, POS_CAUSAL)
    else:
        _dq_program(pid - n_kv, B * H, group2, Q, K, V, DO, LSE, DELTA, DQ, KPM, LAY, LISTS2, COUNTS + n_kv,
                    ITEMS2, QPOS, KPOS, rows_out,
                    q_b, q_h, q_l, q_d, k_b, k_h, k_l, k_d, v_b, v_h, v_l, v_d, do_b, do_h, do_l, do_d,
                    dq_b, dq_h, dq_l, dq_d, kpm_b, kpm_l,
                    H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                    list_h, list_t, list_wf, scale, qk_scale, seed, drop_q0, drop_k0, drop_h0, drop_H, drop_thresh,
                    inv_keep, BLOCK_M2, BLOCK_N2, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT,
                    LAYOUT_MASK2, HAS_KPM, DROPOUT, COUNT, PAD_D, PAD_DV, DOT_PREC, INTERP_BF16, IDX64,
                    FOLD_SCALE, ORDER2, VARLEN, POS, POS_CAUSAL)


@triton.jit(do_not_specialize=["list_h", "list_t", "list_wf"])
def dq_reduce_kernel(DQP, DQ, LISTS, COUNTS, dqp_strides, dq_strides, H, Lq, Lk, D, off, left, right,
                     list_h, list_t, list_wf, scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
                     HAS_RIGHT: tl.constexpr, HAS_LAYOUT: tl.constexpr, COUNT: tl.constexpr,
                     INTERP_BF16: tl.constexpr):
    """dQ of the five-product backward (`bwd_kernel` with ``FIVE``): per (b, h, query tile of
    BLOCK_M rows), the fp32 partials the dK/dV programs of its visible key tiles (BLOCK_N keys,
    the forward's tile lists LISTS for these tiles) wrote into DQP, added in the tile schedule's
    order (full tiles, then partial ones: the same order every run, so the same bits), scaled and
    cast. A row no key tile reaches gets 0. COUNTS (COUNT only): the key tiles each program added."""
    dqp_t, dqp_b, dqp_h, dqp_l = dqp_strides
    dq_b, dq_h, dq_l, dq_d = dq_strides
    pid_m, bh, b, h = _row_tile(tl.program_id(0), Lq, H, BLOCK_M)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    tile_ptrs = (DQP + b.to(tl.int64) * dqp_b + h.to(tl.int64) * dqp_h + m0.to(tl.int64) * dqp_l
                 + tl.arange(0, BLOCK_M)[:, None] * dqp_l + offs_d[None, :])
    row, n_full, n_part, t0, t1, t2 = key_tile_schedule(LISTS, h, pid_m, list_h, list_t, m0, Lq, Lk, off, left,
                                                        right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_LAYOUT)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    listed = first_listed(row, 2, n_full, HAS_LAYOUT)
    for i in range(0, n_full):
        tile, listed = tile_index(row, 2, i, n_full, t1, n_full, t1, listed, HAS_LAYOUT)
        dq += tl.load(tile_ptrs + tile.to(tl.int64) * dqp_t, mask=ok, other=0.0)
    listed = first_listed(row, 2 + list_wf, n_part, HAS_LAYOUT)
    for i in range(0, n_part):
        tile, listed = tile_index(row, 2 + list_wf, i, n_part, t0, t1 - t0, t2, listed, HAS_LAYOUT)
        dq += tl.load(tile_ptrs + tile.to(tl.int64) * dqp_t, mask=ok, other=0.0)
    dq = dq * scale
    tl.store(DQ + b.to(tl.int64) * dq_b + h.to(tl.int64) * dq_h + offs_m[:, None].to(tl.int64) * dq_l
             + offs_d[None, :] * dq_d, cast(dq, DQ.dtype.element_ty, INTERP_BF16), mask=ok)
    if COUNT:
        tl.store(COUNTS + tl.program_id(0), n_full + n_part)
