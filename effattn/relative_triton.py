"""Triton kernels of relative-position attention (`effattn.relative_attention`), forward and
backward: the position term computed per tile, never an ``(Lq, Lk)`` matrix.

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
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .online_softmax import finish, key_range, online_step


@triton.jit
def _ridx(d, n_dist, max_distance, PAST_ONLY: tl.constexpr):
    """Row of r read at distance d (clamped)."""
    if PAST_ONLY:
        m = tl.minimum(tl.maximum(d, 0), n_dist - 1)
    else:
        m = tl.minimum(tl.maximum(d, -max_distance), max_distance) + max_distance
    return m


@triton.jit
def _visible(j, pos, rows_ok, Lk, left, right, kpm_b, skpl, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             HAS_KPM: tl.constexpr):
    """Whether key j (any (rows, n) block of key indices) is visible to the rows at ``pos``."""
    ok = (j >= 0) & (j < Lk) & rows_ok[:, None]
    if HAS_LEFT:
        ok = ok & (j >= pos[:, None] - left)
    if HAS_RIGHT:
        ok = ok & (j <= pos[:, None] + right)
    if HAS_KPM:
        pad = tl.load(kpm_b + tl.minimum(tl.maximum(j, 0), Lk - 1) * skpl)
        ok = ok & (pad == 0)
    return ok


@triton.jit
def _tile_scores(q, qry, k_b, skl, skd, r_h, srn, srd, kpm_b, skpl, i0, j0, off, pos, rows_ok, offs_d, Lk, D,
                 n_dist, max_distance, left, right, scale, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
                 PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """Scaled, masked scores of query tile i0 against key tile j0, and the tile's band of r
    ``(BLOCK_D, W)``: distance ``dmin + w`` for column w, ``w = (i - i0) - (j - j0) + BN - 1``."""
    offs_n = j0 + tl.arange(0, BN)
    kt = tl.load(k_b + offs_n[None, :] * skl + offs_d[:, None] * skd,
                 mask=(offs_n[None, :] < Lk) & (offs_d[:, None] < D), other=0.0).to(tl.float32)
    d = i0 + off - (j0 + BN - 1) + tl.arange(0, W)
    rt = tl.load(r_h + _ridx(d, n_dist, max_distance, PAST_ONLY)[None, :].to(tl.int64) * srn + offs_d[:, None] * srd,
                 mask=offs_d[:, None] < D, other=0.0).to(tl.float32)
    w_of = (tl.arange(0, BM)[:, None] - tl.arange(0, BN)[None, :] + BN - 1).to(tl.int32)
    s = tl.dot(q, kt, input_precision="ieee") + tl.gather(tl.dot(qry, rt, input_precision="ieee"), w_of, axis=1)
    ok = _visible(offs_n[None, :] + 0 * pos[:, None], pos, rows_ok, Lk, left, right, kpm_b, skpl, HAS_LEFT,
                  HAS_RIGHT, HAS_KPM)
    return tl.where(ok, s * scale, float("-inf")), rt


@triton.jit
def _load2(base, rows, n_rows, stride_r, cols, n_cols, stride_c):
    return tl.load(base + rows[:, None] * stride_r + cols[None, :] * stride_c,
                   mask=(rows[:, None] < n_rows) & (rows[:, None] >= 0) & (cols[None, :] < n_cols),
                   other=0.0).to(tl.float32)


@triton.jit
def _query_tile(Q, QRY, K, V, sqb, sqh, sql, sqd, skb, skh, svb, svh, syb, syh, syl, syd, H, G, Lq, Lk, D,
                BM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a program over query tile ``program_id(0)`` of slice ``program_id(1) = (b, h)`` starts with."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    i0 = tl.program_id(0) * BM
    offs_m = i0 + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load2(Q + b * sqb + h * sqh, offs_m, Lq, sql, offs_d, D, sqd)
    qry = _load2(QRY + b * syb + h * syh, offs_m, Lq, syl, offs_d, D, syd)
    k_b, v_b = K + b * skb + (h // G) * skh, V + b * svb + (h // G) * svh
    return bh, b, h, Lk - Lq, i0, offs_m, offs_d, tl.arange(0, BLOCK_DV), offs_m < Lq, q, qry, k_b, v_b


@triton.jit
def _rel_fwd(Q, K, V, RR, QRY, KPM, OUT, LSE,
             sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, srh, srn, srd,
             syb, syh, syl, syd, skpb, skpl,
             H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
             BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """OUT (B, H, Lq, Dv), LSE (B, H, Lq): contiguous float32."""
    bh, b, h, off, i0, offs_m, offs_d, offs_dv, rows_ok, q, qry, k_b, v_b = _query_tile(
        Q, QRY, K, V, sqb, sqh, sql, sqd, skb, skh, svb, svh, syb, syh, syl, syd, H, G, Lq, Lk, D, BM, BLOCK_D, BLOCK_DV)
    pos = offs_m + off
    lo, hi = key_range(i0 + off, i0 + BM - 1 + off, Lk, left, right, BN, HAS_LEFT, HAS_RIGHT)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_DV], tl.float32)
    for j0 in range(lo, hi, BN):
        s, _ = _tile_scores(q, qry, k_b, skl, skd, RR + h * srh, srn, srd, KPM + b * skpb, skpl, i0, j0, off, pos,
                            rows_ok, offs_d, Lk, D, n_dist, max_distance, left, right, scale, BM, BN, W, PAST_ONLY,
                            HAS_LEFT, HAS_RIGHT, HAS_KPM)
        p, alpha, m_new, l_i = online_step(m_i, l_i, s)
        v = _load2(v_b, j0 + tl.arange(0, BN), Lk, svl, offs_dv, Dv, svd)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    tl.store(OUT + (bh * Lq + offs_m[:, None]) * Dv + offs_dv[None, :], out, mask=rows_ok[:, None] & (offs_dv[None, :] < Dv))
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
def _rel_bwd_dq(Q, K, V, RR, QRY, KPM, LSE, DELTA, DO, DQ, DQRY,
                sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, srh, srn, srd,
                syb, syh, syl, syd, skpb, skpl,
                H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """dQ and dQuery of one query tile (FA-2 Alg. 2); the position term's gradient reaches ``query``
    through the tile's band: ``dT_band[i, w] = dT[i, j(i, w)]`` (a gather), then ``dT_band @ R_band``."""
    bh, b, h, off, i0, offs_m, offs_d, offs_dv, rows_ok, q, qry, k_b, v_b = _query_tile(
        Q, QRY, K, V, sqb, sqh, sql, sqd, skb, skh, svb, svh, syb, syh, syl, syd, H, G, Lq, Lk, D, BM, BLOCK_D, BLOCK_DV)
    lse, delta, do = _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv)
    pos = offs_m + off
    jl = tl.arange(0, BM)[:, None] + BN - 1 - tl.arange(0, W)[None, :]              # key of band column w
    in_tile = (jl >= 0) & (jl < BN)
    jl = tl.minimum(tl.maximum(jl, 0), BN - 1).to(tl.int32)
    lo, hi = key_range(i0 + off, i0 + BM - 1 + off, Lk, left, right, BN, HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BM, BLOCK_D], tl.float32)
    dqry = tl.zeros([BM, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BN):
        s, rt = _tile_scores(q, qry, k_b, skl, skd, RR + h * srh, srn, srd, KPM + b * skpb, skpl, i0, j0, off, pos,
                             rows_ok, offs_d, Lk, D, n_dist, max_distance, left, right, scale, BM, BN, W, PAST_ONLY,
                             HAS_LEFT, HAS_RIGHT, HAS_KPM)
        p = tl.exp(s - lse[:, None])
        offs_n = j0 + tl.arange(0, BN)
        v = _load2(v_b, offs_n, Lk, svl, offs_dv, Dv, svd)
        dT = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None]) * scale
        dq += tl.dot(dT, _load2(k_b, offs_n, Lk, skl, offs_d, D, skd), input_precision="ieee")
        band = tl.where(in_tile, tl.gather(dT, jl, axis=1), 0.0)                       # (BM, W)
        dqry += tl.dot(band, tl.trans(rt), input_precision="ieee")
    ptr = (bh * Lq + offs_m[:, None]) * D + offs_d[None, :]
    mask = rows_ok[:, None] & (offs_d[None, :] < D)
    tl.store(DQ + ptr, dq, mask=mask)
    tl.store(DQRY + ptr, dqry, mask=mask)


