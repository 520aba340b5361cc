"""Which forward kernel the CUDA backend runs: the Hopper one (csrc/attention/fwd_sm90.cuh, sm_90a: two
warpgroups per 128-row query tile, asynchronous wgmma from 128-byte-swizzled shared memory, K and V
double-buffered) or the FA2-class mma.sync one (csrc/attention/fwd.cuh).

The Hopper forward serves head-dim buckets 64 and 128 (``max(D, Dv)`` in 33..128), bf16 and fp16,
every mask and the score terms softcap, sinks and ALiBi (not packed sequences, relative tables, adaptive
span or dense bias tensors: the mma.sync forward serves those), on a GPU of compute capability 9.0 when the extension was built with sm_90a code
(setup.py: ``TORCH_CUDA_ARCH_LIST`` containing ``9.0a``, or unset with nvcc >= 12). The backward is
an mma.sync one, or on the same devices the Hopper backward where it applies (`backward`). Under the emulation (CPU tensors, ``EFFATTN_CUDA_EMU=1``) the Hopper
forward runs when ``EFFATTN_CUDA_EMU_HOPPER=1``, as a compute-capability 9.0 device would run it.
Two Hopper kernels: the warp-specialized one (csrc/attention/fwd_sm90_tma.cuh: a producer warpgroup loads Q,
K and V with TMA into a two-stage mbarrier ring, two consumer warpgroups run wgmma in ping-pong turns on
128 x 128 tiles, every mask kind: key padding, positions, dropout and layouts too, a layout's tile lists built
for its 128-key tiles) serves every call whose tensors TMA can describe (bases and batch / head / row strides
multiples of 16 bytes, as the binding aligns them); the cp.async one (fwd_sm90.cuh, 128 x 64 tiles) serves calls
without keys and every call with ``EFFATTN_CUDA_HOPPER_TMA=0`` (`loads` says which).
``EFFATTN_CUDA_HOPPER=0`` turns the Hopper forward off everywhere (the mma.sync forward serves: for
timing one against the other on the same GPU, or to step around it).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ....tiles import visited_tiles
from ....visibility import clamp_window
from .. import _ext, resources
from .tiling import bucket

HEAD_DIM_BUCKETS = (64, 128)
_built = {}


def _has_sm90a(device: torch.device) -> bool:
    if device.type not in _built:
        _built[device.type] = bool(_ext.ops(device).has_sm90a())
    return _built[device.type]


def why_not(q: torch.Tensor, v: torch.Tensor, packed: bool = False, terms: bool = False) -> Optional[str]:
    """None if the Hopper forward serves a call with these q, v (``packed``: with cu_seqlens; ``terms``:
    with a relative table, adaptive span or a dense bias); else why the mma.sync forward does."""
    device = q.device
    if packed:
        # a segment view in the Hopper kernel took its D=128 instances from 168 to 192-203 registers
        # (offline sm_90a compile), 3 -> 2 blocks per SM for every call; packed calls take mma.sync
        return "packed sequences (cu_seqlens) run on the mma.sync forward"
    if terms:
        # the Hopper kernel has no instances with the bias tensors' code (csrc/attention/terms.cu): they
        # would add Hopper instances past its kernel budget, and its register room is 192 at D=128
        return ("relative tables, adaptive span and dense bias tensors run on the mma.sync forward's instances "
                "with bias tensors")
    if os.environ.get("EFFATTN_CUDA_HOPPER") == "0":
        return "turned off by EFFATTN_CUDA_HOPPER=0"
    why = device_why_not(device)
    if why is not None:
        return why
    hd = bucket(q.shape[-1], v.shape[-1])
    if hd not in HEAD_DIM_BUCKETS:
        return f"serves head dims 33..128 (buckets 64, 128), this call's bucket is {hd}"
    return None


def device_why_not(device: torch.device) -> Optional[str]:
    """None if `device` runs sm_90a kernels of this build (the Hopper forward and backward), else why not."""
    if device.type == "cpu":
        if os.environ.get("EFFATTN_CUDA_EMU_HOPPER") != "1":
            return "the emulation runs it only with EFFATTN_CUDA_EMU_HOPPER=1"
    else:
        cc = torch.cuda.get_device_capability(device)
        if tuple(cc) != (9, 0):
            return f"needs compute capability 9.0 (sm_90a), got {cc[0]}.{cc[1]}"
        if not _has_sm90a(device):
            return "the extension was built without sm_90a code (TORCH_CUDA_ARCH_LIST without 9.0a, or nvcc < 12)"
    return None


def tma_why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """None if the Hopper forward's TMA kernel serves these tensors, else why its cp.async kernel does. The
    launcher (csrc/attention/fwd_sm90.cu) takes the TMA kernel when the tensor maps encode: bases and strides
    multiples of 16 bytes, which the binding's row alignment (a padded copy otherwise) already gives. A layout's
    lists follow this answer (128-key tiles when None); the launcher refuses a call with lists whose maps fail."""
    if os.environ.get("EFFATTN_CUDA_HOPPER_TMA") == "0":
        return "EFFATTN_CUDA_HOPPER_TMA=0"
    if k.shape[2] == 0:
        return "no keys"
    return None


def loads(call) -> str:
    """How the Hopper forward loads its tiles for a call, in words."""
    why = tma_why_not(call.q, call.k, call.v)
    if why is None:
        return ("TMA loads by a producer warpgroup into a 2-stage mbarrier ring, 2 consumer warpgroups in ping-pong "
                "(named barriers), 128 x 128 tiles")
    return f"cp.async loads by both warpgroups, 128 x 64 tiles (the TMA kernel is not used: {why})"


def describe(call, terms: bool = False) -> str:
    """Which kernels serve a call (for effattn.explain; ``terms``: as `why_not`)."""
    why = why_not(call.q, call.v, packed=call.cu_seqlens is not None, terms=terms)
    if why is None:
        return f"forward: Hopper wgmma kernel (sm_90a), {loads(call)}"
    return f"forward: mma.sync kernel, {mma_tile(call, terms)} (the Hopper forward is not used: {why})"


def mma_tile(call, terms: bool = False) -> str:
    """The mma.sync forward's tile for a call on its device (resources.fwd_rows), in words."""
    hd = bucket(call.q.shape[-1], call.v.shape[-1])
    limits = resources.device_limits(call.q.device)
    no_window = call.window_left < 0 and call.window_right < 0
    lay = call.layout
    # a layout takes 128 rows through its lists' 128-row tiles' rows (fwd.cuh fwd_layout_wide); at head dim 128 on
    # the 128 x 64 tile (its lists' key tiles), kLayout's without dropout (no key padding), where it fits
    lay_wide = lay is not None and resources.layout_wide(hd, limits, call.key_padding_mask is not None,
                                                         bool(call.dropout_p))
    rows = resources.fwd_rows(hd, limits, lay is not None and not lay_wide, terms)
    # the kinds kDense (Lk a multiple of 64; at Lk % 64 == 32 kDense's key tiles of 32 are full, 64 would not be),
    # kCausal and kWindow (a ragged Lk too) without dropout or key padding, and kLayout (launch.cuh kLongKeys)
    dense = no_window and call.cu_seqlens is None
    long_keys = lay_wide or (not call.dropout_p and call.key_padding_mask is None and lay is None and not terms
                             and not (dense and call.k.shape[2] % 64 == 32))
    keys = resources.fwd_key_tile(hd, rows, limits, long_keys)
    steps = " (two softmax steps of 32)" if rows == 128 and hd == 128 and keys == 64 else ""
    return f"query tiles of {rows} rows (4 warps x {rows // 4}), key tiles of {keys}{steps}{_layout_why(call, hd, rows, terms)}"


