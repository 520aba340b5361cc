"""Triton kernel of the paged KV cache: decode and prefill read keys and values from their pages in
place (no gathered copy). Forward only.

Program ``(m, (b, h))`` takes query rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of sequence b, head h
(kv head ``h // (H / Hkv)``). A decode-shaped call with grouped-query heads (``G = H / Hkv > 1``, ``Lq <=
16``, ``G * Lq <= 64``) packs instead, as the contiguous decode does: program ``(0, (b, hk))`` takes the
G heads x Lq queries of KV head hk as the rows of one tile (row ``r``: head ``hk * G + r // Lq``, query
``r % Lq``), so each page is read once per KV head, not G times, and a decode fills 16 rows or more of a
tile instead of one. Query i sits at ``pos(i) = seqlens[b] - Lq + i``; the program walks the
key tiles its rows may see (``[pos - left, pos + right]`` clipped to ``[0, seqlens[b])``), and each key
row j of a tile is read from page ``block_table[b, j // page_size]``, slot ``j % page_size``: one
pointer per row, so any page size works. FlashAttention-2's online softmax (Dao 2023, Alg. 1).

Split-KV (a decode or short chunk, ``Lq <= MAX_QUERIES``, over a long cache): a decode step has one
query tile per (b, h), B * H programs, which leaves most SMs idle at B = 1. The grid then gains a third
axis of ``n_splits``: split s walks keys ``[lo + s * keys_per_split, lo + (s + 1) * keys_per_split)`` of
its rows' range ``[lo, hi)``, writes its normalized output and log2-sum-exp2 in fp32 (``-inf`` and 0 for
a split that sees no key, e.g. past a short sequence's end), and this module's
``combine_kernel`` merges the splits of each row in split order: deterministic, no atomics. The
number of splits comes from shapes only (the key bound ``max_pages * page_size``, narrowed by a left
window), never from ``seqlens``' values, and `effattn.splits` plans it as for the contiguous decode
(``DECODE_MIN_KEYS``, two waves of the SMs): a step reads nothing back and can be captured in a CUDA
graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .backends.triton.attention.decode import NOMINAL_SMS
from .backends.triton.jit import cast
from .backends.triton.runtime import _INTERPRET
from .online_softmax import finish, key_range, online_step
from .splits import DECODE_MIN_KEYS, MAX_QUERIES, plan_splits, sm_count

LOG2E = 1.4426950408889634
BLOCK_N = 64


@triton.jit
def _paged_fwd(Q, KP, VP, BT, LENS, OUT, LSE, OP, LP,
               sqb, sqh, sql, sqd, skp, sks, skh, skd, svp, svs, svh, svd, sbb, sbp,
               sob, soh, sol, sod, slb, slh, sll,
               H, G, Lq, D, Dv, PS, left, right, scale, keys_per_split, n_rows,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, LOW: tl.constexpr, SPLIT: tl.constexpr,
               PACK: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)        # b * stride may pass 2^31 on large inputs
    r = tl.arange(0, BLOCK_M)
    if PACK:                                  # (b, kv head): row r is head hk * G + r // Lq, query r % Lq
        b, hk = bh // (H // G), bh % (H // G)
        h = hk * G + r // Lq
        offs_m = tl.where(r < G * Lq, r % Lq, Lq)                     # padding rows: past Lq, never visible
    else:                                     # (b, h): rows m * BLOCK_M + r of head h
        b = bh // H
        h = bh % H + r * 0
        hk = (bh % H) // G
        offs_m = m * BLOCK_M + r
    n_keys = tl.load(LENS + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = n_keys - Lq + offs_m                                        # absolute position of each query
    q = tl.load(Q + b * sqb + h[:, None] * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D), other=0.0)
    if not LOW:
        q = q.to(tl.float32)
    first = n_keys - Lq + m * BLOCK_M
    lo, hi = key_range(first, first + BLOCK_M - 1, n_keys, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    last = tl.minimum(first + BLOCK_M, n_keys) - 1                   # the position of the last real row
    if SPLIT:                                 # this program's share of the range (keys_per_split: whole tiles)
        lo = lo + tl.program_id(2) * keys_per_split
        hi = tl.minimum(hi, lo + keys_per_split)
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
        # values of keys none of the rows sees (past seqlens, outside the window of every row: the rows
        # sit at consecutive positions first..last, so their windows' union is [first - left, last + right])
        # read as 0: NaN / inf in such a slot give 0 * 0 in P V, not 0 * NaN
        seen = live
        if HAS_LEFT:
            seen = seen & (offs_n >= first - left)
        if HAS_RIGHT:
            seen = seen & (offs_n <= last + right)
        v = tl.load(VP + page[:, None] * svp + slot[:, None] * svs + hk * svh + offs_dv[None, :] * svd,
                    mask=seen[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    if SPLIT:                                 # fp32 partials (n_splits, B*H*Lq, Dv), lse in log2 units
        row = tl.program_id(2).to(tl.int64) * n_rows + (b * H + h) * Lq + offs_m
        tl.store(OP + row[:, None] * Dv + offs_dv[None, :], out, mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv))
        tl.store(LP + row, lse * LOG2E, mask=offs_m < Lq)
    else:
        tl.store(OUT + b * sob + h[:, None] * soh + offs_m[:, None] * sol + offs_dv[None, :] * sod,
                 out.to(OUT.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv))
        tl.store(LSE + b * slb + h * slh + offs_m * sll, lse, mask=offs_m < Lq)


COMBINE_ROWS = 16         # rows per combine program


@triton.jit
def combine_kernel(OP, LP, O, LSE, n_rows, Dv, n_splits,
                   BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, INTERP_BF16: tl.constexpr):
    """O (B*H*Lq, Dv) in the output dtype and LSE (B*H*Lq,) fp32, natural log, from the splits'
    partials: lse = log2 sum_s 2^lse_s, O = sum_s 2^(lse_s - lse) O_s, in split order. A row no split
    saw: O = 0, LSE = -inf."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    ok = rows < n_rows
    cols = tl.arange(0, BLOCK_DV)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(LP + s * n_rows + rows, mask=ok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    for s in range(0, n_splits):
        w = tl.exp2(tl.load(LP + s * n_rows + rows, mask=ok, other=float("-inf")) - m_ref)
        o = tl.load(OP + (s * n_rows + rows[:, None]) * Dv + cols[None, :], mask=ok[:, None] & (cols[None, :] < Dv),
                    other=0.0)
        acc += w[:, None] * o
        l += w
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    tl.store(O + rows[:, None] * Dv + cols[None, :], cast(acc / l_safe[:, None], O.dtype.element_ty, INTERP_BF16),
             mask=ok[:, None] & (cols[None, :] < Dv))
    tl.store(LSE + rows, tl.where(empty, float("-inf"), (m_ref + tl.log2(l_safe)) / 1.4426950408889634), mask=ok)


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
    _paged_fwd[grid](
        q, k_pages, v_pages, block_table, seqlens, out, lse, o_part, l_part, *q.stride(), *k_pages.stride(),
        *v_pages.stride(), *block_table.stride(), *out.stride(), *lse.stride(), H, H // Hkv, Lq, D, Dv,
        k_pages.shape[1], max(left, 0), max(right, 0), scale, per, n_rows, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv), HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, LOW=low, SPLIT=split,
        PACK=pack)
    if split:
        combine_kernel[(triton.cdiv(n_rows, COMBINE_ROWS),)](
            o_part, l_part, out, lse, n_rows, Dv, n_splits, BLOCK_R=COMBINE_ROWS, BLOCK_DV=_pow2(Dv),
            INTERP_BF16=_INTERPRET and q.dtype == torch.bfloat16, num_warps=4)
    return out, lse
