"""Triton kernels of relative-position attention (`effattn.relative_attention`), forward and
backward (math only; the launchers in ``launch.py``): the position term computed per tile, never an
``(Lq, Lk)`` matrix.

For a query tile ``[i0, i0 + BM)`` and a key tile ``[j0, j0 + BN)`` the distances ``d_ij = pos(i) - j``
take ``BM + BN - 1`` values, ``d = dmin + w`` with ``w = (i - i0) - (j - j0) + BN - 1``. The kernel
loads the rows of ``r`` those distances read (``idx(d)``, clamped), forms ``QR = query_tile @ R_band^T``
(``BM x W``) and picks ``QR[i, w(i, j)]`` with `tl.gather`: the "relative shift" done in-tile. Then
FlashAttention-2's online softmax (Dao 2023, Alg. 1) over the key tiles the window allows.

Backward (FlashAttention-2 Alg. 2, three launches, no atomics): a dQ program per query tile also
gives ``dquery`` (the score gradient gathered into the tile's band, times the band of r); a dK/dV
program per key tile, per query head (GQA groups summed in torch); and a distance-band pass for
``r``: one program per (block of distances, head) sums ``dT[i, pos(i) - d] query_i`` over the batch
and the query tiles in a fixed order, and torch folds the distances onto the rows of r (the
clamped ends summed). Products are float32 (``ieee``) for now. The dK/dV programs visit only the
query tiles the window lets see their key tile, the distance pass skips blocks of distances the
window hides.

Arguments: the names of the C++ `AttnParams` fields (csrc/attention/attention.h) where one exists
(``H``, ``G``, ``Lq``, ``Lk``, ``D``, ``Dv``, ``left``, ``right``, ``scale``, ``B``); element strides as one
tuple per tensor, unpacked to the C++ names at the top of each kernel: ``q_strides`` = (q_b, q_h, q_l,
q_d), ``k_strides``, ``v_strides`` likewise, ``kpm_strides`` = (kpm_b, kpm_l). No C++ field: ``R``
(``r`` (H, n_dist, D)) and ``r_strides`` = (r_h, r_n, r_d), ``QRY`` (the ``query`` the position term
reads) and ``query_strides`` = (query_b, query_h, query_l, query_d), the last-dim strides ``q_d``, ``k_d``,
``v_d``, ``n_dist`` and ``max_distance`` (0 with ``PAST_ONLY``). ``launch.kernel_args`` builds them by
name; every launch passes them by keyword.
"""
import triton
import triton.language as tl

from ..online_softmax import finish, key_range, online_step


@triton.jit
def _ridx(d, n_dist, max_distance, PAST_ONLY: tl.constexpr):
    """Row of r read at distance d (clamped)."""
    if PAST_ONLY:
        m = tl.minimum(tl.maximum(d, 0), n_dist - 1)
    else:
        m = tl.minimum(tl.maximum(d, -max_distance), max_distance) + max_distance
    return m


@triton.jit
def _visible(j, pos, rows_ok, Lk, left, right, kpm_base, kpm_l, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             HAS_KPM: tl.constexpr):
    """Whether key j (any (rows, n) block of key indices) is visible to the rows at ``pos``."""
    ok = (j >= 0) & (j < Lk) & rows_ok[:, None]
    if HAS_LEFT:
        ok = ok & (j >= pos[:, None] - left)
    if HAS_RIGHT:
        ok = ok & (j <= pos[:, None] + right)
    if HAS_KPM:
        pad = tl.load(kpm_base + tl.minimum(tl.maximum(j, 0), Lk - 1) * kpm_l)
        ok = ok & (pad == 0)
    return ok


