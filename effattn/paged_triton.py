"""Triton kernel of the paged KV cache: decode and prefill read keys and values from their pages in
place (no gathered copy). Forward only.

Program ``(m, (b, h))`` takes query rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of sequence b, head h
(kv head ``h // (H / Hkv)``). Query i sits at ``pos(i) = seqlens[b] - Lq + i``; the program walks the
key tiles its rows may see (``[pos - left, pos + right]`` clipped to ``[0, seqlens[b])``), and each key
row j of a tile is read from page ``block_table[b, j // page_size]``, slot ``j % page_size``: one
pointer per row, so any page size works. FlashAttention-2's online softmax (Dao 2023, Alg. 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .online_softmax import finish, key_range, online_step


@triton.jit
def _paged_fwd(Q, KP, VP, BT, LENS, OUT, LSE,
               sqb, sqh, sql, sqd, skp, sks, skh, skd, svp, svs, svh, svd, sbb, sbp,
               sob, soh, sol, sod, slb, slh, sll,
               H, G, Lq, D, Dv, PS, left, right, scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, LOW: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)        # b * stride may pass 2^31 on large inputs
    b, h = bh // H, bh % H
    hk = h // G
    n_keys = tl.load(LENS + b).to(tl.int32)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = n_keys - Lq + offs_m                                        # absolute position of each query
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D), other=0.0)
    if not LOW:
        q = q.to(tl.float32)
    first = n_keys - Lq + m * BLOCK_M
    lo, hi = key_range(first, first + BLOCK_M - 1, n_keys, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        live = offs_n < n_keys
        page = tl.load(BT + b * sbb + (offs_n // PS) * sbp, mask=live, other=0).to(tl.int64)
        slot = offs_n % PS
        kt = tl.load(KP + page[None, :] * skp + slot[None, :] * sks + hk * skh + offs_d[:, None] * skd,
                     mask=live[None, :] & (offs_d[:, None] < D), other=0.0)
        s = tl.dot(q, kt.to(q.dtype), input_precision="ieee") * scale
        ok = live[None, :] & (offs_m[:, None] < Lq)
        if HAS_LEFT:
            ok = ok & (offs_n[None, :] >= pos[:, None] - left)
        if HAS_RIGHT:
            ok = ok & (offs_n[None, :] <= pos[:, None] + right)
        s = tl.where(ok, s, float("-inf"))
        p, alpha, m_new, l_i = online_step(m_i, l_i, s)
        v = tl.load(VP + page[:, None] * svp + slot[:, None] * svs + hk * svh + offs_dv[None, :] * svd,
                    mask=live[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * sol + offs_dv[None, :] * sod, out.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv))
    tl.store(LSE + b * slb + h * slh + offs_m * sll, lse, mask=offs_m < Lq)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def paged_forward(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqlens: Tensor, left: int,
                  right: int, scale: float):
    """``out (B, H, Lq, Dv)`` in q's dtype and ``lse (B, H, Lq)`` float32 of a validated paged call
    (``left`` / ``right``: the normalized window, -1 = unbounded, causal is ``right = 0``)."""
    B, H, Lq, D = q.shape
    Hkv, Dv = k_pages.shape[2], v_pages.shape[3]
    out = torch.empty(B, H, Lq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    BLOCK_M = min(64, _pow2(Lq))
    low = q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
    _paged_fwd[(triton.cdiv(Lq, BLOCK_M), B * H)](
        q, k_pages, v_pages, block_table, seqlens, out, lse, *q.stride(), *k_pages.stride(), *v_pages.stride(),
        *block_table.stride(), *out.stride(), *lse.stride(), H, H // Hkv, Lq, D, Dv, k_pages.shape[1],
        max(left, 0), max(right, 0), scale, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, LOW=low)
    return out, lse
