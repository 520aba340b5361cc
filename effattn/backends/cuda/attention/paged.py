"""The rows ``cuda/paged-decode`` and ``cuda/paged-prefill`` of op ``"paged_attention"``: the split-KV
decode kernels (csrc/attention/decode_kernels.cuh), for decode-shaped calls (``Lq <= 16``), and the
mma.sync forward (csrc/attention/paged_prefill.cuh: fwd.cuh's kernel with a paged row policy), for any
``Lq`` (chunked prefill), both reading keys and values from their pages in place through the block
table (vLLM's layout, `effattn.paged`).

Each block of the decode kernel works on one sequence: it reads ``seqlens[b]`` on the device and runs
the contiguous kernel's schedule over that many keys (queries bottom-right), loading key row ``t`` from
slot ``t % page_size`` of page ``block_table[b, t // page_size]``; rows past the sequence are zero-filled
without reading the table. The split count comes from shapes only (the table's capacity, or the
window's reach), so a step reads nothing back to the host (CUDA graphs). The prefill kernel's grid is
(query tiles of 64 rows, B, H) from shapes only, each block reading its ``seqlens[b]`` the same way.
Pools whose rows cp.async
cannot read (head dim not a multiple of 8, strided or unaligned rows) are refused, not copied: a copy of
the pool per step would cost more than the gather row's copy of the used pages.
"""
from __future__ import annotations

from typing import List

import torch

from ....paged import OP, kernel_scale
from ....splits import DECODE_MIN_KEYS, MAX_QUERIES, num_splits, sm_count
from ....tiles import cdiv
from ....visibility import Rule
from ...base import FEATURES, Capabilities, Path, register
from .. import _ext, resources
from . import decode
from .ops import DEVICES, DTYPES
from .tiling import BLOCK_M, bucket


def _reads_in_place(t: torch.Tensor) -> bool:
    """Whether the kernels read a pool's rows with 16-byte cp.async as it is (the binding's
    ``cp_async_rows``)."""
    return (t.stride(-1) == 1 and t.shape[-1] % 8 == 0 and t.data_ptr() % 16 == 0
            and all(s % 8 == 0 or n <= 1 for s, n in zip(t.stride()[:3], t.shape[:3])))


def key_tiles(call) -> int:
    """Key tiles of 64 the longest sequence may visit: the table's capacity, or the window's reach."""
    capacity = call.block_table.shape[1] * call.k_pages.shape[1]
    k0, k1 = Rule(call.q.shape[2], capacity, call.left, call.right).key_range(0, call.q.shape[2])
    return cdiv(k1, decode.BLOCK_N) - k0 // decode.BLOCK_N if k1 > k0 else 0


