"""Packed variable-length sequences (``cu_seqlens``) and absolute chunk positions (``positions``).

A packed call concatenates N sequences along the length axis: ``q (1, H, Tq, D)``, ``k, v (1, Hkv,
Tk, D)``, with int32 ``cu_seqlens (N + 1,)`` marking where each starts (``cu[0] = 0``, ``cu[N] = T``).
Segment n is queries ``cu_q[n]:cu_q[n+1]`` against keys ``cu_k[n]:cu_k[n+1]``, aligned bottom-right
inside the segment; causal, window, GQA, dropout and the score terms (their distances) apply with
segment-local positions and no pair crosses a segment. ``positions=(q_start, k_start)`` places a plain call's queries and keys at
absolute positions (query i at ``q_start + i``, key j at ``k_start + j``), so a chunk pair of a longer
sequence (context parallelism, cascade attention) sees exactly what the whole sequence would; with
dropout the chunk also draws its keep-mask at those absolute rows and keys (torch, Triton, CUDA), so it
drops the pairs the whole sequence's call drops, and the score terms read the absolute distances.

Both become one thing a backend serves: a work list of segments ``(q0, q1, k0, k1, q_offset)``
(``q_offset`` = the key position of the segment's first query, relative to its first key). The torch
reference row walks it with its chunked reference, forward and backward, and the ``torch/cpu-segments``
row runs each segment of a packed CPU call on the CPU paths. The Triton kernels serve ``positions`` and ``out_fp32`` (one
segment: their offset is the segment's) and ``varlen`` through (segment, tile) work lists
(``launch.fwd_varlen``, ``launch.bwd(segments=...)``; with score terms the score kernels on the same
work lists), the CUDA kernels all three (``varlen`` through a
grid of (segment, tile) blocks sized by ``max_seqlen`` that read their bounds from ``cu_seqlens``).

Without ``max_seqlen`` a call reads ``cu_seqlens`` to the host once (validation, the work list and
the longest segments). Given ``max_seqlen``, nothing is read back: the values are checked on the
device (``torch._assert_async``) and the work list (`LazySegments`) is read only by the rows that build
host work lists (the torch rows, the Triton kernels); the CUDA kernels read the segments' bounds on the
device, so a packed CUDA call with ``max_seqlen`` never synchronizes with the host.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .visibility import UNBOUNDED, Rule, clamp_window


def _fail(kind, msg):
    raise kind(msg)


def _pair(x):
    """``(a, b)`` of a pair argument, or ``(x, x)``."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


