"""Paged KV cache (vLLM's layout): `paged_attention` and `PagedKVCache`.

Keys and values live in a pool of fixed-size pages shared by the sequences of a batch::

    k_pages (num_pages, page_size, Hkv, D),  v_pages (num_pages, page_size, Hkv, Dv)
    block_table (B, max_pages) int: sequence b's logical key position t is in page
        block_table[b, t // page_size], slot t % page_size
    seqlens (B,) int: sequence b holds keys 0 .. seqlens[b] - 1 (those of the current queries included)

Queries are aligned bottom-right **per sequence**: query i of a call with ``Lq`` queries sits at
position ``seqlens[b] - Lq + i``, so ``causal`` / ``window`` mean the same as in one contiguous call
over sequence b's keys (decode: ``Lq = 1``; chunked prefill: ``Lq > 1``). Forward only.

Rows of the op ``"paged_attention"`` (``effattn.explain(q, k_pages, v_pages, block_table=...,
seqlens=...)`` lists them with their reasons):

- ``triton/paged`` (``effattn/backends/triton/paged/``): one kernel for decode and prefill that reads every key row
  from its page in place (any page size). ``backend="auto"`` takes it on CUDA; on a CPU only by
  name (Triton's interpreter).
- ``cuda/paged-decode`` (``effattn/backends/cuda/attention/paged.py``): the CUDA C++ split-KV decode
  kernels reading the pages in place, for decode-shaped calls (``Lq <= 16``), bf16/fp16, pools whose
  rows are 16-byte aligned with a head dim that is a multiple of 8. Ahead of ``triton/paged`` for a
  cache of at least 1024 keys.
- ``cuda/paged-prefill`` (the same file): the CUDA C++ mma.sync forward reading the pages in place, any
  ``Lq`` (chunked prefill), the same dtypes and pools; after ``triton/paged`` and, for decode-shaped
  calls, after ``cuda/paged-decode``. ``backend="cuda"`` on a call both refuse (pools they cannot read
  in place) runs the gather row with the CUDA prefill kernels on the copy, and explain says why.
- ``torch/paged-gather``: the used pages are gathered into a contiguous ``(B, Hkv, max_pages * page_size, D)``
  copy, **right-aligned** per row (row b's keys end at the last slot, the slots before them are
  masked as padding), and handed to :func:`effattn.attention` with the given ``backend``, whose
  bottom-right alignment then places every row's queries exactly. One copy of the keys per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .backends import base
from .visibility import normalize_window

FN = "attention (paged)"
OP = "paged_attention"
GATHER_NOTE = ("paged KV: the used pages are first gathered into a contiguous right-aligned copy (torch "
               "gather, one copy of the keys per call)")


def _check_paged(q, k_pages, v_pages, block_table, seqlens, check_values=True):
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("block_table", block_table),
                    ("seqlens", seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{FN}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{FN}: q must be 4-D (B, H, Lq, D), got shape {tuple(q.shape)}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dim() != 4:
            raise ValueError(f"{FN}: {name} must be 4-D (num_pages, page_size, Hkv, D), got shape {tuple(t.shape)}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"{FN}: k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must agree in "
                         f"(num_pages, page_size, Hkv)")
    if k_pages.shape[3] != q.shape[3]:
        raise ValueError(f"{FN}: q has head dim {q.shape[3]}, k_pages {k_pages.shape[3]}")
    if q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"{FN}: q's {q.shape[1]} heads must be a multiple of the {k_pages.shape[2]} KV heads of "
                         f"k_pages (grouped-query attention)")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not t.is_floating_point():
            raise TypeError(f"{FN}: {name} must be a floating-point tensor, got {t.dtype}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dtype != q.dtype:
            raise TypeError(f"{FN}: {name} is {t.dtype} but q is {q.dtype}; pass the same dtype (cast q or the pool)")
    B = q.shape[0]
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"{FN}: block_table must be an int32/int64 tensor (B={B}, max_pages), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if seqlens.dtype not in (torch.int32, torch.int64) or tuple(seqlens.shape) != (B,):
        raise ValueError(f"{FN}: seqlens must be an int32/int64 tensor (B={B},), got {seqlens.dtype} "
                         f"{tuple(seqlens.shape)}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages), ("block_table", block_table), ("seqlens", seqlens)):
        if t.device != q.device:
            raise ValueError(f"{FN}: {name} is on {t.device}, q on {q.device}")
    if not check_values or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return                 # the values stay on the device: a graph capture cannot read them back
    num_pages, page_size = k_pages.shape[:2]
    capacity = block_table.shape[1] * page_size
    lens = seqlens.tolist()                                       # host read: the checks need the values
    if any(n < 0 or n > capacity for n in lens):
        raise ValueError(f"{FN}: seqlens must lie in [0, max_pages * page_size = {block_table.shape[1]} * {page_size} "
                         f"= {capacity}] (block_table holds {block_table.shape[1]} pages per sequence), got {lens}")
    used = torch.arange(block_table.shape[1], device=q.device)[None, :] * page_size < seqlens[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(x) for x in bad.nonzero()[0])
        entry = int(block_table[b, p])
        where = "is negative" if entry < 0 else "points past the pool"
        raise ValueError(f"{FN}: block_table[{b}, {p}] = {entry} {where} of num_pages={num_pages} pages (pages "
                         f"0..{num_pages - 1}; sequence {b} uses its first {-(-lens[b] // page_size)} entries)")


def gather_pages(pages: Tensor, block_table: Tensor, seqlens: Tensor) -> Tensor:
    """``pages (num_pages, page_size, Hkv, D)`` -> contiguous ``(B, Hkv, max_pages * page_size, D)``,
    row b's ``seqlens[b]`` keys right-aligned (ending at the last slot); the slots before them hold
    page 0's data and must be masked (`right_aligned_padding`)."""
    page_size = pages.shape[1]
    S = block_table.shape[1] * page_size
    slot = torch.arange(S, device=pages.device)[None, :]
    logical = (slot - (S - seqlens.to(torch.int64)[:, None])).clamp_min(0)          # (B, S)
    page = block_table.to(torch.int64).gather(1, logical // page_size)
    page = torch.where(slot >= S - seqlens.to(torch.int64)[:, None], page, torch.zeros_like(page))
    return pages[page, logical % page_size].permute(0, 2, 1, 3)


def right_aligned_padding(seqlens: Tensor, slots: int) -> Tensor:
    """bool ``(B, slots)``, True on the slots before each row's right-aligned keys."""
    return torch.arange(slots, device=seqlens.device)[None, :] < (slots - seqlens.to(torch.int64)[:, None])


@dataclass(frozen=True)
class PagedCall:
    """One paged call, checked once; the rows of op ``"paged_attention"`` read it. ``backend`` is the
    name the caller gave: the gather row hands the contiguous copy to `effattn.attention` with it."""
    q: Tensor
    k_pages: Tensor
    v: Tensor                          # v_pages (num_pages, page_size, Hkv, Dv)
    block_table: Tensor
    seqlens: Tensor
    causal: bool
    window: object
    left: int                          # the normalized window, -1 = unbounded (causal: right = 0)
    right: int
    scale: Optional[float]             # as given (None: 1/sqrt(D))
    return_lse: bool
    backend: str

    def features(self) -> frozenset:
        f = {"causal"} if self.causal else set()
        if self.left >= 0 or (self.right >= 0 and not self.causal):
            f.add("window")
        if self.return_lse:
            f.add("return_lse")
        return frozenset(f)


def make_paged_call(q: Tensor, k_pages: Tensor, v_pages: Tensor, *, block_table: Tensor, seqlens: Tensor,
                    causal: bool = False, window=None, scale: Optional[float] = None, return_lse: bool = False,
                    backend: str = "auto", check_values: bool = True) -> PagedCall:
    """Checks a paged call's arguments (errors name the argument) and builds its call. The checks of
    the values of ``seqlens`` and ``block_table`` read them back to the host: they are skipped with
    ``check_values=False`` (a `PagedKVCache` builds both itself) and under CUDA graph capture."""
    _check_paged(q, k_pages, v_pages, block_table, seqlens, check_values)
    left, right = normalize_window(window, causal)
    return PagedCall(q, k_pages, v_pages, block_table, seqlens, causal, window, left, right, scale, return_lse,
                     backend)


def paged_row(call: PagedCall) -> "base.Path":
    """The row serving a paged call: ``"auto"`` the first that admits it; ``"triton"`` the in-place
    kernel (or an error saying why not); ``"cuda"`` its in-place decode or prefill kernel when one
    admits the call; any other backend name (and ``"cuda"`` otherwise: pools its kernels cannot read in
    place) the gather row, which then runs that backend's attention on the contiguous copy (explain says
    why the in-place rows did not)."""
    if call.backend in ("auto", "triton"):
        return base.select(OP, call, call.backend)
    own = base._REGISTRY[OP].get(call.backend)
    if own is not None and call.backend != "torch":
        row, _ = own.take(call)
        if row is not None:
            return row
    return base.select(OP, call, "torch")


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, *, block_table: Tensor, seqlens: Tensor,
                    causal: bool = False, window=None, scale: Optional[float] = None, return_lse: bool = False,
                    backend: str = "auto", check_values: bool = True):
    """Attention of ``q (B, H, Lq, D)`` over paged keys/values (see the module docstring); what
    ``effattn.attention(q, k_pages, v_pages, block_table=, seqlens=)`` runs. Forward only.
    ``check_values=False``: see `make_paged_call`."""
    call = make_paged_call(q, k_pages, v_pages, block_table=block_table, seqlens=seqlens, causal=causal,
                           window=window, scale=scale, return_lse=return_lse, backend=backend,
                           check_values=check_values)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pages, v_pages)):
        raise ValueError(f"{FN}: paged attention is forward only; call it under torch.no_grad() (q, k_pages "
                         f"or v_pages requires grad)")
    return paged_row(call).run(call)


