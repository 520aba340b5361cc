"""Split-KV decode: a few query rows (``Lq <= 16``) against a long key range.

The prefill kernel (`forward`) gives each (b, h) one program whose query tile has 32-128 rows, of
which a decoding call fills one, and walks every key in that one program: B*H programs on a GPU of
132 SMs, each reading its KV head's keys again. Here (as FlashDecoding and FlashAttention's
split-KV forward do):

- the query heads that share a KV head (the GQA group of ``G = H / Hkv`` heads) and their ``Lq``
  rows are packed into the rows of one tile, row ``r = g * Lq + i`` (head ``hk * G + g``, query
  ``i``), padded to a power of two >= 16: K and V are read once per KV head, not G times;
  ``H = 32, Hkv = 8, Lq = 1`` gives 4 real rows of 16;
- the visible key range is cut into ``n_splits`` contiguous ranges of ``keys_per_split`` keys (a
  multiple of the key tile; the last range may be shorter): a grid of ``B * Hkv * n_splits``
  programs, enough for two waves of the SMs (`plan_splits`);
- each program writes, per row, its range's softmax-normalized output and log-sum-exp in fp32
  (``lse = -inf``, output 0 for a row that sees no key of the range) and counts its arrival on
  an int32 counter of its (b, kv head); the program that arrives last merges the ranges of its
  rows, weighting each by ``exp(lse_s - lse)`` with ``lse = log sum_s exp(lse_s)``, in chunks of
  splits taken in index order: the merge is the same arithmetic whichever split finishes last,
  so the result is bitwise reproducible, and there is no second launch (FlashDecoding's combine
  kernel, folded into the split kernel as a semaphore).

When (the row ``triton/decode``, `admits`): at most ``MAX_QUERIES = 16`` queries (more fill the prefill
kernel's query tiles anyway) against at least ``DECODE_MIN_KEYS = 1024`` visible keys
(`effattn.splits`, which says why). From 1k keys on, the prefill kernel leaves most SMs idle (B*H
programs, e.g. 32 on 132 SMs) and reads each KV head G times, and the split path's B*Hkv*splits
programs stream K and V once at full bandwidth.

Every constraint of the visibility rule (`effattn.visibility`: bottom-right alignment, causal,
window, block layout, key padding) is applied elementwise in every tile; a window bounds the
range the splits cover. Forward only and no dropout: the row's admission check says when a call
takes this path, and otherwise the row ``triton/prefill`` serves the call. A decode
step launches one kernel, allocates its partials with fixed sizes and reads nothing back from the
GPU: it can be captured in a CUDA graph. The counters stay zero between launches (the merging
program zeroes its own), so one buffer per device and stream is reused (`counters`); under
capture the graph gets a fresh one, zeroed as one of its nodes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .... import splits
from ....splits import MAX_QUERIES, MIN_KEYS_PER_SPLIT, decode_reasons, key_range, plan_splits, sm_count, visible_keys  # noqa: F401
from ....tiles import cdiv
from ..jit import cast, dot, load_tile
from ..runtime import _next_pow2, _tf32_enabled
from .launch import _capturing, _on_device, _or_dummy, plan_for
from .schedule import visible

MAX_ROWS = 128            # G * Lq packed rows per tile at most (fewer at head dim 256: `fits`)
NOMINAL_SMS = 132         # the SMs the plan assumes with no GPU to ask (the interpreter, explain on CPU): H100 SXM


# ---------------------------------------------------------------------------------------------
# Kernels

@triton.jit
def decode_kernel(Q, K, V, KPM, LAY, OP, LP, O, LSE, CNT,
                  q_strides, k_strides, v_strides, kpm_strides, Hkv, G, Lq, Lk, D, Dv, off, left, right, lay_h, lay_nkb, lay_bs,
                  k_lo, keys_per_split, splits, part_stride, qk_scale, LAY_SEEN, lay_seen_h,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  HAS_LAYOUT: tl.constexpr, HAS_KPM: tl.constexpr, PAD_D: tl.constexpr,
                  PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr,
                  MERGE_ROWS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, LAYOUT_ROWS: tl.constexpr):
    """One split of one (b, kv head): 1-D grid of B * Hkv * splits programs, splits fastest.
    FA-2 Alg. 1 on the packed rows of the GQA group. With one split the program writes O
    (B*H*Lq, Dv) in the output dtype and LSE (B*H*Lq,) fp32, natural log, itself. Otherwise it
    writes its partial output OP (splits, B*H*Lq, Dv) fp32, normalized within the split, and LP
    (splits, B*H*Lq) fp32, the split's log2-sum-exp2 of the scaled scores (-inf: no visible key),
    then counts its arrival in CNT[b * Hkv + hk] (int32, zero at launch); the last of the
    (b, kv head)'s splits to arrive merges all of them into O and LSE (`_merge_splits`) and zeroes
    the count again.

    The values of keys no packed row sees are zeroed (NaN / inf there then give 0 * 0 in P V, not
    0 * NaN): from the window bounds and the padding, and with a layout from LAY_SEEN (uint8, one
    byte per key, head stride ``lay_seen_h``: the keys of the blocks some head of the GQA group sees
    from query block 0, `layout_seen`) when every query is in the layout's first query block; otherwise
    (``LAYOUT_ROWS``: queries in several query blocks, a layout block < Lq) `ok` reduced over the rows.

    Scalar arguments as the C++ fields (`AttnParams`, `DecodeParams`: ``splits``;
    csrc/attention/decode.h), strides as tuples ``q_strides`` = (q_b, q_h, q_l, q_d), ``k_strides``,
    ``v_strides`` likewise, ``kpm_strides`` = (kpm_b, kpm_l), their elements named as the C++ fields.
    Without a C++ field: ``q_d``, ``k_d``, ``v_d`` (unit there), ``Hkv`` (H / G), ``k_lo`` (the
    first visible key), ``keys_per_split`` (C++ splits the tile count instead), ``part_stride``
    (the partials' rows per split: C++ stores them split-minor) and ``lay_seen_h``."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    kpm_b, kpm_l = kpm_strides
    pid = tl.program_id(0)
    split = pid % splits
    bk = pid // splits                                      # b * Hkv + hk
    b = bk // Hkv
    hk = bk % Hkv
    r = tl.arange(0, BLOCK_M)
    real = r < G * Lq
    h = hk * G + r // Lq                                      # each row's query head
    qi = tl.where(real, r % Lq, Lq)                           # padding rows: past Lq, so never visible
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (Q + b.to(tl.int64) * q_b + h[:, None].to(tl.int64) * q_h + qi[:, None].to(tl.int64) * q_l
              + offs_d[None, :] * q_d)
    q = load_tile(q_ptrs, r, G * Lq, offs_d, D, True, PAD_D)
    k_base = K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h
    v_base = V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h
    kpm_base = KPM + b.to(tl.int64) * kpm_b
    lay_rows = LAY + h[:, None].to(tl.int64) * lay_h        # per row: the layout of its own head
    lo = k_lo + split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, Lk)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    rel_n = tl.arange(0, BLOCK_N)
    for t in range(0, tl.cdiv(hi - lo, BLOCK_N)):
        start_n = lo + t * BLOCK_N
        offs_n = start_n + rel_n
        k_tile = k_base + start_n.to(tl.int64) * k_l              # int64 tile base: caches past 2**31 elements
        v_tile = v_base + start_n.to(tl.int64) * v_l
        kt = load_tile(k_tile + offs_d[:, None] * k_d + rel_n[None, :] * k_l, offs_d, D, offs_n, hi, PAD_D, True)
        s = dot(q, kt, DOT_PREC, INTERP_BF16) * qk_scale        # log2 units
        ok = visible(qi[:, None], offs_n[None, :], Lq, hi, off, left, right, lay_rows, lay_nkb, lay_bs,
                     HAS_LEFT, HAS_RIGHT, HAS_LAYOUT, False)
        if HAS_KPM:
            pad = tl.load(kpm_base + start_n.to(tl.int64) * kpm_l + rel_n * kpm_l, mask=offs_n < hi, other=1)
            ok = ok & (pad[None, :] == 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: exp2(-inf) = 0
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_tile + rel_n[:, None] * v_l + offs_dv[None, :] * v_d, offs_n, hi, offs_dv, Dv, True, PAD_DV)
        # keys no row of the tile sees (padding, outside every query's window, in layout blocks none
        # of the packed heads and queries sees): zero values, so that NaN / inf there give 0 * 0 in
        # P V, not 0 * NaN. A key vector: the window bounds (the rows' windows are shifts of one
        # interval), the padding and the layout blocks the group sees; a reduction of `ok` over the
        # rows (register pressure: spills at head dim 128) only where queries span layout blocks
        seen = offs_n < hi
        if HAS_LEFT:
            seen = seen & (offs_n >= off - left)
        if HAS_RIGHT:
            seen = seen & (offs_n <= Lq - 1 + off + right)
        if HAS_KPM:
            seen = seen & (pad == 0)
        if HAS_LAYOUT:
            if LAYOUT_ROWS:
                seen = tl.max(ok.to(tl.int32), 0) > 0
            else:
                blk = tl.load(LAY_SEEN + hk.to(tl.int64) * lay_seen_h + offs_n, mask=offs_n < hi, other=0)
                seen = seen & (blk != 0)
        v = tl.where(seen[:, None], v, tl.zeros_like(v))
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERP_BF16), v, DOT_PREC, INTERP_BF16)
        m_i = m_new
    real_rows = bk.to(tl.int64) * G * Lq + r                  # (b, h, i) of O and LSE
    if splits == 1:                                         # the only split: the output itself
        _finish(O, LSE, real_rows, real, offs_dv, Dv, acc, l_i, m_i, INTERP_BF16)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        row = split.to(tl.int64) * part_stride + real_rows   # (split, b, h, i) of the partials
        tl.store(OP + row[:, None] * Dv + offs_dv[None, :], acc / l_safe[:, None],
                 mask=real[:, None] & (offs_dv[None, :] < Dv))
        tl.store(LP + row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=real)
        # every thread's partial is stored before the arrival is counted (the count's release
        # publishes them to the program that merges)
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + bk, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:                           # the last split of this (b, kv head) to finish
            tl.store(CNT + bk, 0)                             # zero again for the next launch on the stream
            _merge_splits(OP, LP, O, LSE, bk, G * Lq, splits, part_stride, Dv, offs_dv,
                          BLOCK_DV, MERGE_ROWS, SPLIT_CHUNK, INTERP_BF16)


