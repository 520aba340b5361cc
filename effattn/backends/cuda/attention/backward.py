"""Which backward the CUDA backend runs: the fused five-product kernel (csrc/attention/bwd_fused.cuh:
dK, dV and dQ in one kernel of 8 warps on 64 x 128 tiles, dQ added in key-tile order under a semaphore
per query tile) or the two-pass kernels (csrc/attention/bwd.cuh: a dK/dV pass and a dQ pass that
recomputes S and dP, seven products).

The fused kernel serves head-dim buckets 32, 64 and 128 without a block layout, bias tensors
(relative tables, adaptive span, dense bias) or the ALiBi slope gradient, on a device whose shared
memory per block holds its tiles (`resources.bwd_fused_smem`: 145 KB at head dim 128, more than the
99 KB of sm_86 / sm_89 / sm_120); the two-pass kernels serve the rest. ``EFFATTN_CUDA_FUSED_BWD=0``
turns it off (for timing one against the other on the same GPU, or to step around it).

On a device that runs the Hopper forward (compute capability 9.0 with sm_90a code; the emulation with
``EFFATTN_CUDA_EMU_HOPPER=1``) the Hopper backward (csrc/attention/bwd_sm90.cuh: the fused kernel's tiles,
schedule and dQ semaphores with its five products on wgmma, two consumer warpgroups of 64 keys, a producer
warp loading K, V, Q and dO with TMA into an mbarrier ring) replaces the fused
kernel where it applies (`hopper_why_not`): head-dim buckets 64 and 128, no mask or a causal / window one,
without key padding, dropout, packed sequences or score terms. ``EFFATTN_CUDA_HOPPER_BWD=0`` turns it off.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .. import resources
from . import hopper
from .tiling import bucket

HEAD_DIM_BUCKETS = (32, 64, 128)


def why_not(q: torch.Tensor, v: torch.Tensor, layout: bool, alibi_grad: bool = False,
            terms: bool = False) -> Optional[str]:
    """None if the fused backward serves a call with these q, v (``layout``: a block layout;
    ``alibi_grad``: the ALiBi slopes' gradient; ``terms``: bias tensors); else why the two passes do."""
    if os.environ.get("EFFATTN_CUDA_FUSED_BWD") == "0":
        return "turned off by EFFATTN_CUDA_FUSED_BWD=0"
    hd = bucket(q.shape[-1], v.shape[-1])
    if hd not in HEAD_DIM_BUCKETS:
        return f"serves head dims up to 128 (buckets 32, 64, 128), this call's bucket is {hd}"
    if layout:
        return "block layouts: their tile lists are built for the two passes' tiles"
    if terms:
        return "relative tables, adaptive span and dense bias tensors: the two passes' instances with bias tensors"
    if alibi_grad:
        return "the ALiBi slope gradient: partial sums per query tile, from the dQ pass"
    why = resources.refusals(resources.fused_bwd_needs(hd), resources.device_limits(q.device))
    return why[0] if why else None


def hopper_why_not(q: torch.Tensor, v: torch.Tensor, key_padding: bool, dropout_p: float, packed: bool,
                   score: bool = False) -> Optional[str]:
    """None if the Hopper backward serves a call that the fused backward serves (`why_not` is None), with
    these q, v (``key_padding``: a key padding mask; ``packed``: cu_seqlens; ``score``: score terms); else
    why the fused kernel runs."""
    if os.environ.get("EFFATTN_CUDA_HOPPER_BWD") == "0":
        return "turned off by EFFATTN_CUDA_HOPPER_BWD=0"
    why = hopper.device_why_not(q.device)
    if why is not None:
        return why
    hd = bucket(q.shape[-1], v.shape[-1])
    if hd not in hopper.HEAD_DIM_BUCKETS:
        return f"serves head dims 33..128 (buckets 64, 128), this call's bucket is {hd}"
    for flag, what in ((key_padding, "key padding"), (dropout_p > 0, "dropout"), (packed, "packed sequences"),
                       (score, "score terms")):
        if flag:
            return f"serves no mask, causal and windows without key padding, dropout, packed sequences or score " \
                   f"terms; this call has {what}"
    why = resources.refusals(resources.hopper_bwd_needs(hd), resources.device_limits(q.device))
    return why[0] if why else None


def describe(why: Optional[str], hopper_why: Optional[str] = "") -> str:
    """The backward a call gets, from `why_not`'s and `hopper_why_not`'s answers (for effattn.explain)."""
    if why is None and hopper_why is None:
        return ("backward: Hopper wgmma kernel (sm_90a; five products on wgmma, two consumer warpgroups of 64 keys, "
                "64 x 128 tiles, dQ in key-tile order; a producer warp loads K, V and a 2-stage mbarrier ring of Q, "
                "dO with TMA)")
    if why is None:
        tail = f" (the Hopper backward is not used: {hopper_why})" if hopper_why else ""
        return ("backward: fused dK/dV/dQ kernel (five products, 64 x 128 tiles, 8 warps, dQ in key-tile order)"
                + tail)
    return f"backward: dK/dV and dQ passes (seven products; the fused backward is not used: {why})"
