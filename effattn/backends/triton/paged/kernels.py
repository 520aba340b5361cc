"""Triton kernels of the paged KV cache (math only; the launcher and the split plan in
``launch.py``): decode and prefill read keys and values from their pages in place (no gathered
copy). Forward only.

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
a split that sees no key, e.g. past a short sequence's end), and
``combine_kernel`` merges the splits of each row in split order: deterministic, no atomics. The
number of splits comes from shapes only (the key bound ``max_pages * page_size``, narrowed by a left
window), never from ``seqlens``' values, and `effattn.splits` plans it as for the contiguous decode
(``DECODE_MIN_KEYS``, two waves of the SMs): a step reads nothing back and can be captured in a CUDA
graph.

Arguments: the names of the C++ `AttnParams` / `DecodeParams` fields where one exists (``H``, ``G``,
``Lq``, ``D``, ``Dv``, ``left``, ``right``, ``scale``, ``splits``; ``O`` / ``LSE`` the output, ``OP`` / ``LP``
the split partials as in the Triton decode kernel), element strides as one tuple per tensor unpacked to
those names: ``q_strides`` = (q_b, q_h, q_l, q_d), ``o_strides`` = (o_b, o_h, o_l, o_d). No C++ field (C++
has no paged kernel): the pages ``k_strides`` = (k_page, k_slot, k_h, k_d), ``v_strides`` likewise, the
block table's ``bt_strides`` = (bt_b, bt_p), ``lse_strides`` = (lse_b, lse_h, lse_l), ``page_size``,
``keys_per_split``, ``n_rows`` (B * H * Lq). ``launch.kernel_args`` builds them by name; every launch
passes them by keyword.
"""
import triton
import triton.language as tl

from ....numerics import LOG2E as _LOG2E
from ..jit import cast
from ..online_softmax import finish, key_range, online_step

# a constexpr: Triton's compiler (3.9) refuses a kernel that reads a plain float global (the interpreter
# reads it as any Python value), which the split-KV store did
LOG2E: tl.constexpr = tl.constexpr(_LOG2E)


@triton.jit
def paged_fwd_kernel(Q, KP, VP, BT, LENS, O, LSE, OP, LP,
                     q_strides, k_strides, v_strides, bt_strides, o_strides, lse_strides,
                     H, G, Lq, D, Dv, page_size, left, right, scale, keys_per_split, n_rows,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, LOW: tl.constexpr, SPLIT: tl.constexpr,
                     PACK: tl.constexpr):
    q_b, q_h, q_l, q_d = q_strides
    k_page, k_slot, k_h, k_d = k_strides
    v_page, v_slot, v_h, v_d = v_strides
    bt_b, bt_p = bt_strides
    o_b, o_h, o_l, o_d = o_strides
    lse_b, lse_h, lse_l = lse_strides
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
    q = tl.load(Q + b * q_b + h[:, None] * q_h + offs_m[:, None] * q_l + offs_d[None, :] * q_d,
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
        page = tl.load(BT + b * bt_b + (offs_n // page_size) * bt_p, mask=live, other=0).to(tl.int64)
        slot = offs_n % page_size
        kt = tl.load(KP + page[None, :] * k_page + slot[None, :] * k_slot + hk * k_h + offs_d[:, None] * k_d,
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
        v = tl.load(VP + page[:, None] * v_page + slot[:, None] * v_slot + hk * v_h + offs_dv[None, :] * v_d,
                    mask=seen[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    if SPLIT:                                 # fp32 partials (splits, B*H*Lq, Dv), lse in log2 units
        row = tl.program_id(2).to(tl.int64) * n_rows + (b * H + h) * Lq + offs_m
        tl.store(OP + row[:, None] * Dv + offs_dv[None, :], out, mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv))
        tl.store(LP + row, lse * LOG2E, mask=offs_m < Lq)
    else:
        tl.store(O + b * o_b + h[:, None] * o_h + offs_m[:, None] * o_l + offs_dv[None, :] * o_d,
                 out.to(O.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv))
        tl.store(LSE + b * lse_b + h * lse_h + offs_m * lse_l, lse, mask=offs_m < Lq)


@triton.jit
def combine_kernel(OP, LP, O, LSE, n_rows, Dv, splits,
                   BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, INTERP_BF16: tl.constexpr):
    """O (B*H*Lq, Dv) in the output dtype and LSE (B*H*Lq,) fp32, natural log, from the splits'
    partials: lse = log2 sum_s 2^lse_s, O = sum_s 2^(lse_s - lse) O_s, in split order. A row no split
    saw: O = 0, LSE = -inf."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    ok = rows < n_rows
    cols = tl.arange(0, BLOCK_DV)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(LP + s * n_rows + rows, mask=ok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    for s in range(0, splits):
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
