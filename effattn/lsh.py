"""Reformer's hashing attention (Kitaev et al. 2020): `lsh_attention` and the pieces it is made of.

Shared-QK attention where a query only looks at keys that fall into the same hash bucket::

    k_j     = qk_j / |qk_j|                                 (keys are the length-normalized queries)
    bucket  = argmax([x R_r, -x R_r])                       (angular LSH, a random rotation R_r per round r)
    perm_r  = stable sort of the positions by (bucket, position)
    chunk c of the sorted sequence (chunk_len rows) attends to the chunks c + o (mod n_chunks),
            o in [-chunks_before, chunks_after]             (a fixed block layout, `lsh_layout`)
    per round r: out_r, lse_r = softmax attention of those chunks, with
            s_ij = scale * qk_i . k_j                       (scale 1 by default, see below)
            s_ij = -inf   where key j is padding, or causal and pos(j) > pos(i)  (original positions)
            s_ii = SELF_SCORE (-1e5)                        (a token sees itself only when nothing else)
    out     = sum_r exp(lse_r - lse) out_r,  lse = logsumexp_r lse_r     (rounds merged by their lse)

A key found by several rounds counts once per round (the merge sums the rounds' probability mass),
as in trax's reference. The default ``scale`` is 1, as in trax and Hugging Face's Reformer (their keys
are ``qk / rms(qk) / sqrt(D)``, unit vectors, and the scores are not scaled again): a unit key already
takes out the ``|k| ~ sqrt(D)`` that ``1/sqrt(D)`` takes out of dot-product attention, so ``qk_i . k_j``
has its unit variance; ``1/sqrt(D)`` on top would flatten every softmax by ``sqrt(D)``.

The sort makes the pattern a fixed block layout at block ``chunk_len``; what depends on the data
(causal and padding on the original positions, the self score) is evaluated elementwise from the
gathered positions. Un-sorting is a gather by the inverse permutation, so the backward is
deterministic.

Two registry rows of the op ``"lsh_attention"`` (`explain_lsh` says which one runs and why), both
on `sorted_rounds` -> attention of the sorted rows -> `unsorted`:

- ``triton/lsh`` (``effattn/backends/triton/lsh/``): the sorted rows, rounds folded into the heads,
  on effattn's general block-sparse Triton attention kernels with the layout `lsh_layout` (cached
  per length, chunk_len and offsets, so its tile lists are built once) and their per-row positions
  feature (``q_pos`` / ``k_pos``: padding keys at -1, causal on the original positions, the self
  score), evaluated in every visited tile; O(L) memory, deterministic backward, Philox dropout
  seeded from torch's default generator. Taken by ``backend="auto"`` on CUDA (on a CPU only by
  name, in Triton's interpreter).
- ``torch/lsh``: each round's chunks as one batched product over gathered neighbour chunks,
  ``O(n_hashes * L * n_neighbours * chunk_len)`` memory (linear in ``L``), the scores kept for
  autograd. Serves everything (dropout, float64, any ``chunk_len``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._call import compute_dtype
from .backends import base
from .explanation import explain_call

SELF_SCORE = -1e5        # the score of a token against itself (trax's self-attention penalty)
FN = "lsh_attention"


def _int_arg(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{FN}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def default_n_buckets(length: int, chunk_len: int) -> int:
    """Buckets of about one chunk each (reformer-pytorch's choice), at least 2, rounded up to even."""
    nb = max(2, length // chunk_len)
    return nb + (nb % 2)


def chunk_offsets(n_chunks: int, chunks_before: int, chunks_after: int) -> List[int]:
    """The distinct chunk offsets ``o`` (mod ``n_chunks``, in ``[0, n_chunks)``) chunk c attends to
    as ``c + o``: a chunk is never counted twice when the neighbourhood wraps around."""
    return sorted({o % n_chunks for o in range(-chunks_before, chunks_after + 1)})


def lsh_layout(length: int, chunk_len: int, chunks_before: int = 1, chunks_after: int = 0):
    """The fixed block layout of one round after the sort: an `effattn.layouts.BlockLayout` of
    ``(1, n_chunks, n_chunks)`` blocks of ``chunk_len`` with ``mask[c, (c + o) % n_chunks]``."""
    return cached_lsh_layout(length, chunk_len, chunk_offsets(length // chunk_len, chunks_before, chunks_after))


_LAYOUTS: Dict[tuple, object] = {}
_MAX_LAYOUTS = 64


def cached_lsh_layout(length: int, chunk_len: int, offsets: List[int]):
    """`lsh_layout` from the chunk offsets, one `BlockLayout` per (length, chunk_len, offsets) for the
    process: the block-sparse kernels cache their tile lists (and the layout's copy on each device)
    on the layout, so repeated calls reuse them. At most ``_MAX_LAYOUTS`` kept (then rebuilt)."""
    from .layouts import BlockLayout
    key = (length, chunk_len, tuple(offsets))
    lay = _LAYOUTS.get(key)
    if lay is None:
        nc = length // chunk_len
        mask = torch.zeros(nc, nc, dtype=torch.bool)
        rows = torch.arange(nc)
        for o in offsets:
            mask[rows, (rows + o) % nc] = True
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        lay = _LAYOUTS[key] = BlockLayout(mask, chunk_len)
    return lay


def draw_rotations(H: int, D: int, n_hashes: int, n_buckets: int, generator: Optional[torch.Generator], device,
                   dtype) -> Tensor:
    """The random rotations of `lsh_hash`: ``(H, D, n_hashes, n_buckets / 2)``. A caller that replays
    buckets but must consume the same random numbers (a reversible recomputation, where dropout
    follows the hashing) draws them again with this."""
    gen_device = generator.device if generator is not None else device
    rot = torch.randn((H, D, n_hashes, n_buckets // 2), generator=generator, device=gen_device, dtype=dtype)
    return rot.to(device)


def lsh_hash(qk: Tensor, n_hashes: int, n_buckets: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """Angular LSH of ``qk (B, H, L, D)``: int64 buckets ``(B, H, n_hashes, L)``, round r's ids in
    ``[r * n_buckets, (r + 1) * n_buckets)`` (offset per round so ids never collide across rounds).

    One random rotation ``(D, n_buckets / 2)`` per head and round, drawn from ``generator`` (torch's
    default generator when None), shared by the batch."""
    if n_buckets < 2 or n_buckets % 2:
        raise ValueError(f"{FN}: n_buckets must be an even int >= 2 (angular LSH takes the argmax over "
                         f"[xR, -xR]), got {n_buckets!r}")
    B, H, L, D = qk.shape
    dt = compute_dtype(qk.dtype)
    rot = draw_rotations(H, D, n_hashes, n_buckets, generator, qk.device, dt)
    with torch.no_grad():
        x = torch.einsum("bhld,hdrk->bhrlk", qk.detach().to(dt), rot)
        buckets = torch.cat([x, -x], dim=-1).argmax(dim=-1)
    return buckets + torch.arange(n_hashes, device=qk.device).view(1, 1, n_hashes, 1) * n_buckets


def _check_inputs(qk, v, n_hashes, chunk_len, chunks_before, chunks_after, n_buckets, causal,
                  key_padding_mask, buckets, scale, dropout_p, backend) -> Tuple[int, float]:
    for name, t in (("qk", qk), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{FN}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{FN}: {name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    if qk.dtype != v.dtype or not qk.is_floating_point():
        raise TypeError(f"{FN}: qk and v must share one floating dtype, got qk={qk.dtype}, v={v.dtype}")
    if qk.shape[:3] != v.shape[:3]:
        raise ValueError(f"{FN}: qk (B, H, L, D) and v (B, H, L, Dv) must agree in B, H, L; got "
                         f"{tuple(qk.shape)} and {tuple(v.shape)}")
    if qk.device != v.device:
        raise ValueError(f"{FN}: qk is on {qk.device}, v on {v.device}")
    _int_arg(n_hashes, "n_hashes", 1)
    _int_arg(chunk_len, "chunk_len", 1)
    _int_arg(chunks_before, "chunks_before", 0)
    _int_arg(chunks_after, "chunks_after", 0)
    B, H, L, _ = qk.shape
    if L % chunk_len:
        raise ValueError(f"{FN}: chunk_len={chunk_len} must divide the sequence length L={L}; pad the "
                         f"sequence to a multiple of chunk_len and mark the padding in key_padding_mask "
                         f"(effattn.nn.LSHSelfAttention does this)")
    if n_buckets is None:
        n_buckets = default_n_buckets(L, chunk_len)
    elif isinstance(n_buckets, bool) or not isinstance(n_buckets, int) or n_buckets < 2 or n_buckets % 2:
        raise ValueError(f"{FN}: n_buckets must be an even int >= 2 (angular LSH takes the argmax over "
                         f"[xR, -xR]), got {n_buckets!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"{FN}: causal must be a bool, got {causal!r}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{FN}: key_padding_mask must be a bool tensor (B, L), True = padding")
        if tuple(key_padding_mask.shape) != (B, L):
            raise ValueError(f"{FN}: key_padding_mask must have shape (B, L)=({B}, {L}), got "
                             f"{tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != qk.device:
            raise ValueError(f"{FN}: key_padding_mask is on {key_padding_mask.device}, qk on {qk.device}")
    if buckets is not None:
        if not isinstance(buckets, torch.Tensor) or buckets.dtype.is_floating_point or buckets.dtype == torch.bool:
            raise TypeError(f"{FN}: buckets must be an integer tensor (B, H, n_hashes, L) as returned by "
                            f"return_buckets=True")
        if tuple(buckets.shape) != (B, H, n_hashes, L):
            raise ValueError(f"{FN}: buckets must have shape (B, H, n_hashes, L)=({B}, {H}, {n_hashes}, {L}), "
                             f"got {tuple(buckets.shape)}")
        if buckets.device != qk.device:
            raise ValueError(f"{FN}: buckets is on {buckets.device}, qk on {qk.device}")
    if scale is None:
        scale = 1.0          # keys are unit vectors: no 1/sqrt(D) (trax's Reformer; module docstring)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{FN}: scale must be a finite float, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{FN}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if backend not in ("auto", "torch", "triton", "cuda"):
        raise ValueError(f"{FN}: backend must be 'auto', 'torch', 'triton' or 'cuda', got {backend!r}")
    return n_buckets, float(scale)


@dataclasses.dataclass(frozen=True)
class LshCall:
    """One `lsh_attention` call, checked once; the rows of op ``"lsh_attention"`` read it. ``perm``
    and ``inv`` (the sort of each round's positions by bucket, and its inverse) are set once the
    hashing ran (None while `explain_lsh` only asks which row serves)."""
    q: Tensor                            # qk (B, H, L, D)
    v: Tensor
    chunk_len: int
    offsets: List[int]
    causal: bool
    key_padding_mask: Optional[Tensor]
    scale: float
    dropout_p: float
    n_hashes: int
    n_buckets: int
    perm: Optional[Tensor] = None        # (B, H, n_hashes, L)
    inv: Optional[Tensor] = None

    def features(self) -> frozenset:
        return frozenset(name for name, on in (("causal", self.causal), ("dropout", self.dropout_p > 0),
                                               ("key_padding_mask", self.key_padding_mask is not None)) if on)


def make_lsh_call(qk: Tensor, v: Tensor, *, n_hashes: int = 4, chunk_len: int = 64, chunks_before: int = 1,
                  chunks_after: int = 0, n_buckets: Optional[int] = None, causal: bool = False,
                  key_padding_mask: Optional[Tensor] = None, buckets: Optional[Tensor] = None,
                  scale: Optional[float] = None, dropout_p: float = 0.0, backend: str = "auto",
                  generator: Optional[torch.Generator] = None, return_buckets: bool = False) -> LshCall:
    """Checks `lsh_attention`'s arguments (errors name the argument) and builds its call."""
    n_buckets, scale = _check_inputs(qk, v, n_hashes, chunk_len, chunks_before, chunks_after, n_buckets, causal,
                                     key_padding_mask, buckets, scale, dropout_p, backend)
    offsets = chunk_offsets(qk.shape[2] // chunk_len, chunks_before, chunks_after)
    return LshCall(qk, v, chunk_len, offsets, causal, key_padding_mask, scale, float(dropout_p), n_hashes, n_buckets)


def _neighbours(x: Tensor, offsets: List[int]) -> Tensor:
    """``x (N, n_chunks, chunk_len, ...)`` -> ``(N, n_chunks, len(offsets) * chunk_len, ...)``: for
    chunk c, the rows of chunks ``c + o`` (mod n_chunks) side by side."""
    parts = [x if o == 0 else torch.roll(x, shifts=-o, dims=1) for o in offsets]
    return torch.cat(parts, dim=2)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, pad: Optional[Tensor], chunk_len: int,
                    offsets: List[int], causal: bool, scale: float, dropout_p: float) -> Tuple[Tensor, Tensor]:
    """One round of sorted rows: ``q, k (N, L, D)``, ``v (N, L, Dv)`` in the compute dtype, ``pos
    (N, L)`` the rows' original positions, ``pad (N, L)`` bool (True = padding) or None. Returns
    ``out (N, L, Dv)`` and ``lse (N, L)`` (-inf, with out 0, for a row that sees nothing)."""
    N, L, D = q.shape
    nc = L // chunk_len
    qc = q.view(N, nc, chunk_len, D)
    kn = _neighbours(k.view(N, nc, chunk_len, D), offsets)                  # (N, nc, nk, D)
    vn = _neighbours(v.view(N, nc, chunk_len, -1), offsets)
    qpos = pos.view(N, nc, chunk_len, 1)
    kpos = _neighbours(pos.view(N, nc, chunk_len), offsets).unsqueeze(2)   # (N, nc, 1, nk)
    s = torch.matmul(qc, kn.transpose(-1, -2)) * scale                     # (N, nc, cl, nk)
    visible = torch.ones_like(s, dtype=torch.bool) if pad is None else \
        ~_neighbours(pad.view(N, nc, chunk_len), offsets).unsqueeze(2).expand_as(s)
    if causal:
        visible = visible & (kpos <= qpos)
    s = torch.where(kpos == qpos, torch.full_like(s, SELF_SCORE), s)
    p, lse = softmax_lse(s.masked_fill(~visible, -math.inf), dim=-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    out = torch.matmul(p, vn)
    return out.view(N, L, -1), lse.view(N, L)


def softmax_lse(s: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """``softmax(s)`` and ``logsumexp(s)`` over ``dim``, exact and with finite gradients where every
    entry is -inf (probabilities 0, lse -inf), where torch's logsumexp backward gives NaN."""
    m = s.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim, keepdim=True)
    nonempty = total > 0
    total = torch.where(nonempty, total, torch.ones_like(total))
    lse = torch.where(nonempty, m + torch.log(total), torch.full_like(total, -math.inf))
    return e / total, lse.squeeze(dim)


def merge_rounds(out: Tensor, lse: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """Merges partial attention results over ``dim`` by their lse: ``out (..., R, ..., Dv)`` with
    ``lse`` of the same shape less ``Dv``. Rows whose every part is empty give 0 and -inf."""
    w, total = softmax_lse(lse, dim)
    return (w.unsqueeze(-1) * out).sum(dim), total


def lsh_attention(qk: Tensor, v: Tensor, *, n_hashes: int = 4, chunk_len: int = 64, chunks_before: int = 1,
                  chunks_after: int = 0, n_buckets: Optional[int] = None, causal: bool = False,
                  key_padding_mask: Optional[Tensor] = None, generator: Optional[torch.Generator] = None,
                  buckets: Optional[Tensor] = None, return_buckets: bool = False, scale: Optional[float] = None,
                  dropout_p: float = 0.0, backend: str = "auto"):
    r"""Reformer's LSH attention with shared queries and keys (see the module docstring for the math).

    Args:
        qk: ``(B, H, L, D)`` shared queries/keys (keys are ``qk / |qk|``).
        v: ``(B, H, L, Dv)`` values.
        n_hashes: hash rounds, merged by their log-sum-exp.
        chunk_len: rows per chunk of the sorted sequence; must divide ``L``.
        chunks_before, chunks_after: neighbour chunks each chunk also attends to (wrapping around).
        n_buckets: buckets per round, even; default ``max(2, L // chunk_len)`` rounded up to even.
        causal: key j is visible to query i only when ``j <= i`` (original positions).
        key_padding_mask: bool ``(B, L)``, True marks padding (never attended to).
        generator: draws the random rotations (reproducible hashing); torch's default when None.
        buckets: int ``(B, H, n_hashes, L)`` to reuse a previous call's hashing (e.g. in a reversible
            recomputation, where recomputed inputs differ by rounding and an argmax could flip).
        return_buckets: also return the buckets used.
        scale: score scale, default 1 (trax's: the keys are unit vectors, so ``qk . k`` needs no
            ``1/sqrt(D)``; see the module docstring).
        dropout_p: dropout on each round's probabilities, drawn from torch's default generator.
        backend: ``"auto"``, ``"triton"`` (the block-sparse Triton kernels with positions) or ``"torch"``;
            `explain_lsh` says which row serves and why.

    A token attends to itself only when it sees no other key (its score is ``SELF_SCORE``); a row
    that sees nothing (a padded token whose neighbours are padding) outputs 0.

    Returns:
        ``out (B, H, L, Dv)``, or ``(out, buckets)`` with ``return_buckets=True``.

    Examples::

        >>> qk, v = torch.randn(2, 4, 1024, 64), torch.randn(2, 4, 1024, 64)
        >>> out, buckets = effattn.lsh_attention(qk, v, n_hashes=2, chunk_len=64, return_buckets=True)
        >>> again = effattn.lsh_attention(qk, v, n_hashes=2, chunk_len=64, buckets=buckets)
    """
    call = make_lsh_call(qk, v, n_hashes=n_hashes, chunk_len=chunk_len, chunks_before=chunks_before,
                         chunks_after=chunks_after, n_buckets=n_buckets, causal=causal,
                         key_padding_mask=key_padding_mask, buckets=buckets, scale=scale, dropout_p=dropout_p,
                         backend=backend)
    path = base.select(FN, call, backend)
    L = qk.shape[2]
    if buckets is None:
        buckets = lsh_hash(qk, n_hashes, call.n_buckets, generator)
    pos = torch.arange(L, device=qk.device)
    # stable sort by (bucket, position): the key is unique, so any sort is stable
    perm = torch.argsort(buckets.to(torch.int64) * L + pos, dim=-1)          # (B, H, R, L)
    out_r, lse_r = path.run(dataclasses.replace(call, perm=perm, inv=torch.argsort(perm, dim=-1)))
    out, _ = merge_rounds(out_r, lse_r, dim=2)
    out = out.to(qk.dtype)
    return (out, buckets) if return_buckets else out


class SortedRounds(NamedTuple):
    """One call's rounds in sorted order, rounds folded into the head axis (``N = B * H * R``): what a
    block-sparse kernel with per-row positions needs (the layout is `lsh_layout`, shared by every row)."""
    q: Tensor            # (N, L, D)  gathered qk
    k: Tensor            # (N, L, D)  gathered unit keys qk / |qk|
    v: Tensor            # (N, L, Dv)
    pos: Tensor          # (N, L) int64: each sorted row's original position
    pad: Optional[Tensor]  # (N, L) bool, True = padding key, or None

    def key_positions(self) -> Tensor:
        """int32 ``(N, L)``: the keys' original positions with -1 where the key is padding (the
        kernels' convention: a key of negative position is never visible)."""
        kpos = self.pos.to(torch.int32)
        return kpos if self.pad is None else kpos.masked_fill(self.pad, -1)


def sorted_rounds(call: LshCall, dtype: Optional[torch.dtype] = None) -> SortedRounds:
    """Gathers ``call``'s rows in each round's sorted order (``call.perm``), in ``dtype`` (default the
    compute dtype); keys are normalized in float32 or wider and cast back."""
    qk, v, perm = call.q, call.v, call.perm
    B, H, R, L = perm.shape
    dt = compute_dtype(qk.dtype) if dtype is None else dtype

    def gathered(x: Tensor) -> Tensor:                                       # (B, H, L, E) -> (B*H*R, L, E)
        x = x.unsqueeze(2).expand(B, H, R, L, x.shape[-1])
        return x.gather(3, perm.unsqueeze(-1).expand(B, H, R, L, x.shape[-1])).reshape(B * H * R, L, -1)

    q_s = gathered(qk)
    k_s = F.normalize(q_s.to(compute_dtype(q_s.dtype)), dim=-1).to(dt)
    pad = None
    if call.key_padding_mask is not None:
        pad = call.key_padding_mask.view(B, 1, 1, L).expand(B, H, R, L).gather(3, perm).reshape(B * H * R, L)
    return SortedRounds(q_s.to(dt), k_s, gathered(v).to(dt), perm.reshape(B * H * R, L), pad)


def unsorted(out_s: Tensor, lse_s: Tensor, call: LshCall) -> Tuple[Tensor, Tensor]:
    """``out_s (N, L, Dv)``, ``lse_s (N, L)`` in sorted order -> ``out_r (B, H, R, L, Dv)``, ``lse_r
    (B, H, R, L)`` in original order (a gather by the inverse permutation: deterministic backward)."""
    B, H, R, L = call.perm.shape
    Dv = out_s.shape[-1]
    out_r = out_s.reshape(B, H, R, L, Dv).gather(3, call.inv.unsqueeze(-1).expand(B, H, R, L, Dv))
    return out_r, lse_s.reshape(B, H, R, L).gather(3, call.inv)


def torch_rounds(call: LshCall) -> Tuple[Tensor, Tensor]:
    """The ``torch/lsh`` row: each round's rows gathered in sorted order, `chunk_attention`, and
    un-sorted; ``out (B, H, R, L, Dv)``, ``lse (B, H, R, L)``."""
    rows = sorted_rounds(call)
    out_s, lse_s = chunk_attention(rows.q, rows.k, rows.v, rows.pos, rows.pad, call.chunk_len, call.offsets,
                                   call.causal, call.scale, call.dropout_p)
    return unsorted(out_s, lse_s, call)


def explain_lsh(qk: Tensor, v: Tensor, **kwargs) -> str:
    """The text of `effattn.explain` for an `lsh_attention` call: its rows (``triton/lsh``,
    ``torch/lsh``) with their reasons, and the one ``backend="auto"`` takes."""
    return str(explain_call(FN, make_lsh_call(qk, v, **kwargs)))


def _explain_call(qk: Tensor, k, v: Tensor, **kwargs) -> LshCall:
    if k is not None and k is not qk:
        raise ValueError(f"explain(op={FN!r}): keys are the queries (pass qk as q and k, or k=None)")
    return make_lsh_call(qk, v, **kwargs)


base.CALL_MAKERS[FN] = _explain_call
