"""Relative-position keys (Shaw et al. 2018; Music Transformer; Transformer-XL, Dai et al. 2019):
the score term ``query_i . r[h, idx(d_ij)]`` and attention with it.

With effattn's bottom-right alignment query i sits at ``pos(i) = i + Lk - Lq`` and
``d_ij = pos(i) - j`` (>= 0 for past keys). The scores are::

    s_ij = scale * (q_i . k_j + query_i . r[h, idx(d_ij)])       query defaults to q
    idx(d) = clamp(d, 0, n_dist - 1)                  max_distance=None: r holds distances 0, 1, ...
                                                      (Transformer-XL; future keys must be invisible)
    idx(d) = clamp(d, -M, M) + M,  n_dist = 2M + 1    max_distance=M (Shaw, Music Transformer, Conformer)

Transformer-XL's ``(q + u) . k + (q + v) . R_{i-j}`` is ``q <- q + u`` with ``query = q + v``
(`RelPositionMultiheadAttention` does this).

The position term is ``(query @ r^T)`` of shape ``(rows, n_dist)`` read through a skewed gather
(the "relative shift", without Transformer-XL's pad-and-reshape). The path here is torch, **not
fused**: a block of query rows at a time, the backward recomputing each block's probabilities from
the saved lse, so memory is one ``(B, H, rows, max(Lk, n_dist))`` block, not ``(Lq, Lk)``; the
gradients of ``query`` and ``r`` come from band sums of the score gradient (a gather for the
interior distances, prefix/suffix sums for the clamped ends: no scatter, deterministic). With
dropout it differentiates the dense ``(B, H, Lq, Lk)`` scores with autograd. Triton kernels
(`effattn/backends/triton/relative/`: the term per tile, a `tl.gather` for the shift; a deterministic
backward with a distance-band pass for ``r``) serve calls without dropout (``backend="auto"`` on
CUDA). CUDA C++ kernels (`effattn/backends/cuda/attention/relative.py`, row ``cuda/relative``), forward and
backward (gradients up to head dim 128; the same distance-band pass for ``r``, its sums folded by
`fold_distances`), serve ``backend="cuda"`` (`explain_relative` says which path runs). The term itself
(`RelativeKeys`, `relative_index`, `relative_scores`) lives in `effattn.bias`: ``effattn.attention(...,
bias=RelativeKeys(r, query, max_distance))`` runs `relative_attention`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._call import compute_dtype, make_attn_call
from .backends import base
from .bias import RelativeKeys, relative_index, relative_scores  # noqa: F401  (public here too)
from .explanation import explain_call
from .lsh import softmax_lse
from .visibility import Rule, normalize_window

FN = "relative_attention"
UNFUSED_NOTE = ("relative keys: torch path, not fused: a block of query rows at a time with a recomputing backward, "
                "memory O(rows x max(Lk, n_dist)); with dropout, the dense (B, H, Lq, Lk) scores under autograd; "
                "Triton kernels serve CUDA calls without dropout; so do CUDA C++ kernels (backend='cuda')")


def check_relative(q: Tensor, r, query, max_distance, causal: bool, window, fn: str = FN) -> None:
    """Errors naming the argument for a malformed relative-keys term."""
    if not isinstance(r, torch.Tensor):
        raise TypeError(f"{fn}: r must be a torch.Tensor (H, n_dist, D), got {type(r).__name__}")
    B, H, Lq, D = q.shape
    if r.dim() != 3 or r.shape[0] != H or r.shape[2] != D:
        raise ValueError(f"{fn}: r must have shape (H={H}, n_dist, D={D}), got {tuple(r.shape)}")
    if r.dtype != q.dtype or r.device != q.device:
        raise TypeError(f"{fn}: r must share q's dtype and device ({q.dtype}, {q.device}), got {r.dtype}, {r.device}")
    if query is not None and (not isinstance(query, torch.Tensor) or query.shape != q.shape):
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"{fn}: query must be a tensor shaped like q {tuple(q.shape)}, got {got}")
    if max_distance is None:
        if r.shape[1] < 1:
            raise ValueError(f"{fn}: r must hold at least one distance, got n_dist=0")
        if normalize_window(window, causal)[1] != 0:
            raise ValueError(f"{fn}: r without max_distance holds past distances only (Transformer-XL): pass "
                             f"causal=True (or a window with right=0), or max_distance=M with r of 2M + 1 rows")
    else:
        if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
            raise ValueError(f"{fn}: max_distance must be an int >= 0, got {max_distance!r}")
        if r.shape[1] != 2 * max_distance + 1:
            raise ValueError(f"{fn}: with max_distance={max_distance}, r must hold 2 * max_distance + 1 = "
                             f"{2 * max_distance + 1} distances (-M..M), got n_dist={r.shape[1]}")


def relative_attention(q: Tensor, k: Tensor, v: Tensor, r: Tensor, *, query: Optional[Tensor] = None,
                       max_distance: Optional[int] = None, causal: bool = False, window=None,
                       key_padding_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                       dropout_p: float = 0.0, return_lse: bool = False, backend: str = "auto"):
    r"""Softmax attention with relative-position keys: ``s_ij = scale (q_i . k_j + query_i . r[h, idx(d_ij)])``.

    Args:
        q: ``(B, H, Lq, D)``; k ``(B, Hkv, Lk, D)``; v ``(B, Hkv, Lk, Dv)`` (``H % Hkv == 0``).
        r: ``(H, n_dist, D)`` relative keys (see the module docstring for the index).
        query: ``(B, H, Lq, D)`` query of the position term; default ``q``.
        max_distance: None (r holds past distances ``0..n_dist-1``, needs causal) or M (``n_dist = 2M+1``).
        causal, window, key_padding_mask, scale, dropout_p, return_lse: as :func:`effattn.attention`.
        backend: ``"auto"``, ``"triton"`` (fused forward and backward, see `effattn/backends/triton/relative/`),
            ``"cuda"`` (fused forward and backward; gradients up to head dim 128) or ``"torch"``; `explain_relative` says which runs.

    Every input receives its gradient (r and query included). Torch path, not fused (module docstring).

    Returns:
        ``out (B, H, Lq, Dv)``, or ``(out, lse)`` with ``return_lse=True``.
    """
    call = make_relative_call(q, k, v, r, query=query, max_distance=max_distance, causal=causal, window=window,
                              key_padding_mask=key_padding_mask, scale=scale, dropout_p=dropout_p,
                              return_lse=return_lse, backend=backend)
    out, lse = base.select(FN, call, backend).run(call)
    out = out.to(q.dtype)
    return (out, lse.to(torch.float32) if lse.dtype == torch.float32 else lse) if return_lse else out


@dataclass(frozen=True)
class RelativeCall:
    """One `relative_attention` call, checked once; the rows of op ``"relative_attention"`` read it.
    ``attn`` is the `AttnCall` of the shared part (window, scale, key padding), built without dropout."""
    q: Tensor
    k: Tensor
    v: Tensor
    r: Tensor
    query: Tensor                      # q when not given
    max_distance: Optional[int]
    attn: Any
    dropout_p: float

    def features(self) -> frozenset:
        f = self.attn.features() & base.FEATURES[FN]
        return f | {"dropout"} if self.dropout_p > 0 else f


def make_relative_call(q: Tensor, k: Tensor, v: Tensor, r: Tensor, *, query: Optional[Tensor] = None,
                       max_distance: Optional[int] = None, causal: bool = False, window=None,
                       key_padding_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                       dropout_p: float = 0.0, return_lse: bool = False, backend: str = "auto") -> RelativeCall:
    """Checks `relative_attention`'s arguments (errors name the argument) and builds its call."""
    attn = make_attn_call(q, k, v, causal=causal, window=window, key_padding_mask=key_padding_mask, scale=scale,
                          dropout_p=0.0, return_lse=return_lse)            # the shared checks
    check_relative(q, r, query, max_distance, causal, window)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{FN}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if backend not in ("auto",) + tuple(base.BACKENDS):
        names = ", ".join(repr(n) for n in ("auto",) + tuple(base.BACKENDS))
        raise ValueError(f"{FN}: backend must be one of {names}, got {backend!r}")
    return RelativeCall(q, k, v, r, q if query is None else query, max_distance, attn, float(dropout_p))


