"""Forward kernel: FlashAttention-2's online softmax (Dao 2023, Alg. 1) over the visible key tiles of
one query tile, full tiles first (no masking code), then partial ones.

Two switches (benchmarks/results/offline-sm90/tma_ws_trials.md compares their offline sm_90 code
with the plain loads'; the GPU suite's explore section times them). ``KV_TMA`` is on by default
where it applies (the launcher's `tma_default`: sm_90 or later, 16-bit K / V with aligned rows; not
for packed calls), ``WARP_SPEC`` is a trial, off. ``KV_TMA`` loads
the K and V tiles through tensor descriptors (TMA on sm_90; rows past Lk and columns past D read as
zeros, as the masked loads give), which needs unit-stride rows and 16-byte aligned K / V rows
(the launcher's `kv_tma_ok`) and ``triton.set_allocator`` for the in-kernel descriptors;
``WARP_SPEC`` asks Triton to warp-specialize the full-tile loop (``tl.range(warp_specialize=True)``).
"""
import triton
import triton.language as tl

from ..jit import UNSPECIALIZED_ARGS, cast, dot, i64, load_tile
from .schedule import (
    dropout_keep,
    first_listed,
    key_tile_schedule,
    kv_bases,
    load_positions,
    mask_scores,
    positions_scores,
    program_tile,
    tile_index,
    work_item,
)


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, kpm_base, start_n, offs_m, offs_d, offs_dv,
              k_l, k_d, v_l, v_d, kpm_l, Lq, Lk, D, Dv, off, left, right, lay_ptr, lay_nkb, lay_bs,
              qk_scale, seed, bh, q_row0, k_row0, drop_thresh,
              BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
              DROPOUT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
              DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
              FOLD_SCALE: tl.constexpr, KV_TMA: tl.constexpr, qpos, kpos_base, POS: tl.constexpr,
              POS_CAUSAL: tl.constexpr):
    """One key tile of the online softmax (FA-2 Alg. 1, lines 8-10). ``PARTIAL``: a partial tile
    (`effattn.tiles`), masked elementwise; a full one runs without masking code. ``FOLD_SCALE``
    (``qk_scale > 0``): the row max is taken on the raw scores and the scale folded into the
    exponent, one FMA per score instead of a multiply and a subtract. ``POS``: every tile also
    applies the positions rule (`schedule.positions_scores`; the query rows' positions ``qpos``,
    the keys' read at ``kpos_base``; the launcher turns FOLD_SCALE off with it)."""
    rel_n = i64(tl.arange(0, BLOCK_N), IDX64)
    offs_n = start_n + rel_n
    k_tile = k_base + start_n.to(tl.int64) * k_l             # int64: long rows of a (B, L, H, D) view
    v_tile = v_base + start_n.to(tl.int64) * v_l
    if KV_TMA:
        kt = tl.trans(k_desc.load([start_n, 0]))                # (BLOCK_D, BLOCK_N), zeros out of bounds
    else:
        kt = load_tile(k_tile + offs_d[:, None] * k_d + rel_n[None, :] * k_l, offs_d, D, offs_n, Lk, PAD_D, PARTIAL)
    s = dot(q, kt, DOT_PREC, INTERP_BF16)                       # S = Q K^T
    if not FOLD_SCALE:
        s = s * qk_scale                                        # in log2 units
    s, seen = mask_scores(s, offs_m, offs_n, kpm_base, kpm_l, Lq, Lk, off, left, right, lay_ptr, lay_nkb, lay_bs,
                          PARTIAL, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, IDX64)
    if POS:
        kpos = load_positions(kpos_base, offs_n, Lk)
        s, ok, _ = positions_scores(s, qpos[:, None], kpos[None, :], POS_CAUSAL)
        seen = seen & (tl.max(ok.to(tl.int32), 0) > 0)
    # m_new = max(m_old, rowmax(S)); a row that has seen nothing yet keeps m = -inf, and the
    # shift m_ref = 0 keeps exp2(-inf - m_ref) = 0 instead of NaN
    # (with FOLD_SCALE, max(c S) = c max(S) for c = qk_scale > 0, and -inf stays -inf)
    m_tile = tl.max(s, 1)
    if FOLD_SCALE:
        m_tile = m_tile * qk_scale
    m_new = tl.maximum(m_i, m_tile)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FOLD_SCALE:
        p = tl.exp2(s * qk_scale - m_ref[:, None])           # P~ = exp(S - m_new)
    else:
        p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)                              # exp(m_old - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)                          # l = alpha l + rowsum(P~)
    if DROPOUT:  # the normalizer sums undropped probabilities; dropout acts on P V only
        # packed sequences draw at the packed rows (q_row0 + i, k_row0 + j); plain calls' row0 are 0
        p = tl.where(dropout_keep(seed, bh, q_row0 + offs_m[:, None], k_row0 + offs_n[None, :], drop_thresh), p,
                     0.0)
    if KV_TMA:
        v = v_desc.load([start_n, 0])
    else:
        v = load_tile(v_tile + rel_n[:, None] * v_l + offs_dv[None, :] * v_d, offs_n, Lk, offs_dv, Dv, PARTIAL, PAD_DV)
    if PARTIAL or HAS_KPM or POS:  # keys no row sees: zero values, so NaN / inf in them give 0 * 0
        v = tl.where(seen[:, None], v, tl.zeros_like(v))
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERP_BF16), v, DOT_PREC, INTERP_BF16)  # O = alpha O + P~ V
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["seed", "drop_q0", "drop_k0", "drop_h0", "drop_H"] + UNSPECIALIZED_ARGS)
def fwd_kernel(Q, K, V, O, LSE, KPM, LAY, LISTS, COUNTS, ITEMS, QPOS, KPOS,
               q_strides, k_strides, v_strides, kpm_strides,
               H, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
               list_h, list_t, list_wf,
               qk_scale, seed, drop_q0, drop_k0, drop_h0, drop_H, drop_thresh, inv_keep, heads_per_group, rows_out,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_LAYOUT: tl.constexpr, LAYOUT_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
               DROPOUT: tl.constexpr, COUNT: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
               DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr, IDX64: tl.constexpr,
               FOLD_SCALE: tl.constexpr, ORDER: tl.constexpr, KV_TMA: tl.constexpr = False,
               WARP_SPEC: tl.constexpr = False, VARLEN: tl.constexpr = False, POS: tl.constexpr = False,
               POS_CAUSAL: tl.constexpr = False):
    """O (B, H, Lq, Dv) and LSE (B, H, Lq), natural log, for one query tile of one (b, h).
    1-D grid of cdiv(Lq, BLOCK_M) * B * H programs, query tiles fastest (a grid's y and z sizes
    are limited to 65535, B * H is not). ``rows_out``: the rows of O and LSE per (b, h).

    ``VARLEN`` (packed sequences, B = 1): the launcher passes ``Lq = n_items * BLOCK_M`` and ITEMS, an
    int32 (n_items, 5) work list of (first query, end query, first key, end key, query tile) of a
    segment, longest segments first; a program reads its item and then works in the segment's own
    coordinates (its lengths, bottom-right offset and rows), so no program is empty.

    The scalar arguments carry the names of the C++ `AttnParams` fields (csrc/attention/attention.h)
    and the launcher passes them by name; the element strides travel as tuples ``q_strides`` = (q_b,
    q_h, q_l, q_d), ``k_strides``, ``v_strides`` likewise and ``kpm_strides`` = (kpm_b, kpm_l), whose
    elements the kernel names as the C++ fields. ``q_d``, ``k_d``, ``v_d`` (last-dim strides, unit
    there), ``heads_per_group`` and ``rows_out`` have no C++ field, ``seed`` is its seed_lo / seed_hi.
    ``drop_q0`` / ``drop_k0`` (no C++ field): added to the rows and keys dropout draws at, the
    call's ``positions``; dropout draws at head ``b * drop_H + drop_h0 + h`` (a head shard: the global
    head), so a context-parallel call draws what the whole sequence's call would."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    kpm_b, kpm_l = kpm_strides
    n_mt = tl.cdiv(Lq, BLOCK_M)
    pid_m, bh = program_tile(tl.program_id(0), n_mt, heads_per_group, ORDER)
    b = bh // H
    h = bh % H
    hk = h // G                                               # GQA: the kv head of this q head
    q_row0 = pid_m * 0                                        # the segment's first query / key row
    k_row0 = pid_m * 0
    if VARLEN:
        q_row0, k_row0, Lq, Lk, pid_m = work_item(ITEMS, pid_m)
        off = Lk - Lq
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = i64(tl.arange(0, BLOCK_D), IDX64)
    offs_dv = i64(tl.arange(0, BLOCK_DV), IDX64)
    rel_m = i64(tl.arange(0, BLOCK_M), IDX64)
    q_ptrs = (Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h + (q_row0 + m0).to(tl.int64) * q_l
              + rel_m[:, None] * q_l + offs_d[None, :] * q_d)
    q = load_tile(q_ptrs, offs_m, Lq, offs_d, D, True, PAD_D)
    k_base, v_base, kpm_base, lay_ptr = kv_bases(K, V, KPM, LAY, b, h, hk, k_b, k_h, v_b, v_h, kpm_b, lay_h)
    if VARLEN:
        k_base += k_row0.to(tl.int64) * k_l
        v_base += k_row0.to(tl.int64) * v_l
    if KV_TMA:      # one (Lk, D) view per (b, kv head): its bounds zero-fill the last tile's rows
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Lk, D], strides=[k_l, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[Lk, Dv], strides=[v_l, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc, v_desc = k_base, v_base                       # unused
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    row, n_full, n_part, t0, t1, t2 = key_tile_schedule(LISTS, h, pid_m, list_h, list_t, m0, Lq,
                                                        Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                                        HAS_LAYOUT)
    qpos, kpos_base = offs_m, KPOS
    if POS:
        qpos = load_positions(QPOS + bh.to(tl.int64) * Lq, offs_m, Lq)
        kpos_base = KPOS + bh.to(tl.int64) * Lk
    listed = first_listed(row, 2, n_full, HAS_LAYOUT)
    for i in tl.range(0, n_full, warp_specialize=WARP_SPEC):
        tile, listed = tile_index(row, 2, i, n_full, t1, n_full, t1, listed, HAS_LAYOUT)
        start_n = tile * BLOCK_N
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, kpm_base, start_n, offs_m,
                                  offs_d, offs_dv, k_l, k_d, v_l, v_d, kpm_l, Lq, Lk, D, Dv, off, left, right,
                                  lay_ptr, lay_nkb, lay_bs, qk_scale, seed, b * drop_H + drop_h0 + h, q_row0 + drop_q0,
                                  k_row0 + drop_k0, drop_thresh,
                                  BLOCK_N, False, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV,
                                  DOT_PREC, INTERP_BF16, IDX64, FOLD_SCALE, KV_TMA, qpos, kpos_base, POS, POS_CAUSAL)
    listed = first_listed(row, 2 + list_wf, n_part, HAS_LAYOUT)
    for i in range(0, n_part):
        tile, listed = tile_index(row, 2 + list_wf, i, n_part, t0, t1 - t0, t2, listed, HAS_LAYOUT)
        start_n = tile * BLOCK_N
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, kpm_base, start_n, offs_m,
                                  offs_d, offs_dv, k_l, k_d, v_l, v_d, kpm_l, Lq, Lk, D, Dv, off, left, right,
                                  lay_ptr, lay_nkb, lay_bs, qk_scale, seed, b * drop_H + drop_h0 + h, q_row0 + drop_q0,
                                  k_row0 + drop_k0, drop_thresh,
                                  BLOCK_N, True, HAS_LEFT, HAS_RIGHT, LAYOUT_MASK, HAS_KPM, DROPOUT, PAD_D, PAD_DV,
                                  DOT_PREC, INTERP_BF16, IDX64, FOLD_SCALE, KV_TMA, qpos, kpos_base, POS, POS_CAUSAL)
    # FA-2 Alg. 1 lines 12-13: O = O / l, L = m + log(l); a row that saw no key: O = 0, L = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (inv_keep / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    row_ok = offs_m < Lq
    o_ptrs = O + (bh.to(tl.int64) * rows_out + q_row0 + offs_m[:, None]) * Dv + offs_dv[None, :]
    tl.store(o_ptrs, cast(out, O.dtype.element_ty, INTERP_BF16), mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + bh.to(tl.int64) * rows_out + q_row0 + offs_m, lse, mask=row_ok)
    if COUNT:
        tl.store(COUNTS + bh * n_mt + pid_m, n_full + n_part)
