"""The CUDA backend's split-KV decode path: a few query rows (Lq <= 16) against a long key/value
cache, forward only (kernels in csrc/attention/decode_kernels.cuh, work split in csrc/attention/decode.h).

One thread block per (batch, KV head, 16-row tile of packed rows, split of the key range): the
G = H / Hkv query heads sharing a KV head and their Lq rows fill the rows of one tensor-core tile
(H=32, Hkv=8, Lq=1: 4 real rows of 16), so each KV head's cache is read once, not G times. The
visible key tiles (64 keys) are cut into splits so that the grid holds at least two waves of the
GPU's SMs, with at least `MIN_TILES_PER_SPLIT` tiles each; each split writes an fp32 partial output
and log-sum-exp, merged by a second kernel with log-sum-exp weights. Deterministic.

The row ``cuda/decode`` takes decode-shaped calls (`effattn.splits.decode_reasons`); it ranks ahead of
Triton's rows once the call sees `effattn.splits.DECODE_MIN_KEYS` keys, after ``triton/prefill``
below that (the split-KV plan's one threshold), and before ``cuda/prefill`` always.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ....splits import MAX_QUERIES, MAX_SPLITS, MIN_TILES_PER_SPLIT, decode_reasons, long_cache, num_splits, sm_count  # noqa: F401
from ....tiles import cdiv, layout_plan, layout_tile_lists
from ....visibility import Rule, clamp_window
from ...base import PACKED_FEATURES, Capabilities, Path, register
from .. import _ext, resources
from . import cpp, ops
from . import score as score_path
from .tiling import bucket

ROWS = 16                 # packed rows per block (csrc/decode.h kDecodeRows)
BLOCK_N = 64              # keys per tile (kDecodeBlockN)
EMU_SM_COUNT = 8          # the SMs the emulation plans for (CPU tensors): small, so tests cross split edges


def _lists(q, k, layout_mask, layout_block, left, right):
    """(lists, wf, layout_check) for a layout: the tile lists of query tile 0 (all Lq <= 16 rows)
    per KV head. A per-head layout under GQA is OR-ed over each group (cached with the layout), and
    layout_check 2 then masks full tiles too (full for the group is not full for each head)."""
    if layout_mask is None:
        return None, 0, 0
    Lq, Lk = q.shape[2], k.shape[2]
    H, Hkv = q.shape[1], k.shape[1]
    left, right = clamp_window(left, right, Lq, Lk)
    mask, check = layout_mask, 1
    if layout_mask.shape[0] > 1 and H != Hkv:
        cache = layout_plan(layout_mask).backend_cache
        mask = cache.get(("cuda-decode-group", Hkv))
        if mask is None:
            mask = cache[("cuda-decode-group", Hkv)] = layout_mask.reshape(Hkv, H // Hkv, *layout_mask.shape[1:]).any(1)
        check = 2
    lists, wf = layout_tile_lists(mask, layout_block, Lq, Lk, ROWS, BLOCK_N, left, right)
    return lists, wf, check


def _key_tiles(Lq, Lk, left, right, lists) -> int:
    """Visible key tiles of one KV head (with a layout's `lists`: the widest list row, an upper bound)."""
    if lists is not None:
        return lists.shape[-1] - 2
    k0, k1 = Rule(Lq, Lk, left, right).key_range(0, Lq)
    return cdiv(k1, BLOCK_N) - k0 // BLOCK_N if k1 > k0 else 0


def _plan(q, k, lists, left, right) -> Tuple[int, int, int]:
    """(row tiles, key tiles, splits) of a call with q (B, H, Lq, D), k (B, Hkv, Lk, D)."""
    B, H, Lq = q.shape[:3]
    Hkv, Lk = k.shape[1], k.shape[2]
    row_tiles = cdiv((H // Hkv) * Lq, ROWS)
    tiles = _key_tiles(Lq, Lk, left, right, lists)
    return row_tiles, tiles, num_splits(B, Hkv, row_tiles, tiles, sm_count(q.device, EMU_SM_COUNT))


def plan(call) -> Tuple[int, int, int]:
    """(row tiles, key tiles, splits) the decode kernels use for `call`."""
    lay = call.layout
    lists = None
    if lay is not None:
        lists, _, _ = _lists(call.q, call.k, lay.mask, lay.block_size, call.window_left, call.window_right)
    return _plan(call.q, call.k, lists, call.window_left, call.window_right)


def stages(q: Tensor, v: Tensor) -> Tuple[int, List[str]]:
    """(K/V stages of the decode kernel for q, v on their device, []), or (0, why none launches there):
    two (the next tile in flight), one at head dim 256 where two exceed the shared memory per block
    (sm_86 / sm_89 / sm_120: 99 KB against 136 KB)."""
    return resources.decode_stages(bucket(q.shape[-1], v.shape[-1]), resources.device_limits(q.device))


def describe(call) -> str:
    """The split-KV plan for `call` (detail in explain)."""
    row_tiles, tiles, splits = plan(call)
    G = call.H // call.Hkv
    n = stages(call.q, call.v)[0]
    buffers = "double-buffered" if n == 2 else (f"single-buffered (two stages need {resources.decode_smem(256, 2)} "
                                                f"bytes of shared memory per block, more than the GPU allows)")
    return (f"split-KV decode: {G} query heads x {call.Lq} row(s) packed per KV head ({row_tiles} tile(s) of "
            f"{ROWS} rows), {tiles} key tiles of {BLOCK_N} in {splits} split(s) for "
            f"{sm_count(call.q.device, EMU_SM_COUNT)} SMs, K/V {buffers}")


def _admits(call) -> List[str]:
    why = decode_reasons(call)
    return why or stages(call.q, call.v)[1]


# ------------------------------------------------------------------------------------------- ops

_FAKES_DONE = set()


def kernels(device: torch.device):
    """The C++ op namespace for `device`, the fake kernels of the decode ops (contiguous and paged) and of
    the paged prefill registered once."""
    lib = cpp.kernels(device)
    ns = "effattn_cuda" if device.type == "cuda" else "effattn_cuda_emu"
    if ns not in _FAKES_DONE:
        def fake(q, k, v, *args):
            B, H, Lq, _ = q.shape
            return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)
        torch.library.register_fake(f"{ns}::attention_decode")(fake)
        torch.library.register_fake(f"{ns}::attention_decode_paged")(fake)
        torch.library.register_fake(f"{ns}::attention_prefill_paged")(fake)
        _FAKES_DONE.add(ns)
    return lib


def _decode(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
            key_padding_mask: Optional[Tensor], scale: float, window_left: int, window_right: int,
            splits: int) -> Tuple[Tensor, Tensor]:
    """(out (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq) fp32) of a forward-only decode call, the key
    range cut into `splits` runs of tiles (0: the plan's count, chosen here, where the layout's
    lists are at hand and torch.compile does not trace). No autograd."""
    lists, wf, check = _lists(q, k, layout_mask, layout_block, window_left, window_right)
    if splits == 0:
        splits = _plan(q, k, lists, window_left, window_right)[2]
    n, why = stages(q, v)
    if not n:
        raise RuntimeError(f"effattn cuda decode: {'; '.join(why)}")
    return kernels(q.device).attention_decode(q, k, v, key_padding_mask, layout_mask, layout_block, check, lists, wf,
                                              scale, *clamp_window(window_left, window_right, q.shape[2], k.shape[2]),
                                              splits, n)


# the same as a custom op, opaque to torch.compile; eager calls skip its wrapper (a decode step is
# short enough for that to show)
cuda_attention_decode = torch.library.custom_op("effattn::cuda_attention_decode", _decode, mutates_args=())


@cuda_attention_decode.register_fake
def _(q, k, v, layout_mask, layout_block, key_padding_mask, scale, window_left, window_right, splits):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)


def run(call):
    a = call.op_args()
    fn = cuda_attention_decode if torch.compiler.is_compiling() else _decode
    return fn(a.q, a.k, a.v, a.layout_mask, a.layout_block, a.key_padding_mask, a.scale, a.window_left,
              a.window_right, 0)


def _rank(call) -> int:
    """Ahead of Triton's rows for a call that sees `DECODE_MIN_KEYS` keys (the split-KV kernels read
    K/V once per KV head and fill the GPU while a 64-row prefill tile holds one real row), after
    ``triton/prefill`` below that; before ``cuda/prefill`` always."""
    return 5 if long_cache(call) else 15


PATH = register(Path(
    backend="cuda", op="attention", name="cuda/decode", priority=_rank,
    # no score terms in the split-KV kernels; packed sequences, positions and fp32 outputs are the prefill
    # kernels' (cuda/prefill serves those calls)
    caps=Capabilities(devices=ops.DEVICES, dtypes=ops.DTYPES,
                      features=ops.FEATURES - score_path.FEATURES - PACKED_FEATURES), run=run,
    admits=_admits, available=_ext.available, notes=ops.notes, describe=describe,
    explicit_only_devices=frozenset({"cpu"})))
