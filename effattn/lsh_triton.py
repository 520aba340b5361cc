"""Triton kernels of `effattn.lsh_attention`: the chunk + neighbours block pattern of the sorted
sequence, rows gathered in-kernel through the sort permutation (no sorted copies of q, k, v).

Program ``(c, n)`` with ``n = (b, h, r)`` takes chunk ``c`` of round r's sorted order. The original
positions of its rows are the permutation's entries ``perm[n, c * CL + i]``, so the kernel loads the
query rows at those positions and, for each neighbour offset o, the key/value rows of chunk
``(c + o) % n_chunks``; the masks (causal and padding on the original positions, the self score)
are evaluated elementwise on the loaded positions. Softmax is FlashAttention-2's online softmax
(Dao 2023, Alg. 1). Outputs and lse are stored at the original positions (a scatter of distinct
rows), per round; the rounds are merged in torch by their lse.

Backward (FA-2 Alg. 2, with ``Delta = rowsum(dO o O) - dlse`` from torch): a dQ program per query
chunk loops over its neighbour key chunks; a dK/dV program per key chunk loops over the query
chunks that see it, ``(c - o) % n_chunks``; each (query chunk, key chunk) pair occurs once, so no
atomics: per-round gradients are written at the rows' positions and summed over rounds in torch
(a fixed order: deterministic). The self score is a constant, so it passes no gradient.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .lsh import SELF_SCORE
from .online_softmax import finish, online_step


@triton.jit
def _program(PERM, spn, H, R, CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (c, n = (b, h, r)): its chunk's original positions and the index vectors."""
    c = tl.program_id(0)
    n = tl.program_id(1)
    rows = tl.arange(0, CL)
    perm = PERM + n.to(tl.int64) * spn
    idx = tl.load(perm + c * CL + rows)
    n64 = n.to(tl.int64)                  # b * stride may pass 2^31 on large inputs
    return (c, n, n64 // (H * R), (n64 // R) % H, n64 % R, rows, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), perm,
            idx)


@triton.jit
def _load_rows(base, idx, stride_l, offs, stride_d, n):
    """Rows ``idx`` (original positions) of a (L, n) matrix, columns ``offs`` (zero past n)."""
    return tl.load(base + idx[:, None].to(tl.int64) * stride_l + offs[None, :] * stride_d, mask=offs[None, :] < n,
                   other=0.0)


@triton.jit
def _row_stats(LSE, DELTA, DO, row, offs_dv, Dv):
    """The backward's per-row inputs at flat rows ``row`` of (N, L): lse (-inf made 0), Delta, dO."""
    lse = tl.load(LSE + row)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + row)
    do = tl.load(DO + row[:, None] * Dv + offs_dv[None, :], mask=offs_dv[None, :] < Dv, other=0.0)
    return lse, delta, do


@triton.jit
def _dropped(x, seed, n, qidx, kidx, drop_thresh, drop_scale):
    """Dropout of ``x (queries, keys)``: kept entries scaled by ``1 / (1 - p)``, from Philox with the
    counter (query position, key position, (b, h, r), 0): forward and backward draw the same mask."""
    c0 = (qidx[:, None] + kidx[None, :] * 0).to(tl.uint32)
    c1 = (kidx[None, :] + qidx[:, None] * 0).to(tl.uint32)
    c2 = c0 * 0 + n.to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
    return tl.where((bits >> 8).to(tl.int32) >= drop_thresh, x * drop_scale, 0.0)


@triton.jit
def _scores(q, k_base, kidx, qidx, offs_d, skl, skd, kpm_base, skpl, D, scale,
            SELF_SCORE: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, BLOCK_D: tl.constexpr,
            PREC: tl.constexpr):
    """Masked, scaled scores of the query rows (positions ``qidx``) against the key rows at ``kidx``;
    also whether each entry is a token against itself."""
    kt = tl.load(k_base + kidx[None, :].to(tl.int64) * skl + offs_d[:, None] * skd, mask=offs_d[:, None] < D, other=0.0)
    s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * scale
    is_self = kidx[None, :] == qidx[:, None]
    s = tl.where(is_self, SELF_SCORE, s)
    if CAUSAL:
        s = tl.where(kidx[None, :] <= qidx[:, None], s, float("-inf"))
    if HAS_KPM:
        pad = tl.load(kpm_base + kidx.to(tl.int64) * skpl)
        s = tl.where(pad[None, :] == 0, s, float("-inf"))
    return s, is_self