def torch_relative(call: RelativeCall):
    """The ``torch/relative`` row: with dropout the dense scores under autograd, otherwise blocks of
    query rows with a recomputing backward; ``(out, lse)``."""
    a = call.attn
    if call.dropout_p > 0:
        return _dense(call.q, call.k, call.v, call.r, call.query, call.max_distance, a, call.dropout_p)
    return _Relative.apply(call.q, call.k, call.v, call.r, call.query, call.max_distance, a.window_left,
                           a.window_right, a.key_padding_mask, a.scale)


def _dense(q, k, v, r, query, max_distance, call, dropout_p):
    """The whole ``(B, H, Lq, Lk)`` score matrix under autograd: the path with dropout."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dt = compute_dtype(q.dtype)
    kk = k.to(dt).repeat_interleave(H // Hkv, dim=1)
    vv = v.to(dt).repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(q.to(dt), kk.transpose(-1, -2)) + relative_scores(query.to(dt), r.to(dt), Lk, max_distance)
    s = s * call.scale
    mask = Rule(Lq, Lk, call.window_left, call.window_right).materialize(key_padding_mask=call.key_padding_mask,
                                                                          device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p, lse = softmax_lse(s, dim=-1)
    return torch.matmul(F.dropout(p, dropout_p), vv), lse


# Elements of one (B, H, rows, max(Lk, n_dist)) block: the row chunk of the memory-bounded path.
SCORE_BUDGET = 1 << 22


def _row_chunks(B: int, H: int, Lq: int, width: int):
    rows = max(1, SCORE_BUDGET // max(1, B * H * width))
    return [(i0, min(i0 + rows, Lq)) for i0 in range(0, Lq, rows)]


def _distance_of_row(n: int, max_distance: Optional[int]) -> Tensor:
    """The distance each row m of r stands for (the clamped ends stand for all beyond)."""
    return torch.arange(n) - (0 if max_distance is None else max_distance)


def _band_sums(dT: Tensor, i0: int, Lq: int, n: int, max_distance: Optional[int]) -> Tensor:
    """``g[..., i, m] = sum over keys j with idx(d_ij) = m of dT[..., i, j]`` for the rows
    ``i0 ..`` of ``dT (B, H, rows, Lk)``: the gradient of the position term's ``query . r`` products.
    Interior rows of r are one key per query row (a gather); the two clamped ends are a prefix and a
    suffix sum over the keys (cumsum): no scatter, deterministic on every device."""
    B, H, rows, Lk = dT.shape
    dev = dT.device
    pos = torch.arange(i0, i0 + rows, device=dev)[:, None] + (Lk - Lq)            # (rows, 1)
    dist = _distance_of_row(n, max_distance).to(dev)[None, :]                      # (1, n)
    if n == 1:
        return dT.sum(-1, keepdim=True)
    j = pos - dist                                                                 # the key at distance d(m)
    inside = (j >= 0) & (j < Lk)
    g = torch.where(inside, dT.gather(-1, j.clamp(0, Lk - 1).expand(B, H, rows, n)), torch.zeros((), dtype=dT.dtype,
                                                                                                   device=dev))
    pre = F.pad(dT.cumsum(-1), (1, 0))                                             # pre[x] = sum_{j < x}

    def before(x):                                                                 # sum over keys j < x
        return pre.gather(-1, x.clamp(0, Lk).expand(B, H, rows, 1)).squeeze(-1)

    total = pre[..., -1]
    near, far = pos[:, 0] - dist[0, 0], pos[:, 0] - dist[0, -1]                   # j of the two ends
    g[..., 0] = total - before(near[:, None])                                       # j >= near (d <= d(0))
    g[..., -1] = before(far[:, None] + 1)                                           # j <= far (d >= d(n-1))
    return g


def fold_distances(gd: Tensor, Lq: int, n_dist: int, max_distance: Optional[int]) -> Tensor:
    """``dr (H, n_dist, D)`` from per-distance sums ``gd (H, Lq + Lk - 1, D)`` (distances ``1 - Lq ..
    Lk - 1``): interior rows take their one distance, the clamped end rows the sum of theirs."""
    d = torch.arange(gd.shape[1], device=gd.device) + (1 - Lq)
    idx = d.clamp(0, n_dist - 1) if max_distance is None else d.clamp(-max_distance, max_distance) + max_distance
    dr = gd.new_zeros(gd.shape[0], n_dist, gd.shape[2])
    dr[:, 0] = gd[:, idx == 0].sum(1)
    if n_dist > 1:
        dr[:, n_dist - 1] = gd[:, idx == n_dist - 1].sum(1)
        inner = (idx > 0) & (idx < n_dist - 1)
        dr[:, idx[inner]] = gd[:, inner]
    return dr


def stash(ctx, q, k, v, r, query, out, lse, *args):
    """Keeps what the backward of a relative-keys forward needs; returns ``(out, lse)``."""
    ctx.save_for_backward(q, k, v, r, query, out, lse)
    ctx.args = args                                    # max_distance, left, right, key_padding_mask, scale
    return out, lse


def stashed(ctx):
    """``q, k, v, r, query, out, lse, max_distance, left, right, key_padding_mask, scale`` of `stash`."""
    return tuple(ctx.saved_tensors) + tuple(ctx.args)


class _Relative(torch.autograd.Function):
    """Relative attention a block of query rows at a time: forward keeps ``out`` and ``lse``, backward
    recomputes each block's probabilities (FlashAttention-2, Alg. 2), so the extra memory is one
    ``(B, H, rows, max(Lk, n_dist))`` block, never ``(Lq, Lk)``."""

    @staticmethod
    def _blocks(q, kk, r, query, M, left, right, kpm, scale):
        B, H, Lq, D = q.shape
        Lk, n = kk.shape[2], r.shape[1]
        rule = Rule(Lq, Lk, left, right)
        for i0, i1 in _row_chunks(B, H, Lq, max(Lk, n)):
            qr = torch.matmul(query[:, :, i0:i1], r.transpose(-1, -2).unsqueeze(0))           # (B, H, rows, n)
            idx = relative_index(Lq, Lk, n, M, q.device)[i0:i1]
            s = (torch.matmul(q[:, :, i0:i1], kk.transpose(-1, -2)) + qr.gather(-1, idx.expand(B, H, i1 - i0, Lk)))
            s = s * scale
            mask = rule.materialize((i0, i1), key_padding_mask=kpm, device=q.device)
            if mask is not None:
                s = s.masked_fill(~mask, -math.inf)
            yield i0, i1, s

    @staticmethod
    def forward(ctx, q, k, v, r, query, M, left, right, kpm, scale):
        B, H, Lq, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[3]
        dt = compute_dtype(q.dtype)
        qc, rc, queryc = q.to(dt), r.to(dt), query.to(dt)
        kk = k.to(dt).repeat_interleave(H // Hkv, dim=1)
        vv = v.to(dt).repeat_interleave(H // Hkv, dim=1)
        out = torch.zeros(B, H, Lq, Dv, dtype=dt, device=q.device)
        lse = torch.full((B, H, Lq), -math.inf, dtype=dt, device=q.device)
        for i0, i1, s in _Relative._blocks(qc, kk, rc, queryc, M, left, right, kpm, scale):
            p, lse[:, :, i0:i1] = softmax_lse(s, dim=-1)
            out[:, :, i0:i1] = torch.matmul(p, vv)
        return stash(ctx, q, k, v, r, query, out, lse, M, left, right, kpm, scale)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, r, query, out, lse, M, left, right, kpm, scale = stashed(ctx)
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        dt = out.dtype
        qc, rc, queryc = q.to(dt), r.to(dt), query.to(dt)
        kk = k.to(dt).repeat_interleave(H // Hkv, dim=1)
        vv = v.to(dt).repeat_interleave(H // Hkv, dim=1)
        dout = torch.zeros_like(out) if dout is None else dout.to(dt)
        delta = (dout * out).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(dt)
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq, dquery = torch.zeros_like(qc), torch.zeros_like(queryc)
        dk, dv, dr = torch.zeros_like(kk), torch.zeros_like(vv), torch.zeros_like(rc)
        for i0, i1, s in _Relative._blocks(qc, kk, rc, queryc, M, left, right, kpm, scale):
            p = torch.exp(s - lse_safe[:, :, i0:i1, None])                   # 0 where masked
            do = dout[:, :, i0:i1]
            dv += torch.matmul(p.transpose(-1, -2), do)
            dT = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta[:, :, i0:i1, None]) * scale
            dq[:, :, i0:i1] = torch.matmul(dT, kk)
            dk += torch.matmul(dT.transpose(-1, -2), qc[:, :, i0:i1])
            g = _band_sums(dT, i0, Lq, r.shape[1], M)                         # (B, H, rows, n)
            dquery[:, :, i0:i1] = torch.matmul(g, rc)
            dr += torch.einsum("bhim,bhid->hmd", g, queryc[:, :, i0:i1])
        G = H // Hkv
        dk = dk.view(B, Hkv, G, Lk, -1).sum(2)
        dv = dv.view(B, Hkv, G, Lk, -1).sum(2)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dr.to(r.dtype), dquery.to(query.dtype),
                None, None, None, None, None)


def explain_relative(q: Optional[Tensor] = None, dropout_p: float = 0.0, backend: str = "auto") -> str:
    """The text of `effattn.explain` for a `relative_attention` call with queries like ``q`` (keys and
    values shaped alike, past distances): its rows with their reasons (all paths when None)."""
    if q is None:
        return "effattn.relative_attention: " + UNFUSED_NOTE
    r = q.new_zeros(q.shape[1], 1, q.shape[-1])
    return str(explain_call(FN, make_relative_call(q, q, q, r, causal=True, dropout_p=dropout_p, backend=backend)))


def _explain_call(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> RelativeCall:
    if "r" not in kwargs:
        raise TypeError(f"explain(op={FN!r}): needs r= (the relative keys)")
    return make_relative_call(q, k, v, kwargs.pop("r"), **kwargs)


base.CALL_MAKERS[FN] = _explain_call
