"""Launchers of the relative-position kernels (``kernels.py``): one helper builds the kernels'
arguments by name from a call (`kernel_args`), every launch passes them by keyword."""
from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor

from ....relative import fold_distances
from .kernels import relative_dkv_kernel, relative_dq_kernel, relative_dr_kernel, relative_fwd_kernel


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def kernel_args(q, k, v, r, query, kpm, max_distance, left, right, scale):
    """(arguments, constexpr flags) of every relative kernel for a validated call, by the kernels'
    parameter names (C++ `AttnParams` names where a field exists; strides as tuples). ``kpm``: int8
    (B, Lk) or None; ``left`` / ``right``: the normalized window, -1 = unbounded."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    args = dict(Q=q, K=k, V=v, R=r, QRY=query, KPM=kpm if kpm is not None else q,
                q_strides=tuple(q.stride()), k_strides=tuple(k.stride()), v_strides=tuple(v.stride()),
                r_strides=tuple(r.stride()), query_strides=tuple(query.stride()),
                kpm_strides=tuple(kpm.stride()) if kpm is not None else (0, 0),
                H=H, G=H // Hkv, Lq=Lq, Lk=Lk, D=D, Dv=Dv, n_dist=r.shape[1],
                max_distance=max_distance if max_distance is not None else 0, left=max(left, 0),
                right=max(right, 0), scale=scale)
    flags = dict(BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv), PAST_ONLY=max_distance is None, HAS_LEFT=left >= 0,
                 HAS_RIGHT=right >= 0, HAS_KPM=kpm is not None)
    return args, flags


def _block(q: Tensor) -> int:
    return 32 if q.device.type == "cuda" else 16      # 16 in the interpreter (tests)


def relative_forward(q, k, v, r, query, max_distance: Optional[int], left: int, right: int,
                     key_padding_mask: Optional[Tensor], scale: float):
    """``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)``, float32, of a validated call."""
    B, H, Lq, _ = q.shape
    kpm = key_padding_mask.to(torch.int8) if key_padding_mask is not None else None
    args, flags = kernel_args(q, k, v, r, query, kpm, max_distance, left, right, scale)
    out = torch.empty(B, H, Lq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    bm = _block(q)
    relative_fwd_kernel[(triton.cdiv(Lq, bm), B * H)](**args, O=out, LSE=lse, BM=bm, BN=bm, W=_pow2(2 * bm - 1),
                                                      **flags)
    return out, lse


def relative_backward(dout, dlse, q, k, v, r, query, out, lse, max_distance, left, right, key_padding_mask, scale):
    """``(dq, dk, dv, dr, dquery)`` float32 of `relative_forward` (FA-2 Alg. 2 plus the distance-band
    pass for ``r``): three launches, no atomics."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    kpm = key_padding_mask.to(torch.int8) if key_padding_mask is not None else None
    args, flags = kernel_args(q, k, v, r, query, kpm, max_distance, left, right, scale)
    dout = dout.to(torch.float32).contiguous()
    delta = (dout * out).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(torch.float32)
    stats = dict(LSE=lse.contiguous(), DELTA=delta.contiguous(), DO=dout)
    bm = _block(q)
    blocks = dict(BM=bm, BN=bm, W=_pow2(2 * bm - 1), **flags)
    dq = torch.empty(B, H, Lq, D, dtype=torch.float32, device=q.device)
    dquery = torch.empty_like(dq)
    relative_dq_kernel[(triton.cdiv(Lq, bm), B * H)](**args, **stats, DQ=dq, DQRY=dquery, **blocks)
    dk = torch.empty(B, H, Lk, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(B, H, Lk, Dv, dtype=torch.float32, device=q.device)
    relative_dkv_kernel[(triton.cdiv(Lk, bm), B * H)](**args, **stats, DK=dk, DV=dv, **blocks)
    gd = torch.empty(H, Lq + Lk - 1, D, dtype=torch.float32, device=q.device)
    relative_dr_kernel[(triton.cdiv(Lq + Lk - 1, bm), H)](**args, **stats, GD=gd, B=B, BM=bm, BD=bm,
                                                          W2=_pow2(2 * bm - 1), **flags)
    G = H // Hkv
    dk = dk.view(B, Hkv, G, Lk, D).sum(2)
    dv = dv.view(B, Hkv, G, Lk, Dv).sum(2)
    return dq, dk, dv, fold_distances(gd, Lq, r.shape[1], max_distance), dquery
