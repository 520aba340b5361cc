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

The position term is ``(query @ r^T)`` of shape ``(B, H, Lq, n_dist)`` read through a skewed gather
(the "relative shift", without Transformer-XL's pad-and-reshape). This module's path is an
**unfused torch reference**: it materializes the ``(B, H, Lq, Lk)`` scores (O(L^2) memory) and
differentiates with autograd; no fused kernel serves the term yet (`explain_relative` says so).
`relative_scores` is the piece a fused bias term can wrap.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._call import compute_dtype
from .visibility import normalize_window

FN = "relative_attention"
UNFUSED_NOTE = ("relative keys: unfused torch reference (dense (B, H, Lq, Lk) scores, O(L^2) memory, autograd); "
                "no fused kernel serves the position term yet")


def relative_index(Lq: int, Lk: int, n_dist: int, max_distance: Optional[int] = None, device=None) -> Tensor:
    """int64 ``(Lq, Lk)``: the row of ``r`` that query i reads for key j (see the module docstring)."""
    d = torch.arange(Lq, device=device)[:, None] + (Lk - Lq) - torch.arange(Lk, device=device)[None, :]
    if max_distance is None:
        return d.clamp(0, n_dist - 1)
    return d.clamp(-max_distance, max_distance) + max_distance


def relative_scores(query: Tensor, r: Tensor, Lk: int, max_distance: Optional[int] = None) -> Tensor:
    """``query_i . r[h, idx(d_ij)]`` for ``query (B, H, Lq, D)``, ``r (H, n_dist, D)``: ``(B, H, Lq, Lk)``
    (unscaled), computed as ``query @ r^T`` followed by a skewed gather."""
    B, H, Lq, _ = query.shape
    qr = torch.matmul(query, r.transpose(-1, -2).unsqueeze(0))                     # (B, H, Lq, n_dist)
    idx = relative_index(Lq, Lk, r.shape[1], max_distance, query.device)
    return qr.gather(-1, idx.expand(B, H, Lq, Lk))


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
                       dropout_p: float = 0.0, return_lse: bool = False):
    r"""Softmax attention with relative-position keys: ``s_ij = scale (q_i . k_j + query_i . r[h, idx(d_ij)])``.

    Args:
        q: ``(B, H, Lq, D)``; k ``(B, Hkv, Lk, D)``; v ``(B, Hkv, Lk, Dv)`` (``H % Hkv == 0``).
        r: ``(H, n_dist, D)`` relative keys (see the module docstring for the index).
        query: ``(B, H, Lq, D)`` query of the position term; default ``q``.
        max_distance: None (r holds past distances ``0..n_dist-1``, needs causal) or M (``n_dist = 2M+1``).
        causal, window, key_padding_mask, scale, dropout_p, return_lse: as :func:`effattn.attention`.

    Every input receives its gradient (r and query included). Unfused torch reference: O(L^2) memory.

    Returns:
        ``out (B, H, Lq, Dv)``, or ``(out, lse)`` with ``return_lse=True``.
    """
    from ._call import make_attn_call
    call = make_attn_call(q, k, v, causal=causal, window=window, key_padding_mask=key_padding_mask, scale=scale,
                          dropout_p=0.0, return_lse=return_lse)            # the shared checks
    check_relative(q, r, query, max_distance, causal, window)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{FN}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    from .lsh import softmax_lse
    from .visibility import Rule
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dt = compute_dtype(q.dtype)
    kk = k.to(dt).repeat_interleave(H // Hkv, dim=1)
    vv = v.to(dt).repeat_interleave(H // Hkv, dim=1)
    query = q if query is None else query
    s = torch.matmul(q.to(dt), kk.transpose(-1, -2)) + relative_scores(query.to(dt), r.to(dt), Lk, max_distance)
    s = s * call.scale
    mask = Rule(Lq, Lk, call.window_left, call.window_right).materialize(key_padding_mask=key_padding_mask,
                                                                          device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p, lse = softmax_lse(s, dim=-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    out = torch.matmul(p, vv).to(q.dtype)
    return (out, lse.to(torch.float32) if dt == torch.float32 else lse) if return_lse else out


def explain_relative() -> str:
    """Which path relative attention takes (one so far)."""
    return "effattn.relative_attention: " + UNFUSED_NOTE
