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

Storage: keys and values live in preallocated ``(B, H, capacity, D)`` buffers; a step writes its
keys in place at each batch row's length (no ``torch.cat`` of the whole cache), and the attention
reads a view of the written slots. Rows may hold different numbers of keys (``lengths``, a tensor):
the slots past a row's length are masked.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

_MIN_CAPACITY = 64


class KVCache:
    """Keys/values (softmax attention) or running sums (linear attention) of the positions seen so far.

    Args:
        capacity: slots per batch row. None (default): grown geometrically (doubled) when a step
            does not fit, each growth one copy of the cache. An int fixes it: the buffers are
            allocated once, a step that does not fit raises a ValueError, and a single-token step
            reads the whole buffer with the unused slots masked, so its shapes never change: the
            step can be captured in a CUDA graph (below).

    Attributes:
        keys: ``(B, H, Lc, D)`` view of the cached keys (the written slots), or ``None`` before the
            first step (softmax modules).
        values: ``(B, H, Lc, Dv)`` view of the cached values, or ``None``.
        key_padding_mask: bool ``(B, Lc)`` view, True = padding, or ``None`` when no step had padding.
        lengths: int64 ``(B,)`` on the cache's device: row b's keys fill slots ``[0, lengths[b])``.
            A step whose ``key_padding_mask`` pads the end of a row (a right-padded, ragged prompt)
            does not count those keys: the row's next step overwrites them. Padding elsewhere (left
            padding) stays in the cache, masked.
        state: ``(S (B, H, F, Dv), z (B, H, F))`` of :func:`effattn.linear_attention` (linear modules).
        seen: number of positions processed so far by eager steps (not reduced by trimming).

    A module with a finite left window (``window=w`` with ``is_causal=True``, or ``window=(w, r)``)
    keeps only the last ``w`` keys after each step in a growing cache: later queries cannot see older
    ones, so decoding with a sliding window needs ``O(w)`` memory (the buffer is compacted, one copy of
    ``w`` keys, when it fills). A fixed-capacity cache keeps every key and masks the window instead.

    Rows of different lengths: a single-token step is exact for each row (each query sits after its
    row's keys; the window is applied per row, through the mask); a multi-token step needs every row
    at the same length (it reads the lengths once, a host sync, and raises otherwise).

    CUDA graphs: with a fixed ``capacity``, a single-token step writes at the device-side lengths,
    advances them in place, and builds its mask from them: no host sync, no allocation whose size
    depends on values, the same shapes every step. Prefill (eagerly) first, warm up one step outside
    the capture, then capture one step in ``torch.cuda.CUDAGraph`` with static input tensors and
    replay it per token. A replay advances only the device state (``lengths``, the buffers): ``seen``
    and the host-side views (``keys``, ``len(cache)``) count eager steps only.

    The cached tensors keep no autograd history: decode under ``torch.no_grad()``. For training
    over segments with a fixed-size context, use the module's ``memory=`` argument instead
    (Transformer-XL: the previous segment is attended to but receives no gradient).
    """

    def __init__(self, capacity: Optional[int] = None):
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"KVCache: capacity must be a positive int or None, got {capacity!r}")
        self.capacity: Optional[int] = capacity
        self.state: Optional[Tuple[Tensor, Tensor]] = None
        self.seen: int = 0
        self.lengths: Optional[Tensor] = None
        self._k: Optional[Tensor] = None     # (B, H, cap, D) buffers
        self._v: Optional[Tensor] = None
        self._pad: Optional[Tensor] = None   # bool (B, cap), allocated at the first step with padding
        self._start = 0                      # slots before it were dropped by a window (growing cache)
        self._end = 0                        # host bound: every row's length <= _end (equal when not _ragged)
        self._ragged = False                 # rows may differ in length (a step had a padding mask)
        self._refresh()

    def _refresh(self) -> None:
        """The caller's views (``keys``, ``values``, ``key_padding_mask``) of the written slots."""
        span = slice(self._start, self._end)
        self.keys = None if self._k is None else self._k[:, :, span]
        self.values = None if self._v is None else self._v[:, :, span]
        self.key_padding_mask = None if self._pad is None else self._pad[:, span]

    def copy(self) -> "KVCache":
        """An independent copy (its own buffers): ``explain`` runs a step on one."""
        new = KVCache.__new__(KVCache)
        new.__dict__.update({n: (t.clone() if isinstance(t, Tensor) else t) for n, t in self.__dict__.items()})
        new.state = None if self.state is None else tuple(t.clone() for t in self.state)
        new._refresh()
        return new

    # ---- what the caller sees ------------------------------------------------------------------

    def __len__(self) -> int:
        """Slots held (softmax modules; rows may use fewer, see ``lengths``), 0 when empty or for
        linear state."""
        return 0 if self._k is None else self._end - self._start

    def __repr__(self) -> str:
        held = f"keys={tuple(self.keys.shape)}" if self._k is not None else (
            "state=(S, z)" if self.state is not None else "empty")
        cap = f", capacity={self.capacity}" if self.capacity is not None else ""
        return f"KVCache({held}, seen={self.seen}{cap})"

    def reset(self) -> None:
        """Forgets everything (a new sequence); a fixed capacity stays."""
        self.__init__(self.capacity)

    @torch.no_grad()
    def reorder(self, batch_index: Tensor) -> None:
        """Keeps/reorders batch entries, e.g. the surviving hypotheses of a beam search:
        every cached tensor becomes ``t[batch_index]``. When the batch size stays the same the
        buffers are rewritten in place (a captured CUDA graph keeps working)."""
        def pick(t):
            if t is None:
                return None
            new = t.index_select(0, batch_index.to(t.device))
            if new.shape == t.shape:
                t.copy_(new)
                return t
            return new
        self._k, self._v, self._pad, self.lengths = (pick(t) for t in (self._k, self._v, self._pad, self.lengths))
        if self.state is not None:
            self.state = tuple(t.index_select(0, batch_index.to(t.device)) for t in self.state)
        self._refresh()

    # ---- used by the attention modules -------------------------------------------------------

    def append(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]):
        """Adds a step's keys ``(B, H, L, D)`` / values and their padding ``(B, L)`` (or None);
        returns ``(keys, values, key_padding_mask)`` for the attention call (`write` with no window)."""
        return self.write(k, v, key_padding_mask)[:3]

    def write(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], left: int = -1):
        """Writes a step's keys ``(B, H, L, D)``, values ``(B, H, L, Dv)`` and padding ``(B, L)`` (or
        None) at each row's length and returns ``(keys, values, key_padding_mask, window_masked)``,
        what the step's attention call reads. ``left``: the module's left window (-1: none). With
        ``window_masked`` True the mask already applies the window per row (rows of different
        lengths, or a fixed capacity's whole buffer): the call must then pass no window.

        The buffers are written in place without autograd history; when this step's keys or values
        require grad, the returned keys / values are an out-of-place copy holding them, so that the
        gradient reaches this step's projections (not the cached ones)."""
        if self.state is not None:
            raise ValueError("KVCache: this cache holds a linear-attention state; use one cache per module")
        B, H, L, D = k.shape
        if self._k is None:
            self._allocate(k, v, self.capacity if self.capacity is not None else max(L, _MIN_CAPACITY))
        elif (self._k.shape[0], self._k.shape[1], self._k.shape[3], self._v.shape[3]) != (B, H, D, v.shape[3]):
            raise ValueError(f"KVCache: cached keys have shape {tuple(self.keys.shape)} (B, H, L, D) but this "
                             f"step's keys have {tuple(k.shape)}; use one cache per module and sequence batch")
        if L > 1 and (self._ragged or self.capacity is not None):
            self._settle()                       # host sync: multi-token steps need equal lengths
        self._make_room(L)
        slots = self.lengths[:, None] + torch.arange(L, device=self.lengths.device)        # (B, L)
        idx_k = slots[:, None, :, None].expand(B, H, L, D)
        idx_v = slots[:, None, :, None].expand(B, H, L, v.shape[3])
        k, v = k.to(self._k.dtype), v.to(self._v.dtype)
        with torch.no_grad():
            self._write(idx_k, idx_v, slots, k, v, key_padding_mask)
        keys, values = self._k, self._v
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            keys, values = self._k.scatter(2, idx_k, k), self._v.scatter(2, idx_v, v)
        self._end += L
        self._refresh()
        fixed_view = self.capacity is not None and L == 1
        if fixed_view or (self._ragged and L == 1):
            return self._masked_view(keys, values, fixed_view, left) + (True,)
        return keys[:, :, self._start:self._end], values[:, :, self._start:self._end], self.key_padding_mask, False

    def _write(self, idx_k, idx_v, slots, k, v, key_padding_mask) -> None:
        B, L = slots.shape
        self._k.scatter_(2, idx_k, k)
        self._v.scatter_(2, idx_v, v)
        if key_padding_mask is not None and self._pad is None:
            self._pad = torch.zeros(self._k.shape[0], self._k.shape[2], dtype=torch.bool, device=self._k.device)
        if self._pad is not None:
            step_pad = key_padding_mask if key_padding_mask is not None else torch.zeros(
                B, L, dtype=torch.bool, device=self._pad.device)
            self._pad.scatter_(1, slots, step_pad.to(self._pad.device))
        if key_padding_mask is None:
            self.lengths += L
        else:
            # trailing padding is not kept: the row's length ends after its last real key
            real = (~key_padding_mask).to(self.lengths.device)
            last = (torch.arange(1, L + 1, device=real.device) * real).amax(1)
            self.lengths += last
            self._ragged = True

    def keep_last(self, n: int) -> None:
        """Drops all but the last ``n`` keys of every row (a sliding window's rolling buffer) in a
        growing cache; a fixed capacity keeps its keys (the window is masked)."""
        if self._k is None or self.capacity is not None or self._end - self._start <= n:
            return
        shortest = self._end
        if self._ragged:
            shortest = int(self.lengths.min())       # host sync, only for rows of different lengths
        self._start = max(self._start, min(self._end, shortest) - max(n, 0))
        self._refresh()

    # ---- internals ----------------------------------------------------------------------------

    def _allocate(self, k: Tensor, v: Tensor, cap: int) -> None:
        B, H, _, D = k.shape
        self._k = k.new_zeros(B, H, cap, D)
        self._v = k.new_zeros(B, H, cap, v.shape[3])
        self.lengths = torch.zeros(B, dtype=torch.int64, device=k.device)

    def _make_room(self, L: int) -> None:
        """Room for L more slots after ``_end``: a fixed capacity raises; a growing one first
        compacts (drops the slots before ``_start``), then doubles."""
        cap = self._k.shape[2]
        if self._end + L <= cap:
            return
        if self.capacity is not None:
            raise ValueError(f"KVCache: a step of {L} keys does not fit: {self._end} of capacity={self.capacity} "
                             "slots are written; use a larger capacity, or capacity=None to grow")
        keep = self._end - self._start
        new_cap = cap if keep + L <= cap // 2 else max(2 * cap, keep + L)
        for name in ("_k", "_v", "_pad"):
            t = getattr(self, name)
            if t is None:
                continue
            dim = t.dim() - 2 if t.dim() == 4 else 1
            new = t.new_zeros(*t.shape[:dim], new_cap, *t.shape[dim + 1:])
            new.narrow(dim, 0, keep).copy_(t.narrow(dim, self._start, keep))
            setattr(self, name, new)
        self.lengths -= self._start
        self._end, self._start = keep, 0

    def _settle(self) -> None:
        """Reads the lengths (a host sync) before a multi-token step: they must be equal, and the
        host bound becomes exact."""
        lens = self.lengths.tolist()
        if lens and min(lens) != max(lens):
            raise ValueError(f"KVCache: rows hold different numbers of keys ({lens}); a step of several tokens "
                             "needs them equal: feed one token per step")
        self._end, self._ragged = (lens[0] if lens else self._end), False
        self._refresh()

    def _masked_view(self, keys: Tensor, values: Tensor, whole: bool, left: int):
        """keys, values and a mask that hides the slots past each row's length and, for the row's one
        query at slot ``lengths - 1``, the keys before its window: the whole buffer (fixed capacity)
        or the written slots."""
        end = self._k.shape[2] if whole else self._end
        start = 0 if whole else self._start
        j = torch.arange(start, end, device=self.lengths.device)[None, :]
        hide = j >= self.lengths[:, None]
        if left >= 0:
            hide |= j < self.lengths[:, None] - 1 - left
        if self._pad is not None:
            hide |= self._pad[:, start:end]
        return keys[:, :, start:end], values[:, :, start:end], hide