@triton.jit
def _finish(O, LSE, rows, real, offs_dv, Dv, acc, l, m, INTERP_BF16: tl.constexpr):
    """O = acc / l in the output dtype and LSE = (m + log2 l) / log2 e (natural log) for ``rows``
    (masked by ``real``); a row with l = 0 saw no key: O = 0, LSE = -inf."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    tl.store(O + rows[:, None] * Dv + offs_dv[None, :], cast(acc / l_safe[:, None], O.dtype.element_ty, INTERP_BF16),
             mask=real[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + rows, tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) / 1.4426950408889634), mask=real)


@triton.jit
def _merge_splits(OP, LP, O, LSE, bk, n_rows, splits, part_stride, Dv, offs_dv, BLOCK_DV: tl.constexpr,
                  MERGE_ROWS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, INTERP_BF16: tl.constexpr):
    """O and LSE of the ``n_rows`` packed rows of (b, kv head) ``bk`` from the partials of all
    splits: lse = log2 sum_s 2^lse_s, O = sum_s 2^(lse_s - lse) O_s, online over chunks of
    ``SPLIT_CHUNK`` splits taken in index order (one (chunk, rows, Dv) load each: a few
    round trips to L2, not one per split). The same arithmetic whichever split merges: bitwise
    reproducible. The partials bypass L1 (``.cg``): other programs wrote them."""
    rr = tl.arange(0, MERGE_ROWS)
    real = rr < n_rows
    rows = bk.to(tl.int64) * n_rows + rr
    sc = tl.arange(0, SPLIT_CHUNK)
    dv_ok = offs_dv < Dv
    m = tl.full((MERGE_ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((MERGE_ROWS,), tl.float32)
    acc = tl.zeros((MERGE_ROWS, BLOCK_DV), tl.float32)
    for c in range(0, splits, SPLIT_CHUNK):
        s = c + sc
        ok = (s < splits)[:, None] & real[None, :]
        idx = s.to(tl.int64)[:, None] * part_stride + rows[None, :]            # (chunk, rows)
        lp = tl.load(LP + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(OP + idx[:, :, None] * Dv + offs_dv[None, None, :], mask=ok[:, :, None] & dv_ok[None, None, :],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lp, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen yet: exp2(-inf) = 0, not NaN
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lp - m_ref[None, :])                          # empty splits: lse_s = -inf, weight 0
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    _finish(O, LSE, rows, real, offs_dv, Dv, acc, l, m, INTERP_BF16)


# ---------------------------------------------------------------------------------------------
# Which calls, how many splits

def packed_rows(G: int, Lq: int) -> int:
    """Rows of the query tile: the G heads x Lq queries of a KV head, padded to a power of two >= 16."""
    return max(16, _next_pow2(G * Lq))


def config(block_d: int, block_dv: int, rows: int, element_size: int) -> Tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of the decode kernel for ``rows`` packed rows (no
    autotuning: one config, so a first call may be captured in a CUDA graph). Chosen from offline
    sm_90 compiles (tools/triton/kernel_resources.py, kinds ``decode``): no spills with every feature
    on, loads prefetched in flight (3 stages) for 16-bit inputs."""
    head = max(block_d, block_dv)
    big = element_size > 2 and head > 128            # fp32 at head dim 256
    block_n = 64 if rows <= 16 and head <= 128 and element_size == 2 else 32
    return block_n, (4 if rows <= 16 and not big else 8), (2 if big and rows > 16 else 3)


