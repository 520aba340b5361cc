"""Which (query, key) pairs a benchmark variant lets through: the one place the benchmark spells out
SPEC.md's visibility rule, for the baselines that need an explicit mask (naive, SDPA, FlexAttention)
and for the exact pair count the FLOP helper uses.

    key j is visible to query i  iff  every given constraint allows it:
        causal:         j <= pos(i)
        window (l, r):  pos(i) - l <= j <= pos(i) + r
        layout:         layout.mask[h, i // bs, j // bs]
    with pos(i) = i + (Lk - Lq)   (bottom-right alignment, FlashAttention's convention)

An int window ``w`` means ``(w, 0)`` when causal and ``(w, w)`` otherwise, as in ``effattn.attention``.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch


def window_bounds(causal: bool, window) -> Tuple[Optional[int], Optional[int]]:
    """``(left, right)`` reach of a query in keys, ``None`` = unbounded; causal folds into right."""
    left = right = None
    if window is not None:
        if isinstance(window, int):
            left, right = (window, 0) if causal else (window, window)
        else:
            left, right = int(window[0]), int(window[1])
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def dense_mask(Lq: int, Lk: int, *, causal: bool = False, window=None, layout=None,
               device="cpu") -> Optional[torch.Tensor]:
    """bool ``(Hl, Lq, Lk)``, True = visible (Hl = 1, or the layout's head count); ``None`` when every
    pair is visible (dense attention needs no mask)."""
    left, right = window_bounds(causal, window)
    if left is None and right is None and layout is None:
        return None
    pos = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)             # (Lq, 1)
    key = torch.arange(Lk, device=device)[None, :]                          # (1, Lk)
    mask = torch.ones(1, Lq, Lk, dtype=torch.bool, device=device)
    if left is not None:
        mask &= key >= pos - left
    if right is not None:
        mask &= key <= pos + right
    if layout is not None:
        mask = mask & layout.to(device).to_dense(Lq, Lk)
    return mask


@functools.lru_cache(maxsize=64)     # the runner asks once per row; a 64k layout takes ~30 ms
def visible_pairs(Lq: int, Lk: int, *, causal: bool = False, window=None, layout=None,
                  heads: int = 1) -> int:
    """Exact number of visible (query, key) pairs summed over ``heads`` heads, without forming the
    ``Lq x Lk`` mask: O(Lq) work per layout head.

    Each query row sees the key interval ``[lo, hi]`` of the causal/window rule; with a layout, the
    visible keys of that interval are counted from per-block-row prefix sums of the allowed keys.
    """
    left, right = window_bounds(causal, window)
    pos = torch.arange(Lq, dtype=torch.int64) + (Lk - Lq)
    lo = torch.zeros_like(pos) if left is None else (pos - left).clamp(min=0)
    hi = torch.full_like(pos, Lk - 1) if right is None else (pos + right).clamp(max=Lk - 1)
    hi = torch.maximum(hi, lo - 1)                                          # empty row: hi = lo - 1
    if layout is None:
        return int((hi - lo + 1).sum()) * heads
    bs = layout.block_size
    m = layout.mask.to("cpu", torch.int64)                                  # (Hl, nqb, nkb)
    nkb = m.shape[2]
    width = (Lk - torch.arange(nkb, dtype=torch.int64) * bs).clamp(max=bs)  # keys per key block
    cum = torch.nn.functional.pad((m * width).cumsum(-1), (1, 0))           # (Hl, nqb, nkb + 1)
    qb = torch.arange(Lq, dtype=torch.int64) // bs

    def allowed_before(x):                                                  # visible keys j < x, x in [0, Lk]
        kb = (x // bs).clamp(max=nkb - 1)
        return cum[:, qb, kb] + m[:, qb, kb] * (x - kb * bs)                # (Hl, Lq)

    per_head = (allowed_before(hi + 1) - allowed_before(lo)).sum(-1)        # (Hl,)
    total = int(per_head.sum())
    return total * heads if m.shape[0] == 1 else total


def flex_mask_mod(Lq: int, Lk: int, *, causal: bool = False, window=None, layout=None, device="cpu"):
    """The same rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``, or ``None`` when
    every pair is visible."""
    left, right = window_bounds(causal, window)
    if left is None and right is None and layout is None:
        return None
    offset = Lk - Lq
    lay = layout.to(device).mask if layout is not None else None
    bs = layout.block_size if layout is not None else 1
    per_head = lay is not None and lay.shape[0] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        ok = kv_idx >= 0
        if left is not None:
            ok = ok & (kv_idx >= pos - left)
        if right is not None:
            ok = ok & (kv_idx <= pos + right)
        if lay is not None:
            ok = ok & lay[h if per_head else 0, q_idx // bs, kv_idx // bs]
        return ok

    return mask_mod
