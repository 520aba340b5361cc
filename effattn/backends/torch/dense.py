"""Dense softmax attention over the materialized ``(Lq, Lk)`` score matrix: O(Lq*Lk) memory.

The general path for what the fused kernels cannot express (an additive float mask, attention
weights returned to the caller, extra bias keys, score soft-capping): `effattn.nn.MultiheadAttention`
takes it for those calls (saying so in ``last_path`` and ``explain``), and so does the Hugging Face
integration. It lives with the torch backend because it is torch reference math, not a layer.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def dense_attention(q: Tensor, k: Tensor, v: Tensor, *, visible: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, scale: Optional[float] = None, dropout_p: float = 0.0,
                    softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention over the materialized ``(Lq, Lk)`` scores: the slow, general path.

    Args:
        q: ``(B, H, Lq, D)``; k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)``, ``H % Hkv == 0``.
        visible: bool, broadcastable to ``(B, H, Lq, Lk)``, True = may attend.
        bias: float, broadcastable to ``(B, H, Lq, Lk)``, added to the scores (``-inf`` = masked).
        scale: default ``1/sqrt(D)``.
        softcap: ``tanh(s / softcap) * softcap`` on the scaled scores before bias (Gemma 2).

    Computes in float32 (float64 for float64 inputs). A row with no visible key gives output 0 and
    weights 0 (torch's MultiheadAttention gives NaN there).

    Returns:
        ``out (B, H, Lq, Dv)`` in q's dtype, ``weights (B, H, Lq, Lk)`` in the compute dtype (after
        dropout, as torch returns them).
    """
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.to(cdt).reshape(B, Hkv, G * Lq, D)                # query heads of one kv head side by side
    s = torch.matmul(qg, k.to(cdt).transpose(-1, -2)).view(B, H, Lq, Lk) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(cdt)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # rows of -inf only: exp(-inf) = 0
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    if dropout_p > 0:
        p = F.dropout(p, p=dropout_p, training=True)
    out = torch.matmul(p.reshape(B, Hkv, G * Lq, Lk), v.to(cdt)).view(B, H, Lq, Dv)
    return out.to(q.dtype), p
