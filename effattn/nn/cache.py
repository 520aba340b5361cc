"""Decoding state of one attention module: `KVCache`.

A softmax module keeps the keys and values it has seen; a linear-attention module keeps its running
sums ``(S, z)`` instead (``O(1)`` in the sequence length). Either way the module fills the cache
itself when called with ``cache=``; the caller only creates one cache per attention module and
passes it at every step::

    caches = [KVCache() for _ in model.layers]
    for t in range(T):
        y = model(x[:, t:t + 1], is_causal=True, caches=caches)

Why this is exact: effattn aligns queries and keys **bottom-right** (query i of a call with ``Lq``
queries and ``Lk`` keys sits at position ``i + Lk - Lq``), so a step's queries sit after every cached
key and ``causal=True`` / ``window=`` mean the same as in one call over the whole sequence.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


class KVCache:
    """Keys/values (softmax attention) or running sums (linear attention) of the positions seen so far.

    Attributes:
        keys: ``(B, H, Lc, D)`` cached keys, or ``None`` before the first step (softmax modules).
        values: ``(B, H, Lc, Dv)`` cached values, or ``None``.
        key_padding_mask: bool ``(B, Lc)``, True = padding, or ``None`` when no step had padding.
        state: ``(S (B, H, F, Dv), z (B, H, F))`` of :func:`effattn.linear_attention` (linear modules).
        seen: number of positions processed so far (not reduced by trimming).

    A module with a finite left window (``window=w`` with ``is_causal=True``, or ``window=(w, r)``)
    keeps only the last ``w`` keys after each step: later queries cannot see older ones, so decoding
    with a sliding window needs ``O(w)`` memory.

    The cached tensors keep their autograd history: decode under ``torch.no_grad()``. For training
    over segments with a fixed-size context, use the module's ``memory=`` argument instead
    (Transformer-XL: the previous segment is attended to but receives no gradient).
    """

    def __init__(self):
        self.keys: Optional[Tensor] = None
        self.values: Optional[Tensor] = None
        self.key_padding_mask: Optional[Tensor] = None
        self.state: Optional[Tuple[Tensor, Tensor]] = None
        self.seen: int = 0

    def __len__(self) -> int:
        """Number of keys held (softmax modules), 0 when empty or for linear state."""
        return 0 if self.keys is None else self.keys.shape[2]

    def __repr__(self) -> str:
        held = f"keys={tuple(self.keys.shape)}" if self.keys is not None else (
            "state=(S, z)" if self.state is not None else "empty")
        return f"KVCache({held}, seen={self.seen})"

    def reset(self) -> None:
        """Forgets everything (a new sequence)."""
        self.__init__()

    @torch.no_grad()
    def reorder(self, batch_index: Tensor) -> None:
        """Keeps/reorders batch entries, e.g. the surviving hypotheses of a beam search:
        every cached tensor becomes ``t[batch_index]``."""
        if self.keys is not None:
            self.keys = self.keys.index_select(0, batch_index.to(self.keys.device))
            self.values = self.values.index_select(0, batch_index.to(self.values.device))
        if self.key_padding_mask is not None:
            self.key_padding_mask = self.key_padding_mask.index_select(0, batch_index.to(self.key_padding_mask.device))
        if self.state is not None:
            self.state = tuple(t.index_select(0, batch_index.to(t.device)) for t in self.state)

    # ---- used by the attention modules -------------------------------------------------------

    def append(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]):
        """Adds a step's keys ``(B, H, L, D)`` / values and their padding ``(B, L)`` (or None);
        returns all cached ``(keys, values, key_padding_mask)``."""
        if self.state is not None:
            raise ValueError("KVCache: this cache holds a linear-attention state; use one cache per module")
        if self.keys is None:
            self.keys, self.values = k, v
            self.key_padding_mask = key_padding_mask
        else:
            if self.keys.shape[0] != k.shape[0] or self.keys.shape[1] != k.shape[1] or \
                    self.keys.shape[3] != k.shape[3]:
                raise ValueError(f"KVCache: cached keys have shape {tuple(self.keys.shape)} (B, H, L, D) but this "
                                 f"step's keys have {tuple(k.shape)}; use one cache per module and sequence batch")
            old = self.keys.shape[2]
            self.keys = torch.cat([self.keys, k.to(self.keys.dtype)], dim=2)
            self.values = torch.cat([self.values, v.to(self.values.dtype)], dim=2)
            if key_padding_mask is not None or self.key_padding_mask is not None:
                B = k.shape[0]
                prev = self.key_padding_mask if self.key_padding_mask is not None else \
                    torch.zeros(B, old, dtype=torch.bool, device=k.device)
                new = key_padding_mask if key_padding_mask is not None else \
                    torch.zeros(B, k.shape[2], dtype=torch.bool, device=k.device)
                self.key_padding_mask = torch.cat([prev, new], dim=1)
        return self.keys, self.values, self.key_padding_mask

    def keep_last(self, n: int) -> None:
        """Drops all but the last ``n`` keys (a sliding window's rolling buffer)."""
        if self.keys is not None and self.keys.shape[2] > n:
            self.keys = self.keys[:, :, -n:] if n > 0 else self.keys[:, :, :0]
            self.values = self.values[:, :, -n:] if n > 0 else self.values[:, :, :0]
            if self.key_padding_mask is not None:
                self.key_padding_mask = self.key_padding_mask[:, -n:] if n > 0 else self.key_padding_mask[:, :0]