def plan(call):
    """(row tiles, key tiles, splits) of a paged call."""
    B, H, Lq = call.q.shape[:3]
    Hkv = call.k_pages.shape[2]
    row_tiles = cdiv((H // Hkv) * Lq, decode.ROWS)
    tiles = key_tiles(call)
    return row_tiles, tiles, num_splits(B, Hkv, row_tiles, tiles, sm_count(call.q.device, decode.EMU_SM_COUNT))


def _pool_refusals(call) -> List[str]:
    """Why the kernels cannot read the pools in place (empty: they can)."""
    return [f"{name} is read in place with 16-byte rows: needs a contiguous last dim that is a multiple of 8, "
            f"strides multiples of 8 and a 16-byte aligned base (head dim {t.shape[-1]}, strides {tuple(t.stride())})"
            for name, t in (("k_pages", call.k_pages), ("v_pages", call.v)) if not _reads_in_place(t)]


def _admits(call) -> List[str]:
    why = []
    Lq = call.q.shape[2]
    if Lq > MAX_QUERIES:
        why.append(f"Lq={Lq} not in 1..{MAX_QUERIES}: decode-shaped calls only (cuda/paged-prefill runs chunked "
                   f"prefill)")
    why += _pool_refusals(call)
    return why or decode.stages(call.q, call.v)[1]


def _notes(call) -> List[str]:
    """The copy of q the binding makes where cp.async cannot read its rows (the pools are never copied)."""
    q = call.q
    if q.numel() and (q.stride(-1) != 1 or q.shape[-1] % 8 or any(s % 8 for s in q.stride()[:3])):
        return [f"q is copied into zero-padded 16-byte rows (head dim {q.shape[-1]}, strides {tuple(q.stride())})"]
    return []


def _describe(call) -> str:
    row_tiles, tiles, splits = plan(call)
    G = call.q.shape[1] // call.k_pages.shape[2]
    return (f"paged split-KV decode: reads the key/value pages in place; {G} query heads x {call.q.shape[2]} row(s) "
            f"packed per KV head ({row_tiles} tile(s) of {decode.ROWS} rows), up to {tiles} key tiles of "
            f"{decode.BLOCK_N} in {splits} split(s) for {sm_count(call.q.device, decode.EMU_SM_COUNT)} SMs")


def run(call):
    splits = plan(call)[2]
    out, lse = decode.kernels(call.q.device).attention_decode_paged(
        call.q, call.k_pages, call.v, call.block_table.to(torch.int32), call.seqlens.to(torch.int32),
        kernel_scale(call), call.left, call.right, splits, decode.stages(call.q, call.v)[0])
    return (out, lse) if call.return_lse else out


def _rank(call) -> int:
    """Ahead of ``triton/paged`` (10) for a cache of at least `DECODE_MIN_KEYS` keys (the split-KV plan's
    threshold, as ``cuda/decode``), after it below that."""
    return 5 if call is not None and key_tiles(call) * decode.BLOCK_N >= DECODE_MIN_KEYS else 15


PATH = register(Path(
    backend="cuda", op=OP, name="cuda/paged-decode", priority=_rank,
    caps=Capabilities(devices=DEVICES, dtypes=DTYPES, features=FEATURES[OP]), run=run, admits=_admits,
    available=_ext.available, notes=_notes, describe=_describe, explicit_only_devices=frozenset({"cpu"})))


# ------------------------------------------------------------------------------- cuda/paged-prefill

def _prefill_admits(call) -> List[str]:
    hd = bucket(call.q.shape[-1], call.v.shape[-1])
    return _pool_refusals(call) or resources.refusals([resources.Need("paged prefill forward", resources.fwd_smem(hd))],
                                                      resources.device_limits(call.q.device))


def _prefill_describe(call) -> str:
    B, H, Lq = call.q.shape[:3]
    capacity = call.block_table.shape[1] * call.k_pages.shape[1]
    return (f"paged prefill forward (mma.sync): reads the key/value pages in place, {cdiv(Lq, BLOCK_M)} query "
            f"tile(s) of {BLOCK_M} rows x {B * H} (batch, head), each over its sequence's seqlens[b] keys (up to "
            f"{capacity}) read on the device")


def _prefill_run(call):
    out, lse = decode.kernels(call.q.device).attention_prefill_paged(
        call.q, call.k_pages, call.v, call.block_table.to(torch.int32), call.seqlens.to(torch.int32),
        kernel_scale(call), call.left, call.right)
    return (out, lse) if call.return_lse else out


def _prefill_rank(call) -> int:
    """After ``triton/paged`` (10) until a GPU run has measured it, as ``cuda/prefill`` after Triton's rows;
    after ``cuda/paged-decode`` (5 / 15), which serves decode-shaped calls better."""
    return 16


PREFILL_PATH = register(Path(
    backend="cuda", op=OP, name="cuda/paged-prefill", priority=_prefill_rank,
    caps=Capabilities(devices=DEVICES, dtypes=DTYPES, max_head_dim=256, features=FEATURES[OP]), run=_prefill_run,
    admits=_prefill_admits, available=_ext.available, notes=_notes, describe=_prefill_describe,
    explicit_only_devices=frozenset({"cpu"})))