def _check_cu_meta(cu, name: str, device, fn: str) -> None:
    """The checks of one ``cu_seqlens`` tensor that need no value of it: type, dtype, shape, device."""
    if not isinstance(cu, Tensor):
        _fail(TypeError, f"{fn}: {name} must be an int32 tensor of shape (N + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        _fail(TypeError, f"{fn}: {name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(ValueError, f"{fn}: {name} must be 1-D (N + 1,) with N >= 0 segments, got shape {tuple(cu.shape)}")
    if cu.device != device:
        _fail(ValueError, f"{fn}: {name} is on {cu.device}, q on {device}; it must be on q's device")


def _check_cu(cu, name: str, T: int, device, fn: str) -> List[int]:
    """The offsets of one ``cu_seqlens`` tensor as host ints, after checking it."""
    _check_cu_meta(cu, name, device, fn)
    offs = cu.tolist()
    if offs[0] != 0:
        _fail(ValueError, f"{fn}: {name}[0] must be 0, got {offs[0]}")
    bad = next((n for n in range(len(offs) - 1) if offs[n + 1] < offs[n]), None)
    if bad is not None:
        _fail(ValueError, f"{fn}: {name} must be non-decreasing, but {name}[{bad + 1}]={offs[bad + 1]} < "
                          f"{name}[{bad}]={offs[bad]}")
    if offs[-1] != T:
        _fail(ValueError, f"{fn}: the last entry of {name} must equal the packed length {T}, got {offs[-1]}")
    return offs


def _names(cu_seqlens):
    cross = isinstance(cu_seqlens, (tuple, list))
    return ("cu_seqlens_q", "cu_seqlens_k") if cross else ("cu_seqlens", "cu_seqlens")


def _check_max_seqlen_type(max_seqlen, fn: str) -> Tuple[int, int]:
    pair = _pair(max_seqlen)
    for m in pair if len(pair) == 2 else [None]:          # a tuple of another length is no pair
        if isinstance(m, bool) or not isinstance(m, int):
            _fail(TypeError, f"{fn}: max_seqlen must be an int or a (max_seqlen_q, max_seqlen_k) pair of ints, "
                             f"got {max_seqlen!r}")
        if m < 0:
            _fail(ValueError, f"{fn}: max_seqlen must be non-negative, got {max_seqlen!r}")
    return tuple(int(m) for m in _pair(max_seqlen))


def check_cu_seqlens_on_device(cu_seqlens, max_seqlen, Tq: int, Tk: int, device, fn: str = "attention"):
    """`check_cu_seqlens` without reading ``cu_seqlens`` back to the host (a call given ``max_seqlen``):
    type, dtype, shape and device are checked here; the values (first entry 0, non-decreasing, last
    entry the packed length, no segment longer than ``max_seqlen``) by ``torch._assert_async`` on the
    tensors' device: at once on a CPU, as a device-side assertion on a GPU (no synchronization)."""
    cross = isinstance(cu_seqlens, (tuple, list))
    if cross and len(cu_seqlens) != 2:
        _fail(TypeError, f"{fn}: cu_seqlens must be a tensor or a (cu_seqlens_q, cu_seqlens_k) pair")
    maxima = _check_max_seqlen_type(max_seqlen, fn)
    for cu, name in zip(_pair(cu_seqlens), _names(cu_seqlens)):
        _check_cu_meta(cu, name, device, fn)
    cu_q, cu_k = _pair(cu_seqlens)
    if cu_q.numel() != cu_k.numel():
        _fail(ValueError, f"{fn}: cu_seqlens_q has {cu_q.numel() - 1} segments, cu_seqlens_k {cu_k.numel() - 1}")
    pair = isinstance(max_seqlen, (tuple, list))
    for cu, name, T, m, side in zip(_pair(cu_seqlens), _names(cu_seqlens), (Tq, Tk), maxima, "qk"):
        lengths = cu[1:] - cu[:-1]
        torch._assert_async(cu[0] == 0, f"{fn}: {name}[0] must be 0")
        torch._assert_async(cu[-1] == T, f"{fn}: the last entry of {name} must equal the packed length {T}")
        if cu.numel() > 1:
            torch._assert_async((lengths >= 0).all(), f"{fn}: {name} must be non-decreasing")
            torch._assert_async((lengths <= m).all(), f"{fn}: max_seqlen{'_' + side if pair else ''}={m} is smaller "
                                                      f"than the longest segment ({'queries' if side == 'q' else 'keys'})")
    return maxima


class LazySegments(Sequence):
    """The segment work list of a packed call given ``max_seqlen``: read from ``cu_seqlens`` (and checked
    on the host) only when a row that builds host work lists asks for it (the torch rows, the Triton
    kernels); the CUDA kernels read the segments' bounds on the device and never do."""

    def __init__(self, cu_seqlens, max_seqlen, Tq: int, Tk: int, device, fn: str):
        self._args = (cu_seqlens, max_seqlen, Tq, Tk, device, fn)
        self._segments = None

    def _get(self) -> tuple:
        if self._segments is None:
            self._segments = segment_list(*check_cu_seqlens(*self._args))
        return self._segments

    def __len__(self):
        return len(self._get())

    def __getitem__(self, i):
        return self._get()[i]


def segment_list(offs_q, offs_k) -> tuple:
    """The work list ``(q0, q1, k0, k1, q_offset)`` of host offsets: segments with queries, longest first."""
    segs = [(a, b, c, d, (d - c) - (b - a)) for a, b, c, d in zip(offs_q, offs_q[1:], offs_k, offs_k[1:])]
    segs.sort(key=lambda s: -(s[1] - s[0]) * max(s[3] - s[2], 1))        # longest first
    return tuple(s for s in segs if s[1] > s[0])


def check_cu_seqlens(cu_seqlens, max_seqlen, Tq: int, Tk: int, device, fn: str = "attention"):
    """Validates ``cu_seqlens`` (a tensor, or a ``(cu_q, cu_k)`` pair) and ``max_seqlen`` (None, an int
    or a ``(max_q, max_k)`` pair) against packed lengths ``Tq`` / ``Tk``. Returns the host offsets
    ``(offs_q, offs_k)``."""
    cross = isinstance(cu_seqlens, (tuple, list))
    if cross and len(cu_seqlens) != 2:
        _fail(TypeError, f"{fn}: cu_seqlens must be a tensor or a (cu_seqlens_q, cu_seqlens_k) pair")
    cu_q, cu_k = _pair(cu_seqlens)
    offs_q = _check_cu(cu_q, "cu_seqlens_q" if cross else "cu_seqlens", Tq, device, fn)
    offs_k = offs_q if cu_k is cu_q and Tq == Tk else _check_cu(cu_k, "cu_seqlens_k" if cross else "cu_seqlens",
                                                               Tk, device, fn)
    if len(offs_q) != len(offs_k):
        _fail(ValueError, f"{fn}: cu_seqlens_q has {len(offs_q) - 1} segments, cu_seqlens_k {len(offs_k) - 1}")
    if max_seqlen is not None:
        for side, m, offs in zip("qk", _check_max_seqlen_type(max_seqlen, fn), (offs_q, offs_k)):
            longest = max((b - a for a, b in zip(offs, offs[1:])), default=0)
            if m < longest:
                _fail(ValueError, f"{fn}: max_seqlen{'_' + side if isinstance(max_seqlen, (tuple, list)) else ''}"
                                  f"={m} is smaller than the longest segment ({longest} {'queries' if side == 'q' else 'keys'})")
    return offs_q, offs_k


def _check_positions(positions, fn: str) -> Tuple[int, int]:
    ok = (isinstance(positions, (tuple, list)) and len(positions) == 2
          and all(isinstance(p, int) and not isinstance(p, bool) for p in positions))
    if not ok:
        _fail(TypeError, f"{fn}: positions must be a (q_start, k_start) pair of ints, got {positions!r}")
    if min(positions) < 0:
        _fail(ValueError, f"{fn}: positions must be non-negative, got {positions!r}")
    return int(positions[0]), int(positions[1])


class Packing(NamedTuple):
    """What ``cu_seqlens`` / ``max_seqlen`` / ``positions`` / ``out_dtype`` make of a call (fields of
    `effattn._call.AttnCall`): the segment work list ``(q0, q1, k0, k1, q_offset)`` (longest segments
    first), the ``(cu_q, cu_k)`` pair, the positions that move the call, the fp32 output dtype, the
    rule's ``q_offset``; and ``causal`` / ``left`` / ``right`` (a window that hides no pair at the
    positions' offset leaves a dense call); ``max_seqlen``: ``(max_q, max_k)`` of a packed call (the
    given ``max_seqlen``, else the longest segments), which size the CUDA kernels' grids."""
    segments: Optional[tuple]
    cu_seqlens: Optional[Tuple[Tensor, Tensor]]
    positions: Optional[Tuple[int, int]]
    out_dtype: Optional[torch.dtype]
    q_offset: Optional[int]
    causal: bool
    left: int
    right: int
    max_seqlen: Optional[Tuple[int, int]] = None


def _hides_nothing(Lq: int, Lk: int, left: int, right: int, offset: int) -> bool:
    """Whether the window ``(left, right)`` hides no pair when query i sits at key ``i + offset``."""
    rule = Rule(Lq, Lk, left, right, q_offset=offset)
    first, last = rule.first_key(Lq - 1), rule.last_key(0)     # the last row's first key, row 0's last
    return (first is None or first <= 0) and (last is None or last >= Lk - 1)


def packing(q: Tensor, k: Tensor, *, causal: bool, left: int, right: int, layout, key_padding_mask,
            cu_seqlens, max_seqlen, positions, out_dtype, fn: str = "attention", dropout: bool = False,
            distance: bool = False) -> Packing:
    """Validates the packed / positioned arguments of an attention call (its other arguments already
    checked) and returns the `Packing` the call carries. Positions that change nothing (the
    bottom-right offset ``Lk - Lq``, or a window hiding no pair at their offset) leave a plain call,
    so a ring's diagonal and fully visible chunk pairs take the backends' usual paths; with ``dropout``
    any positions but ``(0, 0)`` stay (dropout draws at the absolute rows and keys); with ``distance``
    (score terms read the query-key distance: ALiBi, Relative, Span) positions whose offset is not the
    bottom-right one stay (the terms' distance is the positions' ``(q_start + i) - (k_start + j)``)."""
    B, Lq, Lk = q.shape[0], q.shape[2], k.shape[2]
    if out_dtype is not None and out_dtype not in (torch.float32, q.dtype):
        _fail(TypeError, f"{fn}: out_dtype must be torch.float32 (fp32 partial outputs) or None, got {out_dtype}")
    out_dtype = None if out_dtype == q.dtype else out_dtype
    segments = pos = q_offset = None
    if cu_seqlens is None:
        if max_seqlen is not None:
            _fail(ValueError, f"{fn}: max_seqlen is given without cu_seqlens")
        if positions is not None:
            qs, ks = _check_positions(positions, fn)
            if layout is not None:
                _fail(ValueError, f"{fn}: positions cannot be combined with layout (a layout indexes the call's "
                                  "own query and key blocks)")
            off = qs - ks
            if (dropout and (qs, ks) != (0, 0)) or (distance and off != Lk - Lq):
                pos, q_offset = (qs, ks), off
                segments = ((0, Lq, 0, Lk, off),)
            elif off == Lk - Lq:
                pass
            elif Lq > 0 and Lk > 0 and _hides_nothing(Lq, Lk, *clamp_window(left, right, Lq, Lk, off), off):
                causal, left, right = False, UNBOUNDED, UNBOUNDED
            else:
                pos, q_offset = (qs, ks), off
                segments = ((0, Lq, 0, Lk, off),)
        if segments is None and out_dtype is not None:
            segments = ((0, Lq, 0, Lk, Lk - Lq),)
        return Packing(segments, None, pos, out_dtype, q_offset, causal, left, right)
    if positions is not None:
        _fail(ValueError, f"{fn}: positions cannot be combined with cu_seqlens (each segment starts at position 0)")
    if key_padding_mask is not None:
        _fail(ValueError, f"{fn}: key_padding_mask cannot be combined with cu_seqlens (the segments replace "
                          "padding: pack only the real tokens)")
    if layout is not None:
        _fail(ValueError, f"{fn}: layout cannot be combined with cu_seqlens (not served yet)")
    if B != 1:
        _fail(ValueError, f"{fn}: with cu_seqlens, q, k, v must be packed as (1, H, T, D), got batch size {B}")
    if max_seqlen is not None:              # no device-to-host read: checked on the device, the list lazy
        maxima = check_cu_seqlens_on_device(cu_seqlens, max_seqlen, Lq, Lk, q.device, fn)
        segments = LazySegments(cu_seqlens, max_seqlen, Lq, Lk, q.device, fn)
        return Packing(segments, _pair(cu_seqlens), None, out_dtype, None, causal, left, right, maxima)
    offs_q, offs_k = check_cu_seqlens(cu_seqlens, max_seqlen, Lq, Lk, q.device, fn)
    maxima = tuple(max((b - a for a, b in zip(o, o[1:])), default=0) for o in (offs_q, offs_k))
    return Packing(segment_list(offs_q, offs_k), _pair(cu_seqlens), None, out_dtype, None, causal, left, right,
                   maxima)


def public_window(left: int, right: int, causal: bool):
    """``(causal, window)`` arguments of `effattn.attention` giving the normalized bounds ``left``,
    ``right`` (``-1`` = unbounded; a one-sided bound gets a reach no sequence has on the other side)."""
    if causal:
        return True, (None if left < 0 else (left, 0))
    if left < 0 and right < 0:
        return False, None
    return False, (left if left >= 0 else 1 << 40, right if right >= 0 else 1 << 40)


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tuple[Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of a packed batch from its ``position_ids`` ``(1, T)`` or ``(T,)``:
    a new sequence starts at token 0 and wherever the position does not continue the previous one
    (``position_ids[i] != position_ids[i - 1] + 1``; Hugging Face's packing restarts them at 0).
    ``cu_seqlens`` is int32 on the ids' device; ``max_seqlen`` is read back once."""
    if not isinstance(position_ids, Tensor) or position_ids.is_floating_point() or position_ids.is_complex():
        _fail(TypeError, "cu_seqlens_from_position_ids: position_ids must be an integer tensor (1, T) or (T,)")
    if position_ids.dim() == 2 and position_ids.shape[0] == 1:
        position_ids = position_ids[0]
    if position_ids.dim() != 1:
        _fail(ValueError, "cu_seqlens_from_position_ids: position_ids must have shape (1, T) or (T,) (one packed "
                          f"row), got {tuple(position_ids.shape)}")
    T = position_ids.shape[0]
    start = torch.ones(T, dtype=torch.bool, device=position_ids.device)
    if T > 1:
        start[1:] = position_ids[1:] != position_ids[:-1] + 1
    idx = start.nonzero().flatten()
    cu = torch.cat([idx, torch.tensor([T], device=idx.device)]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if T > 0 else 0
    return cu, max_seqlen



def check_linear_packed(q, k, v, cu_seqlens, max_seqlen, initial_state=None, return_state=False,
                        fn: str = "linear_attention") -> List[int]:
    """Validates ``linear_attention``'s packed arguments (one ``cu_seqlens`` tensor, q, k, v packed as
    ``(1, H, T, D)``, no state in or out: it restarts at each segment). Returns the host offsets."""
    for name, given in (("initial_state", initial_state is not None), ("return_state", return_state is not False)):
        if given:
            _fail(ValueError, f"{fn}: {name} cannot be combined with cu_seqlens (the state restarts at each segment)")
    if isinstance(cu_seqlens, (tuple, list)):
        _fail(TypeError, f"{fn}: cu_seqlens must be one int32 tensor (self-attention over packed sequences)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[0] != 1:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            _fail(ValueError, f"{fn}: with cu_seqlens, {name} must be packed as (1, H, T, D), got {got}")
    if q.shape[2] != k.shape[2]:
        _fail(ValueError, f"{fn}: with cu_seqlens, q and k must have the same packed length, got {q.shape[2]} "
                          f"and {k.shape[2]}")
    offs, _ = check_cu_seqlens(cu_seqlens, max_seqlen, q.shape[2], k.shape[2], q.device, fn)
    return offs
