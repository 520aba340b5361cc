"""Launchers of the LSH kernels (``kernels.py``): one helper builds the arguments the kernels share by
name (`kernel_args`), every launch passes them by keyword."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ....lsh import SELF_SCORE
from .kernels import keep_mask_kernel, lsh_dkv_kernel, lsh_dq_kernel, lsh_fwd_kernel


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def kernel_args(q, k, v, perm, kpm, offsets, chunk_len: int, scale: float, dropout: tuple) -> dict:
    """The arguments the three kernels share, by their parameter names (C++ names where a field
    exists; strides as tuples): ``perm`` int32 (B*H*R, L), ``kpm`` int8 (B, L) or None, ``offsets`` the
    chunk offsets (int32), ``dropout`` `_dropout_args`."""
    B, H, L, D = q.shape
    seed, drop_thresh, inv_keep = dropout
    return dict(Q=q, K=k, V=v, PERM=perm, KPM=kpm if kpm is not None else perm,   # never read without HAS_KPM
                OFFS=offsets, q_strides=tuple(q.stride()), k_strides=tuple(k.stride()), v_strides=tuple(v.stride()),
                perm_n=perm.stride(0), kpm_strides=tuple(kpm.stride()) if kpm is not None else (0, 0),
                H=H, R=perm.shape[0] // (B * H), D=D, Dv=v.shape[-1], n_chunks=L // chunk_len,
                n_offs=offsets.numel(), scale=scale, seed=seed, drop_thresh=drop_thresh, inv_keep=inv_keep)


class _LSHRounds(torch.autograd.Function):
    """``(q, k, v) -> out_r (B, H, R, L, Dv), lse_r (B, H, R, L)`` float32, per round, original order."""

    @staticmethod
    def forward(ctx, q, k, v, perm, kpm, offsets, chunk_len, causal, scale, dropout_p, seed):
        B, H, L, D = q.shape
        R, Dv = perm.shape[0] // (B * H), v.shape[-1]
        out = torch.empty(B, H, R, L, Dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, R, L, dtype=torch.float32, device=q.device)
        low = q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
        meta = dict(CL=chunk_len, BLOCK_D=_next_pow2(D), BLOCK_DV=_next_pow2(Dv), SELF_SCORE=SELF_SCORE, CAUSAL=causal,
                    HAS_KPM=kpm is not None, PREC="ieee", LOW=low, DROPOUT=dropout_p > 0)
        dropout = _dropout_args(dropout_p, seed)
        lsh_fwd_kernel[(L // chunk_len, B * H * R)](
            **kernel_args(q, k, v, perm, kpm, offsets, chunk_len, scale, dropout), O=out, LSE=lse,
            o_strides=tuple(out.stride()), lse_strides=tuple(lse.stride()), **meta)
        ctx.save_for_backward(q, k, v, perm, kpm, offsets, out, lse)
        ctx.meta, ctx.scale, ctx.dropout = meta, scale, dropout
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, perm, kpm, offsets, out, lse = ctx.saved_tensors
        B, H, L, D = q.shape
        R, Dv = perm.shape[0] // (B * H), v.shape[-1]
        dout = torch.zeros_like(out) if dout is None else dout.to(torch.float32).contiguous()
        delta = (dout * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(torch.float32)
        delta = delta.contiguous()
        dq = torch.empty(B, H, R, L, D, dtype=torch.float32, device=q.device)
        dk = torch.empty_like(dq)
        dv = torch.empty(B, H, R, L, Dv, dtype=torch.float32, device=q.device)
        grid = (L // ctx.meta["CL"], B * H * R)
        args = dict(kernel_args(q, k, v, perm, kpm, offsets, ctx.meta["CL"], ctx.scale, ctx.dropout),
                    LSE=lse.contiguous(), DELTA=delta, DO=dout)
        lsh_dq_kernel[grid](**args, DQ=dq, **ctx.meta)
        lsh_dkv_kernel[grid](**args, DK=dk, DV=dv, **ctx.meta)
        # rounds summed in a fixed order
        return (dq.sum(2).to(q.dtype), dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype), None, None, None, None, None,
                None, None, None)


def _dropout_args(p: float, seed: int):
    """(seed, drop_thresh: a threshold on 24 random bits, inv_keep: 1 / (1 - p)) of the kernels' dropout."""
    return seed, int(p * (1 << 24)), 1.0 / (1.0 - p)


def draw_seed() -> int:
    """The kernels' dropout seed, drawn from torch's default generator (so ``torch.manual_seed`` and a
    reversible layer's random-state replay reproduce the mask)."""
    return int(torch.randint(0, 2**31 - 1, (1,)))


def keep_mask(seed: int, n_slices: int, length: int, dropout_p: float, device="cpu") -> Tensor:
    """bool ``(n_slices, L, L)``: which (query position, key position) pairs of slice ``(b, h, r)`` the
    kernels keep under dropout with ``seed`` (``L`` a power of two >= 16; for tests)."""
    out = torch.empty(n_slices, length, length, dtype=torch.float32, device=device)
    keep_mask_kernel[(n_slices,)](O=out, seed=seed, drop_thresh=_dropout_args(dropout_p, seed)[1], L=length)
    return out > 0


def lsh_rounds(q: Tensor, k: Tensor, v: Tensor, perm: Tensor, key_padding_mask: Optional[Tensor], offsets: List[int],
               chunk_len: int, causal: bool, scale: float, dropout_p: float = 0.0):
    """Per-round outputs and lse of the sorted chunk pattern: ``q, k (B, H, L, D)`` (k normalized),
    ``v (B, H, L, Dv)``, ``perm (B, H, R, L)`` the sort. Differentiable in q, k, v."""
    B, H, R, L = perm.shape
    perm32 = perm.reshape(B * H * R, L).to(torch.int32).contiguous()
    kpm = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else None
    offs = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    seed = draw_seed() if dropout_p > 0 else 0
    return _LSHRounds.apply(q, k, v, perm32, kpm, offs, chunk_len, causal, float(scale), float(dropout_p), seed)