@triton.jit
def _lsh_fwd(Q, K, V, PERM, KPM, OFFS, OUT, LSE,
             sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, spn, skpb, skpl,
             sob, soh, sor, sol, sod, slb, slh, slr, sll,
             H, R, D, Dv, n_chunks, n_offs, scale, seed, drop_thresh, drop_scale,
             CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SELF_SCORE: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
             DROPOUT: tl.constexpr):
    c, n, b, h, r, rows, offs_d, offs_dv, perm, qidx = _program(PERM, spn, H, R, CL, BLOCK_D, BLOCK_DV)
    q = _load_rows(Q + b * sqb + h * sqh, qidx, sql, offs_d, sqd, D)
    if not LOW:                                   # float32 scores (half inputs on a GPU: native dots)
        q = q.to(tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    kpm_base = KPM + b * skpb
    m_i = tl.full([CL], float("-inf"), tl.float32)
    l_i = tl.zeros([CL], tl.float32)
    acc = tl.zeros([CL, BLOCK_DV], tl.float32)
    for t in range(n_offs):
        kc = (c + tl.load(OFFS + t)) % n_chunks
        kidx = tl.load(perm + kc * CL + rows)
        s, _ = _scores(q, k_base, kidx, qidx, offs_d, skl, skd, kpm_base, skpl, D, scale, SELF_SCORE, CAUSAL,
                       HAS_KPM, BLOCK_D, PREC)
        p, alpha, m_new, l_i = online_step(m_i, l_i, s)
        v = _load_rows(v_base, kidx, svl, offs_dv, svd, Dv)
        pv = p
        if DROPOUT:
            pv = _dropped(p, seed, n, qidx, kidx, drop_thresh, drop_scale)
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    base = b * sob + h * soh + r * sor
    tl.store(OUT + base + qidx[:, None].to(tl.int64) * sol + offs_dv[None, :] * sod, out, mask=offs_dv[None, :] < Dv)
    tl.store(LSE + b * slb + h * slh + r * slr + qidx.to(tl.int64) * sll, lse)


@triton.jit
def _lsh_bwd_dq(Q, K, V, PERM, KPM, OFFS, LSE, DELTA, DO, DQ,
                sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, spn, skpb, skpl,
                H, R, D, Dv, n_chunks, n_offs, scale, seed, drop_thresh, drop_scale,
                CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SELF_SCORE: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
             DROPOUT: tl.constexpr):
    """dQ of one query chunk. LSE, DELTA: contiguous (N, L); DO (N, L, Dv), DQ (N, L, D) contiguous fp32."""
    c, n, b, h, r, rows, offs_d, offs_dv, perm, qidx = _program(PERM, spn, H, R, CL, BLOCK_D, BLOCK_DV)
    L = n_chunks * CL
    q = _load_rows(Q + b * sqb + h * sqh, qidx, sql, offs_d, sqd, D)
    if not LOW:
        q = q.to(tl.float32)
    row = n.to(tl.int64) * L + qidx
    lse, delta, do = _row_stats(LSE, DELTA, DO, row, offs_dv, Dv)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    kpm_base = KPM + b * skpb
    dq = tl.zeros([CL, BLOCK_D], tl.float32)
    for t in range(n_offs):
        kc = (c + tl.load(OFFS + t)) % n_chunks
        kidx = tl.load(perm + kc * CL + rows)
        s, is_self = _scores(q, k_base, kidx, qidx, offs_d, skl, skd, kpm_base, skpl, D, scale, SELF_SCORE, CAUSAL,
                             HAS_KPM, BLOCK_D, PREC)
        p = tl.exp(s - lse[:, None])
        vt = tl.load(v_base + kidx[None, :].to(tl.int64) * svl + offs_dv[:, None] * svd,
                     mask=offs_dv[:, None] < Dv, other=0.0)
        dp = tl.dot(do, vt.to(tl.float32), input_precision="ieee")
        if DROPOUT:
            dp = _dropped(dp, seed, n, qidx, kidx, drop_thresh, drop_scale)
        ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
        k = _load_rows(k_base, kidx, skl, offs_d, skd, D)
        dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
    tl.store(DQ + row[:, None] * D + offs_d[None, :], dq * scale, mask=offs_d[None, :] < D)


@triton.jit
def _lsh_bwd_dkv(Q, K, V, PERM, KPM, OFFS, LSE, DELTA, DO, DK, DV,
                 sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, spn, skpb, skpl,
                 H, R, D, Dv, n_chunks, n_offs, scale, seed, drop_thresh, drop_scale,
                 CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SELF_SCORE: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
             DROPOUT: tl.constexpr):
    """dK, dV of one key chunk: the query chunks (c - o) % n_chunks that see it. DK (N, L, D) and
    DV (N, L, Dv) contiguous fp32."""
    c, n, b, h, r, rows, offs_d, offs_dv, perm, kidx = _program(PERM, spn, H, R, CL, BLOCK_D, BLOCK_DV)
    L = n_chunks * CL
    k_base = K + b * skb + h * skh
    v = _load_rows(V + b * svb + h * svh, kidx, svl, offs_dv, svd, Dv)
    kpm_base = KPM + b * skpb
    q_base = Q + b * sqb + h * sqh
    dk = tl.zeros([CL, BLOCK_D], tl.float32)
    dv = tl.zeros([CL, BLOCK_DV], tl.float32)
    for t in range(n_offs):
        qc = (c - tl.load(OFFS + t) + n_chunks) % n_chunks
        qidx = tl.load(perm + qc * CL + rows)
        q = _load_rows(q_base, qidx, sql, offs_d, sqd, D)
        if not LOW:
            q = q.to(tl.float32)
        s, is_self = _scores(q, k_base, kidx, qidx, offs_d, skl, skd, kpm_base, skpl, D, scale, SELF_SCORE, CAUSAL,
                             HAS_KPM, BLOCK_D, PREC)
        lse, delta, do = _row_stats(LSE, DELTA, DO, n.to(tl.int64) * L + qidx, offs_dv, Dv)
        p = tl.exp(s - lse[:, None])                                  # (CL queries, CL keys)
        dp = tl.dot(do, tl.trans(v.to(tl.float32)), input_precision="ieee")
        pv = p
        if DROPOUT:
            pv = _dropped(p, seed, n, qidx, kidx, drop_thresh, drop_scale)
            dp = _dropped(dp, seed, n, qidx, kidx, drop_thresh, drop_scale)
        dv += tl.dot(tl.trans(pv), do, input_precision="ieee")
        ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
        dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
    rk = n.to(tl.int64) * L + kidx
    tl.store(DK + rk[:, None] * D + offs_d[None, :], dk * scale, mask=offs_d[None, :] < D)
    tl.store(DV + rk[:, None] * Dv + offs_dv[None, :], dv, mask=offs_dv[None, :] < Dv)


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _common(q, k, v, perm, kpm, offsets):
    B, H, L, D = q.shape
    R = perm.shape[0] // (B * H)
    kpm_arg = kpm if kpm is not None else perm          # never read without HAS_KPM
    skpb, skpl = (kpm.stride(0), kpm.stride(1)) if kpm is not None else (0, 0)
    strides = (*q.stride(), *k.stride(), *v.stride(), perm.stride(0), skpb, skpl)
    return B, H, L, D, R, kpm_arg, strides


class _LSHRounds(torch.autograd.Function):
    """``(q, k, v) -> out_r (B, H, R, L, Dv), lse_r (B, H, R, L)`` float32, per round, original order."""

    @staticmethod
    def forward(ctx, q, k, v, perm, kpm, offsets, chunk_len, causal, scale, dropout_p, seed):
        B, H, L, D, R, kpm_arg, strides = _common(q, k, v, perm, kpm, offsets)
        Dv = v.shape[-1]
        out = torch.empty(B, H, R, L, Dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, R, L, dtype=torch.float32, device=q.device)
        nc = L // chunk_len
        low = q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
        meta = dict(CL=chunk_len, BLOCK_D=_next_pow2(D), BLOCK_DV=_next_pow2(Dv), SELF_SCORE=SELF_SCORE, CAUSAL=causal,
                    HAS_KPM=kpm is not None, PREC="ieee", LOW=low, DROPOUT=dropout_p > 0)
        _lsh_fwd[(nc, B * H * R)](q, k, v, perm, kpm_arg, offsets, out, lse, *strides, *out.stride(), *lse.stride(),
                                  H, R, D, Dv, nc, offsets.numel(), scale, *_dropout_args(dropout_p, seed), **meta)
        ctx.save_for_backward(q, k, v, perm, kpm, offsets, out, lse)
        ctx.meta, ctx.scale, ctx.dropout = meta, scale, _dropout_args(dropout_p, seed)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, perm, kpm, offsets, out, lse = ctx.saved_tensors
        B, H, L, D, R, kpm_arg, strides = _common(q, k, v, perm, kpm, offsets)
        Dv = v.shape[-1]
        dout = torch.zeros_like(out) if dout is None else dout.to(torch.float32).contiguous()
        delta = (dout * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(torch.float32)
        delta = delta.contiguous()
        dq = torch.empty(B, H, R, L, D, dtype=torch.float32, device=q.device)
        dk = torch.empty_like(dq)
        dv = torch.empty(B, H, R, L, Dv, dtype=torch.float32, device=q.device)
        nc = L // ctx.meta["CL"]
        args = (H, R, D, Dv, nc, offsets.numel(), ctx.scale, *ctx.dropout)
        lse = lse.contiguous()
        _lsh_bwd_dq[(nc, B * H * R)](q, k, v, perm, kpm_arg, offsets, lse, delta, dout, dq, *strides, *args,
                                     **ctx.meta)
        _lsh_bwd_dkv[(nc, B * H * R)](q, k, v, perm, kpm_arg, offsets, lse, delta, dout, dk, dv, *strides, *args,
                                      **ctx.meta)
        # rounds summed in a fixed order
        return (dq.sum(2).to(q.dtype), dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype), None, None, None, None, None,
                None, None, None)


def _dropout_args(p: float, seed: int):
    """(seed, threshold on 24 random bits, 1 / (1 - p)) of the kernels' dropout."""
    return seed, int(p * (1 << 24)), 1.0 / (1.0 - p)


def draw_seed() -> int:
    """The kernels' dropout seed, drawn from torch's default generator (so ``torch.manual_seed`` and a
    reversible layer's random-state replay reproduce the mask)."""
    return int(torch.randint(0, 2**31 - 1, (1,)))


@triton.jit
def _keep_mask_kernel(OUT, seed, drop_thresh, L: tl.constexpr):
    n = tl.program_id(0)
    i = tl.arange(0, L)
    kept = _dropped(tl.full([L, L], 1.0, tl.float32), seed, n, i, i, drop_thresh, 1.0)
    tl.store(OUT + n.to(tl.int64) * L * L + i[:, None] * L + i[None, :], kept)


def keep_mask(seed: int, n_slices: int, length: int, dropout_p: float, device="cpu") -> Tensor:
    """bool ``(n_slices, L, L)``: which (query position, key position) pairs of slice ``(b, h, r)`` the
    kernels keep under dropout with ``seed`` (``L`` a power of two >= 16; for tests)."""
    out = torch.empty(n_slices, length, length, dtype=torch.float32, device=device)
    _keep_mask_kernel[(n_slices,)](out, seed, _dropout_args(dropout_p, seed)[1], L=length)
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
