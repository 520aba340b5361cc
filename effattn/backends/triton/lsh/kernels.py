"""Triton kernels of `effattn.lsh_attention` (math only; the launchers in ``launch.py``): the chunk + neighbours block pattern of the sorted
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

Arguments: the names of the C++ `AttnParams` fields where one exists (``H``, ``D``, ``Dv``, ``scale``,
``seed``, ``drop_thresh``, ``inv_keep``); element strides as one tuple per tensor, unpacked to those
names: ``q_strides`` = (q_b, q_h, q_l, q_d), ``k_strides``, ``v_strides`` likewise, ``kpm_strides`` =
(kpm_b, kpm_l). No C++ field: ``R`` (hash rounds), the permutation's row stride ``perm_n``, the
per-round outputs' ``o_strides`` = (o_b, o_h, o_r, o_l, o_d) and ``lse_strides`` = (lse_b, lse_h, lse_r,
lse_l), ``n_chunks``, ``n_offs``. ``launch.kernel_args`` builds them by name; every launch passes them
by keyword.
"""
import triton
import triton.language as tl

from ..online_softmax import finish, online_step


@triton.jit
def _program(PERM, perm_n, H, R, CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (c, n = (b, h, r)): its chunk's original positions and the index vectors."""
    c = tl.program_id(0)
    n = tl.program_id(1)
    rows = tl.arange(0, CL)
    perm = PERM + n.to(tl.int64) * perm_n
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
def _dropped(x, seed, n, qidx, kidx, drop_thresh, inv_keep):
    """Dropout of ``x (queries, keys)``: kept entries scaled by ``1 / (1 - p)``, from Philox with the
    counter (query position, key position, (b, h, r), 0): forward and backward draw the same mask."""
    c0 = (qidx[:, None] + kidx[None, :] * 0).to(tl.uint32)
    c1 = (kidx[None, :] + qidx[:, None] * 0).to(tl.uint32)
    c2 = c0 * 0 + n.to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
    return tl.where((bits >> 8).to(tl.int32) >= drop_thresh, x * inv_keep, 0.0)


@triton.jit
def _scores(q, k_base, kidx, qidx, offs_d, k_l, k_d, kpm_base, kpm_l, D, scale,
            SELF_SCORE: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, BLOCK_D: tl.constexpr,
            PREC: tl.constexpr):
    """Masked, scaled scores of the query rows (positions ``qidx``) against the key rows at ``kidx``;
    also whether each entry is a token against itself."""
    kt = tl.load(k_base + kidx[None, :].to(tl.int64) * k_l + offs_d[:, None] * k_d, mask=offs_d[:, None] < D, other=0.0)
    s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * scale
    is_self = kidx[None, :] == qidx[:, None]
    s = tl.where(is_self, SELF_SCORE, s)
    if CAUSAL:
        s = tl.where(kidx[None, :] <= qidx[:, None], s, float("-inf"))
    if HAS_KPM:
        pad = tl.load(kpm_base + kidx.to(tl.int64) * kpm_l)
        s = tl.where(pad[None, :] == 0, s, float("-inf"))
    return s, is_self


@triton.jit
def lsh_fwd_kernel(Q, K, V, PERM, KPM, OFFS, O, LSE,
                   q_strides, k_strides, v_strides, perm_n, kpm_strides,
                   o_strides, lse_strides,
                   H, R, D, Dv, n_chunks, n_offs, scale, seed, drop_thresh, inv_keep,
                   CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SELF_SCORE: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
                   DROPOUT: tl.constexpr):
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    kpm_b, kpm_l = kpm_strides
    o_b, o_h, o_r, o_l, o_d = o_strides
    lse_b, lse_h, lse_r, lse_l = lse_strides
    c, n, b, h, r, rows, offs_d, offs_dv, perm, qidx = _program(PERM, perm_n, H, R, CL, BLOCK_D, BLOCK_DV)
    q = _load_rows(Q + b * q_b + h * q_h, qidx, q_l, offs_d, q_d, D)
    if not LOW:                                   # float32 scores (half inputs on a GPU: native dots)
        q = q.to(tl.float32)
    k_base = K + b * k_b + h * k_h
    v_base = V + b * v_b + h * v_h
    kpm_base = KPM + b * kpm_b
    m_i = tl.full([CL], float("-inf"), tl.float32)
    l_i = tl.zeros([CL], tl.float32)
    acc = tl.zeros([CL, BLOCK_DV], tl.float32)
    for t in range(n_offs):
        kc = (c + tl.load(OFFS + t)) % n_chunks
        kidx = tl.load(perm + kc * CL + rows)
        s, _ = _scores(q, k_base, kidx, qidx, offs_d, k_l, k_d, kpm_base, kpm_l, D, scale, SELF_SCORE, CAUSAL,
                       HAS_KPM, BLOCK_D, PREC)
        p, alpha, m_new, l_i = online_step(m_i, l_i, s)
        v = _load_rows(v_base, kidx, v_l, offs_dv, v_d, Dv)
        pv = p
        if DROPOUT:
            pv = _dropped(p, seed, n, qidx, kidx, drop_thresh, inv_keep)
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    out, lse = finish(acc, m_i, l_i)
    base = b * o_b + h * o_h + r * o_r
    tl.store(O + base + qidx[:, None].to(tl.int64) * o_l + offs_dv[None, :] * o_d, out, mask=offs_dv[None, :] < Dv)
    tl.store(LSE + b * lse_b + h * lse_h + r * lse_r + qidx.to(tl.int64) * lse_l, lse)


@triton.jit
def lsh_dq_kernel(Q, K, V, PERM, KPM, OFFS, LSE, DELTA, DO, DQ,
                  q_strides, k_strides, v_strides, perm_n, kpm_strides,
                  H, R, D, Dv, n_chunks, n_offs, scale, seed, drop_thresh, inv_keep,
                  CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SELF_SCORE: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
                  DROPOUT: tl.constexpr):
    """dQ of one query chunk. LSE, DELTA: contiguous (N, L); DO (N, L, Dv), DQ (N, L, D) contiguous fp32."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    kpm_b, kpm_l = kpm_strides
    c, n, b, h, r, rows, offs_d, offs_dv, perm, qidx = _program(PERM, perm_n, H, R, CL, BLOCK_D, BLOCK_DV)
    L = n_chunks * CL
    q = _load_rows(Q + b * q_b + h * q_h, qidx, q_l, offs_d, q_d, D)
    if not LOW:
        q = q.to(tl.float32)
    row = n.to(tl.int64) * L + qidx
    lse, delta, do = _row_stats(LSE, DELTA, DO, row, offs_dv, Dv)
    k_base = K + b * k_b + h * k_h
    v_base = V + b * v_b + h * v_h
    kpm_base = KPM + b * kpm_b
    dq = tl.zeros([CL, BLOCK_D], tl.float32)
    for t in range(n_offs):
        kc = (c + tl.load(OFFS + t)) % n_chunks
        kidx = tl.load(perm + kc * CL + rows)
        s, is_self = _scores(q, k_base, kidx, qidx, offs_d, k_l, k_d, kpm_base, kpm_l, D, scale, SELF_SCORE, CAUSAL,
                             HAS_KPM, BLOCK_D, PREC)
        p = tl.exp(s - lse[:, None])
        vt = tl.load(v_base + kidx[None, :].to(tl.int64) * v_l + offs_dv[:, None] * v_d,
                     mask=offs_dv[:, None] < Dv, other=0.0)
        dp = tl.dot(do, vt.to(tl.float32), input_precision="ieee")
        if DROPOUT:
            dp = _dropped(dp, seed, n, qidx, kidx, drop_thresh, inv_keep)
        ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
        k = _load_rows(k_base, kidx, k_l, offs_d, k_d, D)
        dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
    tl.store(DQ + row[:, None] * D + offs_d[None, :], dq * scale, mask=offs_d[None, :] < D)


@triton.jit
def lsh_dkv_kernel(Q, K, V, PERM, KPM, OFFS, LSE, DELTA, DO, DK, DV,
                   q_strides, k_strides, v_strides, perm_n, kpm_strides,
                   H, R, D, Dv, n_chunks, n_offs, scale, seed, drop_thresh, inv_keep,
                   CL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SELF_SCORE: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
                   DROPOUT: tl.constexpr):
    """dK, dV of one key chunk: the query chunks (c - o) % n_chunks that see it. DK (N, L, D) and
    DV (N, L, Dv) contiguous fp32."""
    q_b, q_h, q_l, q_d = q_strides
    k_b, k_h, k_l, k_d = k_strides
    v_b, v_h, v_l, v_d = v_strides
    kpm_b, kpm_l = kpm_strides
    c, n, b, h, r, rows, offs_d, offs_dv, perm, kidx = _program(PERM, perm_n, H, R, CL, BLOCK_D, BLOCK_DV)
    L = n_chunks * CL
    k_base = K + b * k_b + h * k_h
    v = _load_rows(V + b * v_b + h * v_h, kidx, v_l, offs_dv, v_d, Dv)
    kpm_base = KPM + b * kpm_b
    q_base = Q + b * q_b + h * q_h
    dk = tl.zeros([CL, BLOCK_D], tl.float32)
    dv = tl.zeros([CL, BLOCK_DV], tl.float32)
    for t in range(n_offs):
        qc = (c - tl.load(OFFS + t) + n_chunks) % n_chunks
        qidx = tl.load(perm + qc * CL + rows)
        q = _load_rows(q_base, qidx, q_l, offs_d, q_d, D)
        if not LOW:
            q = q.to(tl.float32)
        s, is_self = _scores(q, k_base, kidx, qidx, offs_d, k_l, k_d, kpm_base, kpm_l, D, scale, SELF_SCORE, CAUSAL,
                             HAS_KPM, BLOCK_D, PREC)
        lse, delta, do = _row_stats(LSE, DELTA, DO, n.to(tl.int64) * L + qidx, offs_dv, Dv)
        p = tl.exp(s - lse[:, None])                                  # (CL queries, CL keys)
        dp = tl.dot(do, tl.trans(v.to(tl.float32)), input_precision="ieee")
        pv = p
        if DROPOUT:
            pv = _dropped(p, seed, n, qidx, kidx, drop_thresh, inv_keep)
            dp = _dropped(dp, seed, n, qidx, kidx, drop_thresh, inv_keep)
        dv += tl.dot(tl.trans(pv), do, input_precision="ieee")
        ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
        dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
    rk = n.to(tl.int64) * L + kidx
    tl.store(DK + rk[:, None] * D + offs_d[None, :], dk * scale, mask=offs_d[None, :] < D)
    tl.store(DV + rk[:, None] * Dv + offs_dv[None, :], dv, mask=offs_dv[None, :] < Dv)


@triton.jit
def keep_mask_kernel(O, seed, drop_thresh, L: tl.constexpr):
    n = tl.program_id(0)
    i = tl.arange(0, L)
    kept = _dropped(tl.full([L, L], 1.0, tl.float32), seed, n, i, i, drop_thresh, 1.0)
    tl.store(O + n.to(tl.int64) * L * L + i[:, None] * L + i[None, :], kept)