@triton.jit
def _tile_scores(q, qry, k_base, k_l, k_d, r_base, r_n, r_d, kpm_base, kpm_l, i0, j0, off, pos, rows_ok, offs_d, Lk, D,
                 n_dist, max_distance, left, right, scale, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
                 PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """Scaled, masked scores of query tile i0 against key tile j0, and the tile's band of r
    ``(BLOCK_D, W)``: distance ``dmin + w`` for column w, ``w = (i - i0) - (j - j0) + BN - 1``."""
    offs_n = j0 + tl.arange(0, BN)
    kt = tl.load(k_base + offs_n[None, :] * k_l + offs_d[:, None] * k_d,
                 mask=(offs_n[None, :] < Lk) & (offs_d[:, None] < D), other=0.0).to(tl.float32)
    d = i0 + off - (j0 + BN - 1) + tl.arange(0, W)
    rt = tl.load(r_base + _ridx(d, n_dist, max_distance, PAST_ONLY)[None, :].to(tl.int64) * r_n + offs_d[:, None] * r_d,
                 mask=offs_d[:, None] < D, other=0.0).to(tl.float32)
    w_of = (tl.arange(0, BM)[:, None] - tl.arange(0, BN)[None, :] + BN - 1).to(tl.int32)
    s = tl.dot(q, kt, input_precision="ieee") + tl.gather(tl.dot(qry, rt, input_precision="ieee"), w_of, axis=1)
    ok = _visible(offs_n[None, :] + 0 * pos[:, None], pos, rows_ok, Lk, left, right, kpm_base, kpm_l, HAS_LEFT,
                  HAS_RIGHT, HAS_KPM)
    return tl.where(ok, s * scale, float("-inf")), rt


@triton.jit
def _load2(base, rows, n_rows, stride_r, cols, n_cols, stride_c):
    return tl.load(base + rows[:, None] * stride_r + cols[None, :] * stride_c,
                   mask=(rows[:, None] < n_rows) & (rows[:, None] >= 0) & (cols[None, :] < n_cols),
                   other=0.0).to(tl.float32)


@triton.jit
def _query_tile(Q, QRY, K, V, q_b, q_h, q_l, q_d, k_b, k_h, v_b, v_h, query_b, query_h, query_l, query_d, H, G, Lq, Lk, D,
                BM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a program over query tile ``program_id(0)`` of slice ``program_id(1) = (b, h)`` starts with."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    i0 = tl.program_id(0) * BM
    offs_m = i0 + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load2(Q + b * q_b + h * q_h, offs_m, Lq, q_l, offs_d, D, q_d)
    qry = _load2(QRY + b * query_b + h * query_h, offs_m, Lq, query_l, offs_d, D, query_d)
    k_base, v_base = K + b * k_b + (h // G) * k_h, V + b * v_b + (h // G) * v_h
    return bh, b, h, Lk - Lq, i0, offs_m, offs_d, tl.arange(0, BLOCK_DV), offs_m < Lq, q, qry, k_base, v_base


@triton.jit
def relative_fwd_kernel(Q, K, V, R, QRY, KPM, O, LSE,
                        q_strides, k_strides, v_strides, r_strides, query_strides, kpm_strides,
                        H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                        BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """O (B, H, Lq, Dv), LSE (B, H, Lq): contiguous float32."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    r_h, r_n, r_d = r_strides
    query_b, query_h, query_l, query_d = query_strides
    kpm_b, kpm_l = kpm_strides
    bh, b, h, off, i0, offs_m, offs_d, offs_dv, rows_ok, q, qry, k_base, v_base = _query_tile(
        Q, QRY, K, V, q_b, q_h, q_l, q_d, k_b, k_h, v_b, v_h, query_b, query_h, query_l, query_d, H, G, Lq, Lk, D,
        BM, BLOCK_D, BLOCK_DV)
    pos = offs_m + off
    lo, hi = key_range(i0 + off, i0 + BM - 1 + off, Lk, left, right, BN, HAS_LEFT, HAS_RIGHT)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_DV], tl.float32)
    for j0 in range(lo, hi, BN):
        s, _ = _tile_scores(q, qry, k_base, k_l, k_d, R + h * r_h, r_n, r_d, KPM + b * kpm_b, kpm_l, i0, j0, off, pos,
                            rows_ok, offs_d, Lk, D, n_dist, max_distance, left, right, scale, BM, BN, W, PAST_ONLY,
                            HAS_LEFT, HAS_RIGHT, HAS_KPM)
        p, alpha, m_new, l_i = online_step(m_i, l_i, s)
        v = _load2(v_base, j0 + tl.arange(0, BN), Lk, v_l, offs_dv, Dv, v_d)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    tl.store(O + (bh * Lq + offs_m[:, None]) * Dv + offs_dv[None, :], out, mask=rows_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + bh * Lq + offs_m, lse, mask=rows_ok)


@triton.jit
def _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv):
    """lse (-inf made 0), Delta and dO of query rows ``offs_m`` (contiguous (B*H, Lq[, Dv]) float32)."""
    lse = tl.load(LSE + bh * Lq + offs_m, mask=rows_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + bh * Lq + offs_m, mask=rows_ok, other=0.0)
    do = tl.load(DO + (bh * Lq + offs_m[:, None]) * Dv + offs_dv[None, :], mask=rows_ok[:, None] & (offs_dv[None, :] < Dv),
                 other=0.0)
    return lse, delta, do


@triton.jit
def relative_dq_kernel(Q, K, V, R, QRY, KPM, LSE, DELTA, DO, DQ, DQRY,
                       q_strides, k_strides, v_strides, r_strides, query_strides, kpm_strides,
                       H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                       BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """dQ and dQuery of one query tile (FA-2 Alg. 2); the position term's gradient reaches ``query``
    through the tile's band: ``dT_band[i, w] = dT[i, j(i, w)]`` (a gather), then ``dT_band @ R_band``."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    r_h, r_n, r_d = r_strides
    query_b, query_h, query_l, query_d = query_strides
    kpm_b, kpm_l = kpm_strides
    bh, b, h, off, i0, offs_m, offs_d, offs_dv, rows_ok, q, qry, k_base, v_base = _query_tile(
        Q, QRY, K, V, q_b, q_h, q_l, q_d, k_b, k_h, v_b, v_h, query_b, query_h, query_l, query_d, H, G, Lq, Lk, D,
        BM, BLOCK_D, BLOCK_DV)
    lse, delta, do = _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv)
    pos = offs_m + off
    jl = tl.arange(0, BM)[:, None] + BN - 1 - tl.arange(0, W)[None, :]              # key of band column w
    in_tile = (jl >= 0) & (jl < BN)
    jl = tl.minimum(tl.maximum(jl, 0), BN - 1).to(tl.int32)
    lo, hi = key_range(i0 + off, i0 + BM - 1 + off, Lk, left, right, BN, HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BM, BLOCK_D], tl.float32)
    dqry = tl.zeros([BM, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BN):
        s, rt = _tile_scores(q, qry, k_base, k_l, k_d, R + h * r_h, r_n, r_d, KPM + b * kpm_b, kpm_l, i0, j0, off, pos,
                             rows_ok, offs_d, Lk, D, n_dist, max_distance, left, right, scale, BM, BN, W, PAST_ONLY,
                             HAS_LEFT, HAS_RIGHT, HAS_KPM)
        p = tl.exp(s - lse[:, None])
        offs_n = j0 + tl.arange(0, BN)
        v = _load2(v_base, offs_n, Lk, v_l, offs_dv, Dv, v_d)
        dT = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None]) * scale
        dq += tl.dot(dT, _load2(k_base, offs_n, Lk, k_l, offs_d, D, k_d), input_precision="ieee")
        band = tl.where(in_tile, tl.gather(dT, jl, axis=1), 0.0)                       # (BM, W)
        dqry += tl.dot(band, tl.trans(rt), input_precision="ieee")
    ptr = (bh * Lq + offs_m[:, None]) * D + offs_d[None, :]
    mask = rows_ok[:, None] & (offs_d[None, :] < D)
    tl.store(DQ + ptr, dq, mask=mask)
    tl.store(DQRY + ptr, dqry, mask=mask)


@triton.jit
def relative_dkv_kernel(Q, K, V, R, QRY, KPM, LSE, DELTA, DO, DK, DV,
                        q_strides, k_strides, v_strides, r_strides, query_strides, kpm_strides,
                        H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                        BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """dK, dV of one key tile for one query head (the GQA group is summed in torch), over every
    query tile (the masks remove the invisible pairs)."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    r_h, r_n, r_d = r_strides
    query_b, query_h, query_l, query_d = query_strides
    kpm_b, kpm_l = kpm_strides
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    off = Lk - Lq
    j0 = tl.program_id(0) * BN
    offs_n = j0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base, v_base = K + b * k_b + (h // G) * k_h, V + b * v_b + (h // G) * v_h
    v = _load2(v_base, offs_n, Lk, v_l, offs_dv, Dv, v_d)
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_DV], tl.float32)
    # the query tiles that may see this key tile: pos(i) - left <= j <= pos(i) + right
    q_lo = 0
    q_hi = Lq
    if HAS_RIGHT:
        q_lo = tl.maximum(j0 - right - off, 0) // BM * BM
    if HAS_LEFT:
        q_hi = tl.minimum(j0 + BN - 1 + left - off + 1, Lq)
    for i0 in range(q_lo, q_hi, BM):
        offs_m = i0 + tl.arange(0, BM)
        rows_ok = offs_m < Lq
        q = _load2(Q + b * q_b + h * q_h, offs_m, Lq, q_l, offs_d, D, q_d)
        qry = _load2(QRY + b * query_b + h * query_h, offs_m, Lq, query_l, offs_d, D, query_d)
        lse, delta, do = _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv)
        s, _ = _tile_scores(q, qry, k_base, k_l, k_d, R + h * r_h, r_n, r_d, KPM + b * kpm_b, kpm_l, i0, j0, off,
                            offs_m + off, rows_ok, offs_d, Lk, D, n_dist, max_distance, left, right, scale, BM, BN, W,
                            PAST_ONLY, HAS_LEFT, HAS_RIGHT, HAS_KPM)
        p = tl.exp(s - lse[:, None])
        dv += tl.dot(tl.trans(p), do, input_precision="ieee")
        dT = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None]) * scale
        dk += tl.dot(tl.trans(dT), q, input_precision="ieee")
    live = offs_n[:, None] < Lk
    tl.store(DK + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :], dk, mask=live & (offs_d[None, :] < D))
    tl.store(DV + (bh * Lk + offs_n[:, None]) * Dv + offs_dv[None, :], dv, mask=live & (offs_dv[None, :] < Dv))


@triton.jit
def relative_dr_kernel(Q, K, V, R, QRY, KPM, LSE, DELTA, DO, GD,
                       q_strides, k_strides, v_strides, r_strides, query_strides, kpm_strides,
                       B, H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                       BM: tl.constexpr, BD: tl.constexpr, W2: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       HAS_KPM: tl.constexpr):
    """The distance-band pass: ``GD[h, d] = sum_{b, i} dT[i, pos(i) - d] query_i`` for distances
    ``d = dmin + [d0, d0 + BD)`` (``dmin = 1 - Lq``), one program per (distance block, head), summing
    over the batch and the query tiles in a fixed order (no atomics). The key band of a query tile
    is ``j = jb0 + u``, ``u = (i - i0) - (d - d0) + BD - 1``: a product with the band, then a gather."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    r_h, r_n, r_d = r_strides
    query_b, query_h, query_l, query_d = query_strides
    kpm_b, kpm_l = kpm_strides
    h = tl.program_id(1).to(tl.int64)
    off = Lk - Lq
    d0 = 1 - Lq + tl.program_id(0) * BD
    dd = d0 + tl.arange(0, BD)                                                        # the block's distances
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    r_blk = _load2(R + h * r_h, _ridx(dd, n_dist, max_distance, PAST_ONLY), n_dist, r_n, offs_d, D, r_d)  # (BD, D)
    u_of = (tl.arange(0, BM)[:, None] - tl.arange(0, BD)[None, :] + BD - 1).to(tl.int32)
    gd = tl.zeros([BD, BLOCK_D], tl.float32)
    # a block of distances the window hides entirely (-right <= d <= left) has nothing to sum
    n_b = B
    if HAS_RIGHT:
        n_b = tl.where(d0 + BD - 1 < -right, 0, n_b)
    if HAS_LEFT:
        n_b = tl.where(d0 > left, 0, n_b)
    for bb in range(0, n_b):
        b = h * 0 + bb                            # int64 like h: b * stride may pass 2^31 on large inputs
        bh = b * H + h
        k_base, v_base = K + b * k_b + (h // G) * k_h, V + b * v_b + (h // G) * v_h
        for i0 in range(0, Lq, BM):
            offs_m = i0 + tl.arange(0, BM)
            rows_ok = offs_m < Lq
            pos = offs_m + off
            jb0 = i0 + off - (d0 + BD - 1)
            kb = jb0 + tl.arange(0, W2)
            q = _load2(Q + b * q_b + h * q_h, offs_m, Lq, q_l, offs_d, D, q_d)
            qry = _load2(QRY + b * query_b + h * query_h, offs_m, Lq, query_l, offs_d, D, query_d)
            lse, delta, do = _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv)
            s_band = tl.dot(q, tl.trans(_load2(k_base, kb, Lk, k_l, offs_d, D, k_d)), input_precision="ieee")
            dp_band = tl.dot(do, tl.trans(_load2(v_base, kb, Lk, v_l, offs_dv, Dv, v_d)), input_precision="ieee")
            s = tl.gather(s_band, u_of, axis=1) + tl.dot(qry, tl.trans(r_blk), input_precision="ieee")
            j = pos[:, None] - dd[None, :]
            ok = _visible(j, pos, rows_ok, Lk, left, right, KPM + b * kpm_b, kpm_l, HAS_LEFT, HAS_RIGHT, HAS_KPM)
            p = tl.where(ok, tl.exp(s * scale - lse[:, None]), 0.0)
            dT = p * (tl.gather(dp_band, u_of, axis=1) - delta[:, None]) * scale
            gd += tl.dot(tl.trans(dT), qry, input_precision="ieee")
    n_d = Lq + Lk - 1
    tl.store(GD + (h * n_d + (dd - (1 - Lq))[:, None]) * D + offs_d[None, :], gd,
             mask=(dd[:, None] <= Lk - 1) & (offs_d[None, :] < D))