def _layout_why(call, hd: int, rows: int, terms: bool) -> str:
    """Why a block layout's call runs the query tile it runs (fwd.cuh fwd_wide), in words ('' without a layout)."""
    lay = call.layout
    if lay is None:
        return ""
    if rows == 128:
        how = ("both 64-row halves in one block row" if lay.block_size % 128 == 0 else
               "partial tiles read the layout per element")
        Lq, Lk = call.q.shape[2], call.k.shape[2]
        left, right = clamp_window(call.window_left, call.window_right, Lq, Lk)
        pairs = [sum(visited_tiles(Lq, Lk, m, 64, left, right, lay.mask, lay.block_size)) for m in (64, 128)]
        more = f"{2 * pairs[1] / pairs[0] - 1:.0%}" if pairs[0] else "0%"
        return (f"; layout of {lay.block_size}-row blocks on 128-row tiles: each tile's key list is the union of "
                f"its two 64-row halves' lists ({how}; {more} more rows x keys computed than on 64-row tiles)")
    if hd not in resources.WIDE_BUCKETS:
        why = f"head dim {hd} has no 128-row instance"
    elif terms:
        why = "the instance with bias tensors has 64-row tiles only"
    elif hd >= 128 and (call.key_padding_mask is not None or call.dropout_p):
        why = "at head dim 128 only the 128 x 64 tile without key padding or dropout reads a layout's 128-row lists"
    else:
        why = f"two 128-row blocks ({'128 x 64 ' if hd >= 128 else ''}tiles) do not fit an SM of this device"
    return f"; layout on 64-row tiles: {why}"
