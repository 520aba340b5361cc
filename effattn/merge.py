"""Merging partial attention results: ``effattn.merge_attention``.

Attention over a key set split into parts ``K = K_1 + ... + K_n`` is the softmax-weighted mean of
the parts' results: with each part's output ``o_r`` and log-sum-exp ``lse_r``,
``lse = log sum_r exp(lse_r)`` and ``o = sum_r exp(lse_r - lse) o_r``. This is the split-KV decode
combine, generalised: context parallelism merges the chunk pairs of a ring step, cascade attention a
shared prefix with per-request suffixes.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch
from torch import Tensor


def merge_attention(parts: Sequence[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    """Merges partial attention results over disjoint key sets into the result over their union.

    Args:
        parts: ``[(out_r (B, H, Lq, Dv), lse_r (B, H, Lq)), ...]``, e.g. from
            ``effattn.attention(..., return_lse=True, out_dtype=torch.float32)``. A part whose row saw
            no key has ``lse = -inf`` there and weighs nothing.

    Returns:
        ``(out, lse)``: out in float32 (float64 if any part is float64), lse in the lse dtype. Rows
        that no part saw give out 0 and lse ``-inf``. The parts are summed in the given order (the
        result is bitwise reproducible) and the merge is differentiable in every ``out_r`` and
        ``lse_r``.
    """
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError("merge_attention: parts must be a non-empty list of (out, lse) pairs")
    for n, p in enumerate(parts):
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(t, Tensor) for t in p)):
            raise TypeError(f"merge_attention: parts[{n}] must be an (out, lse) pair of tensors")
        out, lse = p
        if out.dim() != lse.dim() + 1 or out.shape[:-1] != lse.shape or out.shape != parts[0][0].shape:
            raise ValueError(f"merge_attention: parts[{n}] has out {tuple(out.shape)} and lse {tuple(lse.shape)}; "
                             f"expected out {tuple(parts[0][0].shape)} and lse = out's shape without the last dim")
        if not out.is_floating_point() or not lse.is_floating_point():
            raise TypeError(f"merge_attention: parts[{n}] must be floating tensors")
    dt = torch.float64 if any(o.dtype == torch.float64 or l.dtype == torch.float64 for o, l in parts) \
        else torch.float32
    lses = [l.to(dt) for _, l in parts]
    m = lses[0]
    for l in lses[1:]:
        m = torch.maximum(m, l)
    empty = torch.isinf(m) & (m < 0)
    m = torch.where(empty, torch.zeros_like(m), m).detach()      # rows no part saw: exp(-inf - 0) = 0
    total = torch.zeros_like(m)
    weights = []
    for l in lses:
        w = torch.exp(l - m)
        weights.append(w)
        total = total + w
    safe = torch.where(empty, torch.ones_like(total), total)
    out = torch.zeros(parts[0][0].shape, dtype=dt, device=parts[0][0].device)
    for (o, _), w in zip(parts, weights):
        out = out + (w / safe).unsqueeze(-1) * o.to(dt)
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(safe))
    return out, lse
