"""Launcher of the paged kernel (``kernels.py``) and its split-KV plan: one helper builds the kernel's
arguments by name (`kernel_args`), the launches pass them by keyword."""
from __future__ import annotations

import torch
import triton
from torch import Tensor

from ....splits import DECODE_MIN_KEYS, MAX_QUERIES, plan_splits, sm_count
from ..attention.decode import NOMINAL_SMS
from ..runtime import _INTERPRET
from .kernels import combine_kernel, paged_fwd_kernel

BLOCK_N = 64
COMBINE_ROWS = 16         # rows per combine program


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def key_bound(Lq: int, capacity: int, left: int) -> int:
    """Keys a query tile's range ``[lo, hi)`` holds at most, from shapes only: the table's capacity, or
    with a left window ``Lq + left`` keys plus the rounding of ``lo`` down to a tile."""
    return capacity if left < 0 else min(capacity, Lq + left + BLOCK_N - 1)


MAX_PACKED_ROWS = 64      # G * Lq rows of a packed tile at most (the largest query tile the kernel runs)


def packs(H: int, Hkv: int, Lq: int) -> bool:
    """Whether a call's programs take one KV head's G = H / Hkv query heads x Lq queries as the rows of
    one tile (a decode-shaped call with grouped-query heads): each page is then read once per KV head."""
    G = H // Hkv
    return G > 1 and Lq <= MAX_QUERIES and G * Lq <= MAX_PACKED_ROWS


def split_plan(q: Tensor, k_pages: Tensor, block_table: Tensor, left: int, num_sms=None, keys_per_split=None):
    """``(n_splits, keys_per_split)`` of a paged call: 1 split unless it is decode-shaped (``Lq <=
    MAX_QUERIES``) with a key bound of at least ``DECODE_MIN_KEYS`` (`effattn.splits`); then
    `plan_splits` over the B * H (packed: B * Hkv) programs of a split (``num_sms`` default: the
    device's, or the nominal H100 off the GPU). ``keys_per_split`` (a multiple of 64) forces the
    split, for tests."""
    B, H, Lq, _ = q.shape
    Hkv = k_pages.shape[2]
    span = key_bound(Lq, block_table.shape[1] * k_pages.shape[1], left)
    if keys_per_split is not None:
        if keys_per_split < 1 or keys_per_split % BLOCK_N:
            raise ValueError(f"paged decode: keys_per_split={keys_per_split} must be a positive multiple of {BLOCK_N}")
        return max(1, -(-span // keys_per_split)), keys_per_split
    if Lq > MAX_QUERIES or span < DECODE_MIN_KEYS:
        return 1, span
    return plan_splits(B * (Hkv if packs(H, Hkv, Lq) else H), span, num_sms or sm_count(q.device, NOMINAL_SMS),
                       BLOCK_N)


def kernel_args(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqlens: Tensor, out: Tensor,
                lse: Tensor, left: int, right: int, scale: float, keys_per_split: int) -> dict:
    """The paged kernel's arguments but the split partials, by its parameter names (C++ names where a
    field exists; strides as tuples), for a validated call (``left`` / ``right``: -1 = unbounded)."""
    B, H, Lq, D = q.shape
    return dict(Q=q, KP=k_pages, VP=v_pages, BT=block_table, LENS=seqlens, O=out, LSE=lse,
                q_strides=tuple(q.stride()), k_strides=tuple(k_pages.stride()), v_strides=tuple(v_pages.stride()),
                bt_strides=tuple(block_table.stride()), o_strides=tuple(out.stride()), lse_strides=tuple(lse.stride()),
                H=H, G=H // k_pages.shape[2], Lq=Lq, D=D, Dv=v_pages.shape[3], page_size=k_pages.shape[1],
                left=max(left, 0), right=max(right, 0), scale=scale, keys_per_split=keys_per_split,
                n_rows=B * H * Lq)


def paged_forward(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqlens: Tensor, left: int,
                  right: int, scale: float, *, num_sms=None, keys_per_split=None):
    """``out (B, H, Lq, Dv)`` in q's dtype and ``lse (B, H, Lq)`` float32 of a validated paged call
    (``left`` / ``right``: the normalized window, -1 = unbounded, causal is ``right = 0``); split-KV
    as `split_plan` says (``num_sms``, ``keys_per_split``: see there)."""
    B, H, Lq, D = q.shape
    Hkv, Dv = k_pages.shape[2], v_pages.shape[3]
    out = torch.empty(B, H, Lq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    pack = packs(H, Hkv, Lq)
    BLOCK_M = _pow2(H // Hkv * Lq) if pack else min(64, _pow2(Lq))
    low = q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
    n_splits, per = split_plan(q, k_pages, block_table, left, num_sms, keys_per_split)
    n_rows = B * H * Lq
    if n_rows == 0:
        return out, lse
    split = n_splits > 1
    o_part = torch.empty((n_splits, n_rows, Dv) if split else (1,), dtype=torch.float32, device=q.device)
    l_part = torch.empty((n_splits, n_rows) if split else (1,), dtype=torch.float32, device=q.device)
    grid = (1, B * Hkv, n_splits) if pack else (triton.cdiv(Lq, BLOCK_M), B * H, n_splits)
    paged_fwd_kernel[grid](
        **kernel_args(q, k_pages, v_pages, block_table, seqlens, out, lse, left, right, scale, per),
        OP=o_part, LP=l_part, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, LOW=low, SPLIT=split, PACK=pack)
    if split:
        combine_kernel[(triton.cdiv(n_rows, COMBINE_ROWS),)](
            OP=o_part, LP=l_part, O=out, LSE=lse, n_rows=n_rows, Dv=Dv, splits=n_splits, BLOCK_R=COMBINE_ROWS,
            BLOCK_DV=_pow2(Dv), INTERP_BF16=_INTERPRET and q.dtype == torch.bfloat16, num_warps=4)
    return out, lse
