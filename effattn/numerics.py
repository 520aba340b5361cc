"""Numeric conventions every backend shares (the kernels and the C++ binding mirror them): the
accumulation dtype, the base-2 exponent scale of the softmax kernels, and how a dropout mask is keyed
on the call's seed."""
from __future__ import annotations

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


def chunk_generator_seed(seed: Tensor, i0: int) -> int:
    """The torch reference's generator seed for the query chunk starting at row ``i0`` (its backward
    regenerates the forward's mask chunk by chunk)."""
    s0, s1 = (int(x) for x in seed.tolist())
    return (s0 * 1_000_003 + s1 * 7919 + i0) % (2**63 - 1)
