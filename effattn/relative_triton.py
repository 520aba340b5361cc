"""Triton forward of relative-position attention (`effattn.relative_attention`): the position term
computed per tile, never an ``(Lq, Lk)`` matrix.

For a query tile ``[i0, i0 + BM)`` and a key tile ``[j0, j0 + BN)`` the distances ``d_ij = pos(i) - j``
take ``BM + BN - 1`` values, ``d = dmin + w`` with ``w = (i - i0) - (j - j0) + BN - 1``. The kernel
loads the rows of ``r`` those distances read (``idx(d)``, clamped), forms ``QR = query_tile @ R_band^T``
(``BM x W``) and picks ``QR[i, w(i, j)]`` with `tl.gather`: the "relative shift" done in-tile. Then
FlashAttention-2's online softmax (Dao 2023, Alg. 1) over the key tiles the window allows.

The backward is the torch path's (query rows in blocks, recomputed from the saved lse; band sums for
``query`` and ``r``): memory-bounded and deterministic, not fused yet.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

import triton
import triton.language as tl

from .online_softmax import finish, key_range, online_step
from ._kernel_choice import basic_triton_reasons


@triton.jit
def _rel_fwd(Q, K, V, RR, QRY, KPM, OUT, LSE,
             sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, srh, srn, srd,
             syb, syh, syl, syd, skpb, skpl, sob, soh, sol, sod, slb, slh, sll,
             H, G, Lq, Lk, D, Dv, n_dist, max_distance, left, right, scale,
             BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             PAST_ONLY: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    hk = h // G
    off = Lk - Lq
    i0 = m * BM
    offs_m = i0 + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_ok = offs_m < Lq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
                mask=rows_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    qry = tl.load(QRY + b * syb + h * syh + offs_m[:, None] * syl + offs_d[None, :] * syd,
                  mask=rows_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    pos = offs_m + off
    lo, hi = key_range(i0 + off, i0 + BM - 1 + off, Lk, left, right, BN, HAS_LEFT, HAS_RIGHT)
    w_of = (tl.arange(0, BM)[:, None] - tl.arange(0, BN)[None, :] + BN - 1).to(tl.int32)   # (BM, BN) -> band column
    wr = tl.arange(0, W)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_DV], tl.float32)
    for j0 in range(lo, hi, BN):
        offs_n = j0 + tl.arange(0, BN)
        live = offs_n < Lk
        kt = tl.load(K + b * skb + hk * skh + offs_n[None, :] * skl + offs_d[:, None] * skd,
                     mask=live[None, :] & (offs_d[:, None] < D), other=0.0).to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee")
        # the band of r rows this tile reads: distance dmin + w, clamped like idx(d)
        d = i0 + off - (j0 + BN - 1) + wr
        if PAST_ONLY:
            ridx = tl.minimum(tl.maximum(d, 0), n_dist - 1)
        else:
            ridx = tl.minimum(tl.maximum(d, -max_distance), max_distance) + max_distance
        rt = tl.load(RR + h * srh + ridx[None, :].to(tl.int64) * srn + offs_d[:, None] * srd,
                     mask=offs_d[:, None] < D, other=0.0).to(tl.float32)                  # (BLOCK_D, W)
        qr = tl.dot(qry, rt, input_precision="ieee")                                      # (BM, W)
        s = (s + tl.gather(qr, w_of, axis=1)) * scale
        ok = live[None, :] & rows_ok[:, None]
        if HAS_LEFT:
            ok = ok & (offs_n[None, :] >= pos[:, None] - left)
        if HAS_RIGHT:
            ok = ok & (offs_n[None, :] <= pos[:, None] + right)
        if HAS_KPM:
            pad = tl.load(KPM + b * skpb + offs_n * skpl, mask=live, other=1)
            ok = ok & (pad[None, :] == 0)
        s = tl.where(ok, s, float("-inf"))
        p, alpha, m_new, l_i = online_step(m_i, l_i, s)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svl + offs_dv[None, :] * svd,
                    mask=live[:, None] & (offs_dv[None, :] < Dv), other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * sol + offs_dv[None, :] * sod, out,
             mask=rows_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + b * slb + h * slh + offs_m * sll, lse, mask=rows_ok)


def triton_reasons(q: Tensor, dropout_p: float) -> List[str]:
    why = basic_triton_reasons(q)
    if dropout_p > 0:
        why.append("dropout (served by the dense torch path)")
    return why


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def relative_forward(q, k, v, r, query, max_distance: Optional[int], left: int, right: int,
                     key_padding_mask: Optional[Tensor], scale: float, block: Optional[int] = None):
    """``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)``, float32, of a validated call."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    block = block or (32 if q.device.type == "cuda" else 16)      # 16 in the interpreter (tests)
    out = torch.empty(B, H, Lq, Dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    kpm = key_padding_mask.to(torch.int8) if key_padding_mask is not None else None
    kpm_arg, kpm_strides = (kpm, kpm.stride()) if kpm is not None else (q, (0, 0))
    _rel_fwd[(triton.cdiv(Lq, block), B * H)](
        q, k, v, r, query, kpm_arg, out, lse, *q.stride(), *k.stride(), *v.stride(), *r.stride(), *query.stride(),
        *kpm_strides, *out.stride(), *lse.stride(), H, H // Hkv, Lq, Lk, D, Dv, r.shape[1],
        max_distance if max_distance is not None else 0, max(left, 0), max(right, 0), scale,
        BM=block, BN=block, W=_pow2(2 * block - 1), BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
        PAST_ONLY=max_distance is None, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_KPM=kpm is not None)
    return out, lse
