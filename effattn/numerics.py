"""Numeric conventions every backend shares (the kernels and the C++ binding mirror them): the
accumulation dtype, the base-2 exponent scale of the softmax kernels, and how a dropout mask is keyed
on the call's seed."""
from __future__ import annotations

from typing import Optional, Tuple

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


# the torch backend's dropout tiles: (absolute row, absolute key) tiles of DROP_TILE x DROP_TILE
DROP_TILE = 64
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def tile_keep(seed: Tensor, p: float, B: int, H: int, rows: Tuple[int, int], keys: Tuple[int, int],
              gather: Optional[Tensor] = None, heads: Optional[Tuple[int, int]] = None, device=None) -> Tensor:
    """The torch backend's dropout keep-mask ``(B, H, r1 - r0, k1 - k0)`` of rows ``[r0, r1)`` against
    keys ``[k0, k1)`` at their absolute positions (``gather``: only these keys of the range, int64
    positions on ``device``). The pairs are cut into absolute tiles of ``DROP_TILE`` rows and keys;
    tile (ti, tj) draws its ``(B * H, DROP_TILE, DROP_TILE)`` uniforms from a generator seeded by (the
    call's seed, ti, tj). A pair's draw thus does not depend on the chunk it is computed in: the
    backward regenerates the forward's mask and a chunk of a longer sequence (``positions``) draws
    what the whole sequence's call would, at about the cost of one ``torch.rand`` over the chunk. Not
    the kernels' Philox stream (20 wide multiplies per pair in torch ops): the torch and Triton
    backends drop different pairs. ``heads = (h0, Hg)``: the H heads are heads ``h0 .. h0 + H`` of
    ``Hg`` (a head shard): the tiles are drawn for all ``B * Hg`` and the shard's taken."""
    (r0, r1), (k0, k1) = rows, keys
    h0, hg = heads if heads is not None else (0, H)
    T = DROP_TILE
    ti0, tj0 = r0 // T, k0 // T
    nti, ntj = -(-r1 // T) - ti0, -(-k1 // T) - tj0
    u = torch.empty(B * hg, nti * T, ntj * T, device=device)
    if r1 > r0 and k1 > k0:
        s0, s1 = (int(x) for x in seed.tolist())
        base = _splitmix64((s0 << 32) ^ s1)
        g = torch.Generator(device=device)
        for a in range(nti):
            for b in range(ntj):
                g.manual_seed(_splitmix64(base ^ _splitmix64(((ti0 + a) << 32) ^ (tj0 + b))) >> 1)
                u[:, a * T:(a + 1) * T, b * T:(b + 1) * T] = torch.rand((B * hg, T, T), generator=g, device=device)
    u = u.view(B, hg, nti * T, ntj * T)[:, h0:h0 + H].reshape(B * H, nti * T, ntj * T)
    u = u[:, r0 - ti0 * T:r1 - ti0 * T]
    u = u[..., k0 - tj0 * T:k1 - tj0 * T] if gather is None else u.index_select(2, gather - tj0 * T)
    return u.view(B, H, r1 - r0, u.shape[-1]) >= p


def drop_threshold(p: float) -> int:
    """The kernels' integer dropout threshold: a 24-bit draw below it drops the pair."""
    return min(int(round(p * (1 << 24))), (1 << 24) - 1)