def kernel_scale(call: PagedCall) -> float:
    return 1.0 / math.sqrt(call.q.shape[-1]) if call.scale is None else float(call.scale)


def contiguous_keys(call: PagedCall, shapes_only: bool = False):
    """``(k, v, key_padding_mask)`` of the contiguous right-aligned call the gather row makes (with
    ``shapes_only``: zero-stride tensors of the shapes, for explain; nothing gathered)."""
    S = call.block_table.shape[1] * call.k_pages.shape[1]
    if shapes_only:
        B, Hkv = call.q.shape[0], call.k_pages.shape[2]
        k = call.k_pages.new_zeros(1).expand(B, Hkv, S, call.k_pages.shape[3])
        v = call.v.new_zeros(1).expand(B, Hkv, S, call.v.shape[3])
    else:
        k = gather_pages(call.k_pages, call.block_table, call.seqlens)
        v = gather_pages(call.v, call.block_table, call.seqlens)
    return k, v, right_aligned_padding(call.seqlens, S)


class PagedKVCache:
    r"""A pool of key/value pages shared by many sequences, with vLLM's block-table layout.

    Args:
        num_pages: pages in the pool.
        page_size: key slots per page.
        num_kv_heads, head_dim: ``Hkv`` and ``D`` of the keys (values: ``head_dim_v``, default ``D``).
        dtype, device: of the pool.

    Attributes:
        k_pages, v_pages: ``(num_pages, page_size, Hkv, D)`` / ``(..., Dv)`` pools.
        lengths: int32 ``(B,)`` on the pool's device, the keys held by each bound row (below), or None.

    Sequences are integer ids from `new_sequence`; `append` writes a step's keys/values of several
    sequences (allocating pages from the free list), `block_table` / `seqlens` give the tensors of
    :func:`effattn.attention`'s paged call and `attention` runs it; `free` returns a sequence's pages.

    With the nn modules (``cache=`` of :class:`effattn.nn.MultiheadAttention`, ``caches=`` of the
    Transformer stacks; one cache per attention module, as :class:`effattn.nn.KVCache`): the rows of the
    module's batch are the sequences of `bind` (by default, at the first step, ``B`` new sequences).
    Each step writes its keys at the lengths held on the device (``lengths``), advances them in place
    and runs the paged attention on the bound rows' block table: rows of different lengths continue
    each at its own length, steps of several tokens included. Pages come from the free list on the host
    as the host's count of each sequence's keys requires.

    CUDA graphs: a step reads nothing back to the host and, once the bound rows hold their pages
    (`reserve` the tokens the replays will write), has the same shapes every step: prefill eagerly,
    ``reserve(n)``, run one step outside the capture, capture one and replay it per token. A replay
    advances only the device state (``lengths``, the pools); `sync` then reads the lengths back
    (a host sync) before eager steps, `append` or `free` use the host's counts again. A replay past the
    reserved pages writes where the table's unused entries point (page 0): reserve enough.

    Examples::

        >>> cache = PagedKVCache(64, 16, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cuda")
        >>> seqs = [cache.new_sequence() for _ in range(3)]
        >>> cache.append(seqs, k, v)                   # k, v (3, 2, T, 64): T new tokens per sequence
        >>> out = cache.attention(q, seqs, causal=True)   # q (3, H, T, 64)
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 head_dim_v: Optional[int] = None, dtype=torch.float32, device=None):
        for name, val in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {val!r}")
        Dv = head_dim if head_dim_v is None else head_dim_v
        self.page_size = page_size
        self.k_pages = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(num_pages, page_size, num_kv_heads, Dv, dtype=dtype, device=device)
        self._free: List[int] = list(range(num_pages))
        self._pages: Dict[int, List[int]] = {}
        self._lens: Dict[int, int] = {}
        self._next_id = 0
        self.rows: Optional[List[int]] = None      # the sequences of the bound batch rows
        self.lengths: Optional[Tensor] = None      # int32 (B,) device lengths of the bound rows
        self._table: Optional[Tensor] = None       # int32 (B, num_pages) device block table of the bound rows

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def new_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self._pages[sid], self._lens[sid] = [], 0
        return sid

    def free(self, seq_id: int) -> None:
        """Returns a sequence's pages to the pool; a bound batch is unbound when it held the sequence."""
        self._free.extend(self._pages.pop(self._seq(seq_id)))
        del self._lens[seq_id]
        if self.rows is not None and seq_id in self.rows:
            self.rows = self.lengths = self._table = None

    def __len__(self) -> int:
        return len(self._lens)

    def __repr__(self) -> str:
        rows = f", rows={self.rows}" if self.rows is not None else ""
        return (f"PagedKVCache(pages={self.k_pages.shape[0]}x{self.page_size}, free={len(self._free)}, "
                f"sequences={len(self._lens)}{rows})")

    def _seq(self, seq_id: int) -> int:
        if seq_id not in self._lens:
            raise KeyError(f"PagedKVCache: unknown sequence id {seq_id!r}")
        return seq_id

    def _check_kv(self, fn: str, B: int, k: Tensor, v: Tensor) -> None:
        Hkv, D, Dv = self.k_pages.shape[2], self.k_pages.shape[3], self.v_pages.shape[3]
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != B or (k.shape[1], k.shape[3]) != (Hkv, D) or \
                v.shape[:3] != k.shape[:3] or v.shape[3] != Dv:
            raise ValueError(f"{fn}: k, v must be (B={B}, Hkv={Hkv}, T, D={D} / Dv={Dv}), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")

    def _grow(self, seq_ids: Sequence[int], T: int, fn: str) -> None:
        """Pages from the free list so that each sequence holds room for ``T`` more keys than the host
        counts; the bound rows' device table gets the new entries."""
        need = sum(max(0, -(-(self._lens[s] + T) // self.page_size) - len(self._pages[s])) for s in seq_ids)
        if need > len(self._free):
            raise RuntimeError(f"{fn}: needs {need} more pages, {len(self._free)} free")
        for s in seq_ids:
            pages = self._pages[s]
            while len(pages) * self.page_size < self._lens[s] + T:
                pages.append(self._free.pop(0))
                if self.rows is not None and s in self.rows:
                    self._table[self.rows.index(s), len(pages) - 1] = pages[-1]

    def append(self, seq_ids: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Writes ``k (B, Hkv, T, D)``, ``v (B, Hkv, T, Dv)`` after the keys of sequences ``seq_ids``."""
        seq_ids = [self._seq(s) for s in seq_ids]
        self._check_kv("PagedKVCache.append", len(seq_ids), k, v)
        T = k.shape[2]
        self._grow(seq_ids, T, "PagedKVCache.append")
        for b, s in enumerate(seq_ids):
            n0 = self._lens[s]
            pos = torch.arange(n0, n0 + T)
            pages = torch.tensor(self._pages[s], dtype=torch.int64)[pos // self.page_size].to(self.k_pages.device)
            slots = (pos % self.page_size).to(self.k_pages.device)
            self.k_pages[pages, slots] = k[b].transpose(0, 1).to(self.k_pages.dtype)
            self.v_pages[pages, slots] = v[b].transpose(0, 1).to(self.v_pages.dtype)
            self._lens[s] = n0 + T
            if self.rows is not None and s in self.rows:
                self.lengths[self.rows.index(s)] = n0 + T

    def block_table(self, seq_ids: Sequence[int]) -> Tensor:
        """int32 ``(B, max pages of these sequences)``, unused entries 0."""
        rows = [self._pages[self._seq(s)] for s in seq_ids]
        width = max(1, max(len(r) for r in rows))
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, r in enumerate(rows):
            table[b, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.k_pages.device)

    def seqlens(self, seq_ids: Sequence[int]) -> Tensor:
        return torch.tensor([self._lens[self._seq(s)] for s in seq_ids], dtype=torch.int32,
                            device=self.k_pages.device)

    def attention(self, q: Tensor, seq_ids: Sequence[int], **kwargs):
        """:func:`effattn.attention` of ``q (B, H, Lq, D)`` over these sequences' cached keys."""
        return paged_attention(q, self.k_pages, self.v_pages, block_table=self.block_table(seq_ids),
                               seqlens=self.seqlens(seq_ids), **kwargs)

    # ---- the nn modules' decoding loop ---------------------------------------------------------

    def bind(self, seq_ids: Sequence[int]) -> None:
        """Makes ``seq_ids`` the rows of the batch the attention modules pass (row b = ``seq_ids[b]``)."""
        seq_ids = [self._seq(s) for s in seq_ids]
        if not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"PagedKVCache.bind: seq_ids must be distinct sequence ids, got {seq_ids}")
        dev = self.k_pages.device
        table = torch.zeros(len(seq_ids), self.k_pages.shape[0], dtype=torch.int32)
        for b, s in enumerate(seq_ids):
            table[b, :len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        self.rows, self._table = seq_ids, table.to(dev)
        self.lengths = torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=dev)

    def reserve(self, n_tokens: int) -> None:
        """Pages for ``n_tokens`` more keys in every bound row, allocated now (before a CUDA graph
        capture whose replays write them)."""
        if self.rows is None:
            raise ValueError("PagedKVCache.reserve: no rows are bound; run a step (prefill) or bind(seq_ids) first")
        self._grow(self.rows, n_tokens, "PagedKVCache.reserve")

    def sync(self) -> None:
        """Reads the bound rows' device lengths back to the host's counts (a host sync): after CUDA
        graph replays, before eager steps, `append`, `free` or `seqlens`."""
        if self.rows is not None:
            for s, n in zip(self.rows, self.lengths.tolist()):
                self._lens[s] = n

    def write(self, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Writes a module step's keys ``(B, Hkv, T, D)`` / values after each bound row's keys, at the
        device lengths, and advances them; returns ``(block_table, seqlens)`` of the step's paged call.
        Binds ``B`` new sequences at the first step. No value is read back from the device."""
        fn = "PagedKVCache"
        self._check_kv(fn, k.shape[0] if self.rows is None else len(self.rows), k, v)
        if self.rows is None:
            self.bind([self.new_sequence() for _ in range(k.shape[0])])
        T = k.shape[2]
        self._grow(self.rows, T, fn)
        pos = self.lengths[:, None].to(torch.int64) + torch.arange(T, device=self.lengths.device)   # (B, T)
        page = self._table.gather(1, pos // self.page_size).to(torch.int64)
        slot = pos % self.page_size
        with torch.no_grad():
            self.k_pages[page, slot] = k.transpose(1, 2).to(self.k_pages.dtype)
            self.v_pages[page, slot] = v.transpose(1, 2).to(self.v_pages.dtype)
            self.lengths += T
        for s in self.rows:
            self._lens[s] += T
        width = max(1, max(len(self._pages[s]) for s in self.rows))
        return self._table[:, :width], self.lengths

    def held(self) -> int:
        """The most keys a bound row holds by the host's count (0 when none is bound)."""
        return max((self._lens[s] for s in self.rows), default=0) if self.rows is not None else 0

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kwargs):
        """A module step: `write` this step's keys/values, then the paged attention of ``q (B, H, T, D)``
        over the bound rows (``kwargs``: causal, window, scale, backend)."""
        table, lens = self.write(k, v)
        return paged_attention(q, self.k_pages, self.v_pages, block_table=table, seqlens=lens, check_values=False,
                               **kwargs)

    def preview(self, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """``(block_table, seqlens)`` that `write` of this step's ``k``, ``v`` would give, with nothing
        written or allocated here (``explain``): the host bookkeeping is copied, the pools are not."""
        new = PagedKVCache.__new__(PagedKVCache)
        new.__dict__.update(self.__dict__)
        new._free, new._pages, new._lens = list(self._free), {s: list(p) for s, p in self._pages.items()}, dict(self._lens)
        new._check_kv("PagedKVCache", k.shape[0] if self.rows is None else len(self.rows), k, v)
        if self.rows is None:
            new.bind([new.new_sequence() for _ in range(k.shape[0])])
        else:
            new.rows, new._table, new.lengths = list(self.rows), self._table.clone(), self.lengths.clone()
        new._grow(new.rows, k.shape[2], "PagedKVCache")
        width = max(1, max(len(new._pages[s]) for s in new.rows))
        return new._table[:, :width], new.lengths + k.shape[2]
