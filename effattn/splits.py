"""The split-KV plan, beside the tile plan (`effattn.tiles`): which calls the split-KV decode paths
(``triton/decode``, ``cuda/decode``) admit, how many splits of the key range their kernels run, and
the GPU's SM count every planner reads.

A decode-shaped call is a few query rows (``Lq <= MAX_QUERIES``) that need no gradient and no
dropout (the decode kernels are forward only). Its visible keys (the window bound of the visibility
rule; the layout is not consulted) are cut into splits; each split writes an fp32 partial output and
log-sum-exp, merged in a fixed order (deterministic): by the last split to finish in the Triton
decode, by a second kernel in the CUDA one.
"""
from __future__ import annotations

import functools
from typing import List, Tuple

import torch

from ._call import forward_only_reason
from .tiles import cdiv
from .visibility import Rule

MAX_QUERIES = 16          # Lq above this fills a prefill kernel's query tiles anyway (csrc/decode.h kDecodeMaxQueries)
MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in its partial than it saves (both kernels:
                          # Triton's key splits, CUDA's MIN_TILES_PER_SPLIT = 4 tiles of 64 keys)
# Visible keys from which a split-KV decode is worth the fp32 partials' trip
# through memory: room for 4 splits of the shortest useful split. Below that the prefill kernels walk
# at most 16 key tiles per program (a few microseconds on an H100) and the split path has too few
# splits to fill the GPU. One threshold for both backends (the Triton planner said 1024 visible keys,
# the CUDA ranking 512 cache keys: 4 x 256 = 1024 is the first that gives the split path 4 splits); the
# GPU suite's decode rows are where the crossover is to be measured.
DECODE_MIN_KEYS = 4 * MIN_KEYS_PER_SPLIT
WAVES = 2                 # splits enough for this many waves of programs over the SMs


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_gpu: int = 0) -> int:
    """The SMs of a CUDA `device` (read once per device); off the GPU there is nothing to ask and
    the caller's ``off_gpu`` is what its plan assumes (0: no split)."""
    if device.type != "cuda":
        return off_gpu
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def key_range(Lq: int, Lk: int, left: int) -> Tuple[int, int]:
    """Keys ``[k_lo, k_hi)`` some query of a decode call may see: bottom-right, the last query sits at
    key ``Lk - 1``, so a right bound never cuts the range; a left window starts it at ``pos(0) - left``."""
    return Rule(Lq, Lk, left).key_range(0, Lq)


def visible_keys(call) -> int:
    k_lo, k_hi = key_range(call.Lq, call.Lk, call.window_left)
    return max(k_hi - k_lo, 0)


def decode_reasons(call) -> List[str]:
    """Why a call is not decode-shaped (the reasons both split-KV decode rows share): empty = it is."""
    if call.Lq > MAX_QUERIES:
        return [f"Lq={call.Lq} not in 1..{MAX_QUERIES}"]
    why = forward_only_reason(call)
    return [why] if why else []


def long_cache(call) -> bool:
    """Whether a call sees at least `DECODE_MIN_KEYS` keys (see there)."""
    return call is not None and visible_keys(call) >= DECODE_MIN_KEYS


def plan_splits(slices: int, span: int, num_sms: int, block_n: int,
                min_keys: int = MIN_KEYS_PER_SPLIT) -> Tuple[int, int]:
    """The Triton decode's ``(n_splits, keys_per_split)`` for ``slices`` = B * Hkv programs per split over
    ``span`` keys, ``keys_per_split`` a multiple of ``block_n`` (the last split may be shorter, never empty):
    the most splits whose programs fit `WAVES` waves over ``num_sms`` SMs (at least one), at most
    ``span // min_keys`` of them, the split length rounded up to whole key tiles (so that rounding
    never adds a split: 8 slices on 132 SMs over 16k keys give 32 splits of 512 keys, 256
    programs, where rounding down gave 37 splits, 296 programs)."""
    want = max(1, (WAVES * num_sms) // max(slices, 1))
    n = max(1, min(want, span // max(min_keys, 1)))
    per = max(block_n, cdiv(cdiv(span, n), block_n) * block_n)
    return max(1, cdiv(span, per)), per


MIN_TILES_PER_SPLIT = 4   # the CUDA decode's key tiles (64 keys) per split: MIN_KEYS_PER_SPLIT keys
MAX_SPLITS = 128          # the CUDA decode's splits at most (csrc/decode.h)


def num_splits(B: int, Hkv: int, row_tiles: int, key_tiles: int, sms: int) -> int:
    """The CUDA decode's splits of `key_tiles` visible key tiles so that B * Hkv * row_tiles * splits
    blocks hold `WAVES` waves of `sms` SMs, each split keeping at least `MIN_TILES_PER_SPLIT` tiles."""
    want = cdiv(WAVES * sms, max(B * Hkv * row_tiles, 1))
    if want <= 1 or key_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    per = max(MIN_TILES_PER_SPLIT, key_tiles // want)
    return min(cdiv(key_tiles, per), MAX_SPLITS)