@triton.jit
def _rel_bwd_dkv(Q, K, V, RR, QRY, KPM, LSE, DELTA, DO, DK, DV,
                 sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, srh, srn, srd,
                 syb, syh, syl, syd, skpb, skpl,
                 H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                 BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """dK, dV of one key tile for one query head (the GQA group is summed in torch), over every
    query tile (the masks remove the invisible pairs)."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    off = Lk - Lq
    j0 = tl.program_id(0) * BN
    offs_n = j0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_b, v_b = K + b * skb + (h // G) * skh, V + b * svb + (h // G) * svh
    v = _load2(v_b, offs_n, Lk, svl, offs_dv, Dv, svd)
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
        q = _load2(Q + b * sqb + h * sqh, offs_m, Lq, sql, offs_d, D, sqd)
        qry = _load2(QRY + b * syb + h * syh, offs_m, Lq, syl, offs_d, D, syd)
        lse, delta, do = _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv)
        s, _ = _tile_scores(q, qry, k_b, skl, skd, RR + h * srh, srn, srd, KPM + b * skpb, skpl, i0, j0, off,
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
def _rel_bwd_dr(Q, K, V, RR, QRY, KPM, LSE, DELTA, DO, GD,
                sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, srh, srn, srd,
                syb, syh, syl, syd, skpb, skpl,
                B, H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
                BM: tl.constexpr, BD: tl.constexpr, W2: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_KPM: tl.constexpr):
    """The distance-band pass: ``GD[h, d] = sum_{b, i} dT[i, pos(i) - d] query_i`` for distances
    ``d = dmin + [d0, d0 + BD)`` (``dmin = 1 - Lq``), one program per (distance block, head), summing
    over the batch and the query tiles in a fixed order (no atomics). The key band of a query tile
    is ``j = jb0 + u``, ``u = (i - i0) - (d - d0) + BD - 1``: a product with the band, then a gather."""
    h = tl.program_id(1).to(tl.int64)
    off = Lk - Lq
    d0 = 1 - Lq + tl.program_id(0) * BD
    dd = d0 + tl.arange(0, BD)                                                        # the block's distances
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    r_blk = _load2(RR + h * srh, _ridx(dd, n_dist, max_distance, PAST_ONLY), n_dist, srn, offs_d, D, srd)  # (BD, D)
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
        k_b, v_b = K + b * skb + (h // G) * skh, V + b * svb + (h // G) * svh
        for i0 in range(0, Lq, BM):
            offs_m = i0 + tl.arange(0, BM)
            rows_ok = offs_m < Lq
            pos = offs_m + off
            jb0 = i0 + off - (d0 + BD - 1)
            kb = jb0 + tl.arange(0, W2)
            q = _load2(Q + b * sqb + h * sqh, offs_m, Lq, sql, offs_d, D, sqd)
            qry = _load2(QRY + b * syb + h * syh, offs_m, Lq, syl, offs_d, D, syd)
            lse, delta, do = _row_stats(LSE, DELTA, DO, bh, offs_m, rows_ok, Lq, offs_dv, Dv)
            s_band = tl.dot(q, tl.trans(_load2(k_b, kb, Lk, skl, offs_d, D, skd)), input_precision="ieee")
            dp_band = tl.dot(do, tl.trans(_load2(v_b, kb, Lk, svl, offs_dv, Dv, svd)), input_precision="ieee")
            s = tl.gather(s_band, u_of, axis=1) + tl.dot(qry, tl.trans(r_blk), input_precision="ieee")
            j = pos[:, None] - dd[None, :]
            ok = _visible(j, pos, rows_ok, Lk, left, right, KPM + b * skpb, skpl, HAS_LEFT, HAS_RIGHT, HAS_KPM)
            p = tl.where(ok, tl.exp(s * scale - lse[:, None]), 0.0)
            dT = p * (tl.gather(dp_band, u_of, axis=1) - delta[:, None]) * scale
            gd += tl.dot(tl.trans(dT), qry, input_precision="ieee")
    n_d = Lq + Lk - 1
    tl.store(GD + (h * n_d + (dd - (1 - Lq))[:, None]) * D + offs_d[None, :], gd,
             mask=(dd[:, None] <= Lk - 1) & (offs_d[None, :] < D))


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _launch_args(q, k, v, r, query, kpm, max_distance, left, right, scale):
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kpm_arg, kpm_strides = (kpm, kpm.stride()) if kpm is not None else (q, (0, 0))
    tensors = (q, k, v, r, query, kpm_arg)
    strides = (*q.stride(), *k.stride(), *v.stride(), *r.stride(), *query.stride(), *kpm_strides)
    sizes = (H, H // Hkv, Lq, Lk, D, Dv, r.shape[1], max_distance if max_distance is not None else 0, max(left, 0),
             max(right, 0), scale)
    flags = dict(BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv), PAST_ONLY=max_distance is None, HAS_LEFT=left >= 0,
                 HAS_RIGHT=right >= 0, HAS_KPM=kpm is not None)
    return tensors, strides, sizes, flags


def _block(q: Tensor) -> int:
    return 32 if q.device.type == "cuda" else 16      # 16 in the interpreter (tests)


def relative_forward(q, k, v, r, query, max_distance: Optional[int], left: int, right: int,
                     key_padding_mask: Optional[Tensor], scale: float):
    """``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)``, float32, of a validated call."""
    B, H, Lq, _ = q.shape
    kpm = key_padding_mask.to(torch.int8) if key_padding_mask is not None else None
    tensors, strides, sizes, flags = _launch_args(q, k, v, r, query, kpm, max_distance, left, right, scale)
    out = torch.empty(B, H, Lq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    bm = _block(q)
    _rel_fwd[(triton.cdiv(Lq, bm), B * H)](*tensors, out, lse, *strides, *sizes, BM=bm, BN=bm, W=_pow2(2 * bm - 1),
                                          **flags)
    return out, lse


def fold_distances(gd: Tensor, Lq: int, n_dist: int, max_distance: Optional[int]) -> Tensor:
    """``dr (H, n_dist, D)`` from per-distance sums ``gd (H, Lq + Lk - 1, D)`` (distances ``1 - Lq ..
    Lk - 1``): interior rows take their one distance, the clamped end rows the sum of theirs."""
    d = torch.arange(gd.shape[1], device=gd.device) + (1 - Lq)
    idx = d.clamp(0, n_dist - 1) if max_distance is None else d.clamp(-max_distance, max_distance) + max_distance
    dr = gd.new_zeros(gd.shape[0], n_dist, gd.shape[2])
    dr[:, 0] = gd[:, idx == 0].sum(1)
    if n_dist > 1:
        dr[:, n_dist - 1] = gd[:, idx == n_dist - 1].sum(1)
        inner = (idx > 0) & (idx < n_dist - 1)
        dr[:, idx[inner]] = gd[:, inner]
    return dr


def relative_backward(dout, dlse, q, k, v, r, query, out, lse, max_distance, left, right, key_padding_mask, scale):
    """``(dq, dk, dv, dr, dquery)`` float32 of `relative_forward` (FA-2 Alg. 2 plus the distance-band
    pass for ``r``): three launches, no atomics."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kpm = key_padding_mask.to(torch.int8) if key_padding_mask is not None else None
    tensors, strides, sizes, flags = _launch_args(q, k, v, r, query, kpm, max_distance, left, right, scale)
    dout = dout.to(torch.float32).contiguous()
    delta = (dout * out).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(torch.float32)
    stats = (lse.contiguous(), delta.contiguous(), dout)
    bm = _block(q)
    blocks = dict(BM=bm, BN=bm, W=_pow2(2 * bm - 1), **flags)
    dq = torch.empty(B, H, Lq, D, dtype=torch.float32, device=q.device)
    dquery = torch.empty_like(dq)
    _rel_bwd_dq[(triton.cdiv(Lq, bm), B * H)](*tensors, *stats, dq, dquery, *strides, *sizes, **blocks)
    dk = torch.empty(B, H, Lk, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(B, H, Lk, Dv, dtype=torch.float32, device=q.device)
    _rel_bwd_dkv[(triton.cdiv(Lk, bm), B * H)](*tensors, *stats, dk, dv, *strides, *sizes, **blocks)
    gd = torch.empty(H, Lq + Lk - 1, D, dtype=torch.float32, device=q.device)
    _rel_bwd_dr[(triton.cdiv(Lq + Lk - 1, bm), H)](*tensors, *stats, gd, *strides, B, *sizes, BM=bm, BD=bm,
                                                   W2=_pow2(2 * bm - 1), **flags)
    G = H // Hkv
    dk = dk.view(B, Hkv, G, Lk, D).sum(2)
    dv = dv.view(B, Hkv, G, Lk, Dv).sum(2)
    return dq, dk, dv, fold_distances(gd, Lq, r.shape[1], max_distance), dquery
