"""Numeric conventions every backend shares (the kernels and the C++ binding mirror them): the
accumulation dtype, the base-2 exponent scale of the softmax kernels, and how a dropout mask is keyed
on the call's seed."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

# exp(x) = exp2(x * LOG2E): the kernels fold it into the score scale (one FMA per score) and divide
# the base-2 log-sum-exp by it on the way out (csrc/common mirrors it as kLog2e)
LOG2E = 1.4426950408889634


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of every backend: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def draw_seed() -> Tensor:
    """A call's dropout seed: int64 CPU ``(2,)``, drawn from torch's default generator so that
    ``torch.manual_seed`` makes dropout reproducible (a CPU tensor: no GPU sync)."""
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64)


def philox_key(seed: Tensor) -> int:
    """The kernels' 64-bit Philox key of a call's seed (one number per (b, h, i, j) drawn from it, so
    the backward regenerates the forward's mask whatever the tile sizes; csrc/binding derives the
    same key from the same seed tensor). Bit 62 set so that Triton always passes it as int64 (a value
    below 2**31 would be specialized as int32 and compile a second kernel)."""
    s0, s1 = (int(x) for x in seed.tolist())
    return ((s0 << 31) ^ s1) | (1 << 62)


_M0, _M1 = 0xD2511F53, 0xCD9E8D57          # Philox-4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85          # Philox-4x32 key increments (Weyl)
_LO32 = 0xFFFFFFFF


def _mulhilo(a: Tensor, m: int) -> Tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of ``a * m`` for int64 tensors ``a`` in [0, 2**32) and a 32-bit ``m``,
    through 16-bit halves of ``a`` so that no product leaves int64 (no overflow)."""
    x = (a & 0xFFFF) * m                    # < 2**48
    y = (a >> 16) * m + (x >> 16)           # < 2**49: the product is y * 2**16 + (x & 0xFFFF)
    return y >> 16, ((y & 0xFFFF) << 16) | (x & 0xFFFF)


def philox_keep(seed: Tensor, p: float, bh: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """The dropout keep-mask of the pairs ``(bh, rows, cols)`` (int64 tensors that broadcast together,
    ``bh = b * H + h``): keep iff ``(Philox(philox_key(seed); rows, cols, bh, 0)[0] >> 8) >= thresh``,
    the Triton kernels' ``dropout_keep`` and the CUDA kernels' ``dropout_keep`` word for word, so the
    torch reference drops the same pairs as they do. A counter per pair: the mask of a pair does not
    depend on the chunks or tiles it is computed in, and ``positions`` (absolute rows and columns)
    make a context-parallel chunk draw what the whole sequence would."""
    key = philox_key(seed)
    k0, k1 = key & _LO32, (key >> 32) & _LO32
    c0, c1, c2 = rows & _LO32, cols & _LO32, bh & _LO32
    c0, c1, c2 = torch.broadcast_tensors(c0, c1, c2)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _LO32, (k1 + _W1) & _LO32
    return (c0 >> 8) >= drop_threshold(p)


def drop_threshold(p: float) -> int:
    """The kernels' integer dropout threshold: a 24-bit draw below it drops the pair."""
    return min(int(round(p * (1 << 24))), (1 << 24) - 1)
