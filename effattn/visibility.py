"""Which key a query may see: the one home of effattn's visibility rule.

Every backend, the nn layers, the Hugging Face integration and the benchmarks read the rule from
here; only the test oracle (``effattn/testing/oracle.py``) writes it out again, on purpose, from the contract.

Positions are aligned **bottom-right** (FlashAttention's convention): with ``Lq`` queries and ``Lk``
keys, query i sits at absolute position ``pos(i) = i + offset``, ``offset = Lk - Lq``. Key j is
visible to query i when every given constraint allows it::

    window (left, right):  pos(i) - left <= j <= pos(i) + right    (-1 = unbounded on that side)
    causal:                right = 0 (folded into the window by `normalize_window`)
    layout (mask, bs):     mask[h, i // bs, j // bs]
    key padding:           not key_padding_mask[b, j]              (True = padding)

    Lq=2, Lk=4, causal:        Lq=4, Lk=2, causal:      Lq=Lk=5, window (1, 0):
    q0 (pos 2):  1 1 1 .       q0 (pos -2): . .         1 . . . .
    q1 (pos 3):  1 1 1 1       q1 (pos -1): . .         1 1 . . .
                               q2 (pos 0):  1 .         . 1 1 . .
                               q3 (pos 1):  1 1         . . 1 1 .
                                                        . . . 1 1

A `Rule` holds the numbers a kernel needs (lengths, ``left``/``right`` and the layout's block mask)
and answers the questions backends and benchmarks ask: the key range of a block of queries, the
token-level mask of any block (``materialize``), the exact number of visible pairs, and a
FlexAttention ``mask_mod`` computing the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

UNBOUNDED = -1


def normalize_window(window, causal: bool) -> Tuple[int, int]:
    """The public window convention -> ``(left, right)``, ``-1`` = unbounded, causal folded in.

    ``window`` is None, an int ``w`` (``(w, 0)`` when causal, ``(w, w)`` otherwise) or a
    ``(left, right)`` pair of non-negative ints; ``causal=True`` caps ``right`` at 0.
    """
    left, right = UNBOUNDED, UNBOUNDED
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, tuple, list)):
            raise TypeError(f"attention: window must be an int or a (left, right) pair of ints, got {window!r}")
        if isinstance(window, int):
            left, right = (window, 0) if causal else (window, window)
        else:
            if len(window) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
                raise TypeError(f"attention: window must be an int or a (left, right) pair of ints, got {window!r}")
            left, right = int(window[0]), int(window[1])
        if left < 0 or right < 0:
            raise ValueError(f"attention: window sizes must be non-negative, got window={window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def clamp_window(left: int, right: int, Lq: int, Lk: int, q_offset: Optional[int] = None) -> Tuple[int, int]:
    """A window wider than the sequence is no window: with query i at key ``i + off`` (``off = Lk - Lq``
    bottom-right, or ``q_offset``), ``left >= Lq - 1 + off`` (``Lk - 1`` bottom-right) reaches key 0
    from every query and ``right >= Lk - 1 - off`` (``Lq - 1``) reaches key ``Lk - 1``, so either
    becomes ``-1`` (unbounded). The kernels then need no bound on that side (and their int32 bounds
    never see a huge window). The one statement of this rule; the C++ binding checks that the windows
    it gets obey it."""
    off = Lk - Lq if q_offset is None else q_offset
    return ((UNBOUNDED if left >= max(Lq - 1 + off, 0) else left),
            (UNBOUNDED if right >= max(Lk - 1 - off, 0) else right))


def seen_keys(mask: Tensor, Hkv: int) -> Tensor:
    """bool ``(B or 1, Hkv or 1, keys, 1)``: the keys some row of ``mask (B or 1, H or 1, rows, keys)``
    sees, per kv head. The others' K and V rows are zeroed before the products, so that whatever an
    ignored key holds (NaN, inf in padding) gives 0 * 0, never 0 * NaN."""
    seen = mask.any(-2)
    if seen.shape[1] > 1:
        seen = seen.reshape(seen.shape[0], Hkv, seen.shape[1] // Hkv, seen.shape[-1]).any(2)
    return seen[..., None]


@dataclass(frozen=True, eq=False)
class Rule:
    """The visibility rule of one call's shape (see the module docstring).

    Args:
        Lq, Lk: query and key lengths.
        left, right: window reach in keys, ``-1`` = unbounded (causal is ``right = 0``).
        layout_mask: bool ``(Hl, ceil(Lq/bs), ceil(Lk/bs))`` block mask, or None.
        layout_block: the layout's block size ``bs`` (ignored without a mask).
        q_offset: the key position of query 0, ``q_start - k_start`` of ``attention(positions=...)``;
            None (default) for bottom-right alignment, ``Lk - Lq``.
    """
    Lq: int
    Lk: int
    left: int = UNBOUNDED
    right: int = UNBOUNDED
    layout_mask: Optional[Tensor] = None
    layout_block: int = 0
    q_offset: Optional[int] = None        # pos(i) - i; None: Lk - Lq (bottom-right). Set by `positions`

    @classmethod
    def of(cls, Lq: int, Lk: int, *, causal: bool = False, window=None, layout=None) -> "Rule":
        """From the public arguments: ``causal``, ``window`` and a `BlockLayout` (or None)."""
        left, right = normalize_window(window, causal)
        if layout is None:
            return cls(Lq, Lk, left, right)
        return cls(Lq, Lk, left, right, layout.mask, layout.block_size)

    @property
    def offset(self) -> int:
        """``Lk - Lq`` (or ``q_offset`` when given): query i sits at key position ``i + offset``."""
        return self.Lk - self.Lq if self.q_offset is None else self.q_offset

    @property
    def kind(self) -> str:
        """``"layout"`` (a block layout, whatever the window), ``"window"`` (a left bound, or a right
        bound other than causal's 0), ``"causal"`` (``right = 0`` only) or ``"dense"``."""
        if self.layout_mask is not None:
            return "layout"
        if self.left >= 0 or self.right > 0:
            return "window"
        return "causal" if self.right == 0 else "dense"

    @property
    def has_window(self) -> bool:
        return self.left >= 0 or self.right >= 0

    @property
    def everything_visible(self) -> bool:
        """True when no constraint removes any pair (plain dense attention)."""
        return not self.has_window and self.layout_mask is None

    def first_key(self, i):
        """Smallest key query row(s) ``i`` may see under the window (``pos(i) - left``; may be
        negative), or None when unbounded on the left. ``i`` an int or an int tensor."""
        return None if self.left < 0 else i + self.offset - self.left

    def last_key(self, i):
        """Largest key query row(s) ``i`` may see under the window / causal bound (``pos(i) + right``;
        may pass ``Lk - 1``), or None when unbounded on the right."""
        return None if self.right < 0 else i + self.offset + self.right

    def key_range(self, i0: int, i1: int) -> Tuple[int, int]:
        """Keys ``[k0, k1)`` that some query in rows ``[i0, i1)`` may see under the window / causal
        bounds (the layout is not consulted); ``k1 <= k0`` when none."""
        lo, hi = self.first_key(i0), self.last_key(i1 - 1)
        return (0 if lo is None else max(0, lo)), (self.Lk if hi is None else min(self.Lk, hi + 1))

    def materialize(self, rows: Optional[Tuple[int, int]] = None, keys: Optional[Tensor] = None, *,
                    key_padding_mask: Optional[Tensor] = None, device=None) -> Optional[Tensor]:
        """Token-level mask, True = visible: bool ``(B or 1, Hl or 1, n_rows, n_keys)``, or None when
        every pair is visible.

        Args:
            rows: query rows ``(i0, i1)``; all rows by default.
            keys: int64 positions of the keys (any order, e.g. a gathered set of blocks); all keys
                by default.
            key_padding_mask: bool ``(B, Lk)``, True = padding.
            device: where to build it; the layout mask's device by default.
        """
        if device is None:
            device = keys.device if keys is not None else (
                self.layout_mask.device if self.layout_mask is not None else "cpu")
        i0, i1 = rows if rows is not None else (0, self.Lq)
        key = torch.arange(self.Lk, device=device) if keys is None else keys
        mask = None
        if self.has_window:
            rows_i = torch.arange(i0, i1, device=device)[:, None]
            lo, hi = self.first_key(rows_i), self.last_key(rows_i)
            if lo is not None:
                mask = key[None, :] >= lo
            if hi is not None:
                m = key[None, :] <= hi
                mask = m if mask is None else mask & m
            mask = mask[None, None]
        if self.layout_mask is not None:
            bs = self.layout_block
            lay = self.layout_mask.to(device)
            qb = torch.arange(i0, i1, device=device) // bs
            m = lay[:, qb][:, :, key // bs][None]                             # (1, Hl, rows, keys)
            mask = m if mask is None else mask & m
        if key_padding_mask is not None:
            m = ~key_padding_mask.to(device)[:, key][:, None, None, :]         # (B, 1, 1, keys)
            mask = m if mask is None else mask & m
        return mask

    def visible_pairs(self, heads: int = 1) -> int:
        """Exact number of visible (query, key) pairs over ``heads`` heads, in O(Lq) work per layout
        head (no ``Lq x Lk`` mask): each row's window interval, then with a layout the allowed keys of
        that interval counted from per-block-row prefix sums. A per-head layout sums its own heads."""
        i = torch.arange(self.Lq, dtype=torch.int64)
        first, last = self.first_key(i), self.last_key(i)
        lo = torch.zeros_like(i) if first is None else first.clamp(min=0)
        hi = torch.full_like(i, self.Lk - 1) if last is None else last.clamp(max=self.Lk - 1)
        hi = torch.maximum(hi, lo - 1)                                          # empty row: hi = lo - 1
        if self.layout_mask is None:
            return int((hi - lo + 1).sum()) * heads
        bs = self.layout_block
        m = self.layout_mask.to("cpu", torch.int64)                            # (Hl, nqb, nkb)
        nkb = m.shape[2]
        width = (self.Lk - torch.arange(nkb, dtype=torch.int64) * bs).clamp(max=bs)  # keys per key block
        cum = torch.nn.functional.pad((m * width).cumsum(-1), (1, 0))           # (Hl, nqb, nkb + 1)
        qb = torch.arange(self.Lq, dtype=torch.int64) // bs

        def allowed_before(x):                                                  # visible keys j < x
            kb = (x // bs).clamp(max=nkb - 1)
            return cum[:, qb, kb] + m[:, qb, kb] * (x - kb * bs)                # (Hl, Lq)

        total = int((allowed_before(hi + 1) - allowed_before(lo)).sum())
        return total * heads if m.shape[0] == 1 else total

    def mask_mod(self, device=None) -> Optional[Callable]:
        """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``, or None when every
        pair is visible. Key padding is per batch and left to the caller."""
        if self.everything_visible:
            return None
        bs = max(self.layout_block, 1)
        lay = self.layout_mask.to(device) if self.layout_mask is not None else None
        per_head = lay is not None and lay.shape[0] > 1

        def mask_mod(b, h, q_idx, kv_idx):
            lo, hi = self.first_key(q_idx), self.last_key(q_idx)
            ok = kv_idx >= 0
            if lo is not None:
                ok = ok & (kv_idx >= lo)
            if hi is not None:
                ok = ok & (kv_idx <= hi)
            if lay is not None:
                ok = ok & lay[h if per_head else 0, q_idx // bs, kv_idx // bs]
            return ok

        return mask_mod