def fits(rows: int, block_d: int, block_dv: int, element_size: int, ieee_fp32: bool = False) -> bool:
    """Whether ``rows`` packed rows fit the kernel without spilling in its loop (offline sm_90
    compiles, triton 3.6 and 3.9): the query tile (rows x D) and the fp32 accumulator (rows x Dv) in
    registers; 128 rows at head dim 128 in 16-bit, 32 rows for fp32 at head dim 256. fp32 with IEEE
    dots (no TF32: FMA loops instead of tensor cores) holds 16 rows at head dim 256, 64 at 64."""
    cells = rows * max(block_d, block_dv)
    return rows <= MAX_ROWS and cells <= (16 * 256 if ieee_fp32 else MAX_ROWS * 128 * 2 // element_size)


def admits(call) -> List[str]:
    """Why the split-KV decode leaves a call (a validated AttnCall the backend declares to serve) to
    the prefill kernel: empty when it takes it."""
    if call.Lq == 0:
        return [f"Lq=0 not in 1..{MAX_QUERIES}"]
    why = decode_reasons(call)
    if why:
        return why
    Lq, G = call.Lq, call.H // call.Hkv
    ieee = call.q.dtype == torch.float32 and not _tf32_enabled()
    if not fits(packed_rows(G, Lq), _next_pow2(call.D), _next_pow2(call.Dv), call.q.element_size(), ieee):
        return [f"{G} heads per KV head x Lq={Lq} rows do not fit one tile at head dim {max(call.D, call.Dv)}"]
    keys = visible_keys(call)
    if keys < splits.DECODE_MIN_KEYS:
        return [f"{keys} visible keys < {splits.DECODE_MIN_KEYS}"]
    return []


def describe(call) -> Optional[str]:
    """The detail `effattn.explain` shows for a call the split-KV decode takes: its splits for this device."""
    G = call.H // call.Hkv
    k_lo, k_hi = key_range(call.Lq, call.Lk, call.window_left)
    block_n = config(max(16, _next_pow2(call.D)), max(16, _next_pow2(call.Dv)), packed_rows(G, call.Lq),
                     call.q.element_size())[0]
    n, per = plan_splits(call.B * call.Hkv, k_hi - k_lo, sm_count(call.q.device, NOMINAL_SMS), block_n)
    return (f"split-KV decode: {G} heads x {call.Lq} queries packed per KV head, {n} splits of {per} keys, "
            f"merged by the last to finish")


# ---------------------------------------------------------------------------------------------
# Launcher

def layout_seen(lay: torch.Tensor, block: int, G: int, Hkv: int) -> torch.Tensor:
    """uint8 ``(Hkv, nkb * block)`` (``(1, ...)`` for a layout shared by all heads): per key, whether
    its block is seen by some query head of the KV head's GQA group from query block 0, from a
    layout's uint8 mask ``(Hl, nqb, nkb)``; the decode kernel zeroes the values of the other keys.
    Per key, not per block: one byte per key and head spares the kernel a division by the block."""
    first = lay[:, 0]
    if lay.shape[0] > 1:
        first = first.reshape(Hkv, G, -1).amax(1)
    return first.repeat_interleave(block, dim=1)


class DecodePlan:
    """Grid size, scalar arguments by name (`decode_kernel`'s, named as the C++ fields) and flags of
    a decode call's launch (q, k, v give their strides, which the `LaunchPlan` is keyed by), built
    once per `LaunchPlan` and split choice and kept in the plan's argument cache: a repeated decode
    step costs two dictionary lookups on the host besides the launch. Its one tensor, with a layout
    whose first query block holds every query, is the keys of the layout's blocks seen per KV head
    (`seen_keys`)."""

    def __init__(self, p, q, k, v, num_sms: int, keys_per_split: Optional[int], block_n: Optional[int]):
        rows = packed_rows(p.G, p.Lq)
        cfg_n, warps, stages = config(p.block_d, p.block_dv, rows, p.element_size)
        block_n = block_n or cfg_n
        k_lo, k_hi = key_range(p.Lq, p.Lk, p.left)
        if keys_per_split is None:
            n_splits, keys_per_split = plan_splits(p.B * p.Hkv, k_hi - k_lo, num_sms, block_n)
        else:
            if keys_per_split % block_n:
                raise ValueError(f"decode: keys_per_split={keys_per_split} must be a multiple of the key tile "
                                 f"{block_n}")
            n_splits = max(1, cdiv(k_hi - k_lo, keys_per_split))
        self.n_splits, self.keys_per_split = n_splits, keys_per_split
        self.n_rows = p.B * p.H * p.Lq
        self.n_counters = p.B * p.Hkv
        self.grid = (p.B * p.Hkv * n_splits,)
        # queries in several query blocks of the layout (a block < Lq): the kernel reduces its mask over the rows
        layout_rows = p.lay is not None and p.Lq > p.layout_block
        self.needs_seen = p.lay is not None and not layout_rows
        self.lay_seen = None
        self.args = dict(q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(),
                         kpm_strides=p.kpm_strides, Hkv=p.Hkv, G=p.G, Lq=p.Lq, Lk=p.Lk, D=p.D, Dv=p.Dv, off=p.off,
                         left=p.left, right=p.right, lay_h=p.lay_h, lay_nkb=p.lay_nkb, lay_bs=max(p.layout_block, 1),
                         k_lo=k_lo, keys_per_split=keys_per_split, splits=n_splits, part_stride=self.n_rows,
                         qk_scale=p.qk_scale,
                         lay_seen_h=p.lay_nkb * p.layout_block if self.needs_seen and p.lay.shape[0] > 1 else 0)
        merge_rows = max(2, _next_pow2(p.G * p.Lq))
        self.meta = dict(BLOCK_M=rows, BLOCK_N=block_n, BLOCK_D=p.block_d, BLOCK_DV=p.block_dv,
                         HAS_LEFT=p.left >= 0, HAS_RIGHT=p.right >= 0, HAS_LAYOUT=p.layout_mask is not None,
                         HAS_KPM=p.has_kpm, PAD_D=p.block_d != p.D, PAD_DV=p.block_dv != p.Dv,
                         DOT_PREC=p.dot_prec, INTERP_BF16=p.interp_bf16, MERGE_ROWS=merge_rows,
                         SPLIT_CHUNK=split_chunk(merge_rows, p.block_dv, warps), LAYOUT_ROWS=layout_rows,
                         num_warps=warps, num_stages=stages, enable_fp_fusion=True)

    def seen_keys(self, p, device) -> Optional[torch.Tensor]:
        """`layout_seen` of the call's layout (None without one or with ``LAYOUT_ROWS``), built at the
        first launch and kept; under CUDA-graph capture built afresh (a node of the graph: nothing
        runs until a replay, so an eager launch must not reuse it)."""
        if not self.needs_seen:
            return None
        if _capturing(device):
            return layout_seen(p.lay, p.layout_block, p.G, p.Hkv)
        if self.lay_seen is None:
            self.lay_seen = layout_seen(p.lay, p.layout_block, p.G, p.Hkv)
        return self.lay_seen


MERGE_ELEMENTS_PER_THREAD = 32   # fp32 partial-output elements a thread holds per merge step


def split_chunk(merge_rows: int, block_dv: int, warps: int) -> int:
    """Splits the merge reads in one step: a (chunk, rows, Dv) fp32 tile of at most
    `MERGE_ELEMENTS_PER_THREAD` elements per thread (the split loop's tiles are dead by then), a
    power of two from 1 to 64. H = 32, Hkv = 8, Lq = 1, D = 128 (4 rows): 16 splits a step."""
    chunk = max(1, MERGE_ELEMENTS_PER_THREAD * 32 * warps // (merge_rows * block_dv))
    return min(64, 1 << (chunk.bit_length() - 1))


_COUNTERS: Dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 zeros: the splits' arrival counters of a launch. The merging program
    zeroes its counter again, so outside CUDA-graph capture one buffer per (device, stream) serves
    every launch (launches on one stream run in order; another stream gets its own buffer). Under
    capture a fresh buffer, zeroed by a node of the graph: a replay never shares counters with
    eager launches."""
    if _capturing(device):
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).stream_id) if device.type == "cuda" else (device,)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def fwd(q, k, v, layout_mask, layout_block, kpm, scale, left, right, tf32=False, *, num_sms=None,
        keys_per_split=None, block_n=None):
    """out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq) fp32, as `launch.fwd` without dropout.

    ``num_sms`` (default: the device's) sets the number of splits (`plan_splits`);
    ``keys_per_split`` (a multiple of the key tile) and ``block_n`` force them, for tests."""
    p = plan_for(q, k, v, layout_mask, layout_block, kpm, scale, 0.0, left, right, tf32)
    key = ("decode", num_sms or sm_count(q.device, NOMINAL_SMS), keys_per_split, block_n)
    d = p._args.get(key)
    if d is None:
        d = p._args[key] = DecodePlan(p, q, k, v, key[1], keys_per_split, block_n)
    out = torch.empty((p.B, p.H, p.Lq, p.Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    if d.n_rows == 0:
        return out, lse
    cnt = counters(q.device, d.n_counters)
    if d.n_splits > 1:
        o_part = torch.empty((d.n_splits, d.n_rows, p.Dv), dtype=torch.float32, device=q.device)
        l_part = torch.empty((d.n_splits, d.n_rows), dtype=torch.float32, device=q.device)
    else:                               # the programs write out and lse themselves
        o_part = l_part = lse
    with _on_device(q.device):
        decode_kernel[d.grid](Q=q, K=k, V=v, KPM=kpm.view(torch.uint8) if kpm is not None else q,
                              LAY=_or_dummy(p.lay, q), OP=o_part, LP=l_part, O=out, LSE=lse, CNT=cnt,
                              LAY_SEEN=_or_dummy(d.seen_keys(p, q.device), q), **d.args, **d.meta)
    return out, lse
