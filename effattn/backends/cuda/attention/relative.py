"""The row ``cuda/relative`` of op ``"relative_attention"``: the CUDA C++ kernels with relative keys
(`effattn.bias.RelativeKeys`; csrc/attention/relkeys.cu, ``relk_add`` in csrc/attention/fwd.cuh; the backward in
csrc/attention/relkeys_bwd.cu). Per (query tile, key tile) pair the forward loads the band of ``r`` rows the
pair's distances clamp to, multiplies each warp's query rows with its part of the band on the tensor cores (one
extra product per tile) and adds element ``(i, j)`` from column ``i - j + const`` of that product: the relative
shift done in the tile, never an ``(Lq, Lk)`` or ``(Lq, n_dist)`` matrix. Causal, windows, key padding and GQA
as the forward; any ``query`` (Transformer-XL's ``q + v_bias``) or q itself.

Backward (head dims up to 128): Delta, a dQ pass that also gives ``query``'s gradient (dT written skewed into
the band, times the band of r), a dK/dV pass (the term's tile per pair, read skewed) and a distance-band pass
for ``r`` (per block of distances and head, the batch and the query tiles summed in a fixed order: no
atomics); the per-distance sums are folded onto the rows of ``r`` here (`fold_distances`). Dropout is
refused (``torch/relative`` serves it), as are gradients at head dims above 128.
"""
from __future__ import annotations

from typing import List

import torch

from ....relative import FN, fold_distances, stash, stashed
from ...base import FEATURES, Capabilities, Path, register
from .. import _ext, resources
from . import cpp
from .ops import DEVICES, DTYPES
from .tiling import bucket

BACKWARD_HEAD_DIM = ("gradients at head dims above 128: the CUDA C++ backward of relative keys serves head dims up "
                     "to 128 (triton/relative and torch/relative serve the call)")


def _needs_grad(call) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (call.q, call.k, call.v, call.r, call.query))


def _admits(call) -> List[str]:
    why = []
    hd = bucket(call.q.shape[-1], call.v.shape[-1])
    needs = [resources.Need("relative-keys forward", resources.relk_smem(hd))]
    if _needs_grad(call):
        if hd > 128:
            why.append(BACKWARD_HEAD_DIM)
        else:
            needs += [resources.Need(f"relative-keys backward ({name})", size)
                      for name, size in resources.relk_bwd_smem(hd).items()]
    return why + resources.refusals(needs, resources.device_limits(call.q.device))


class _RelativeCuda(torch.autograd.Function):
    """The CUDA C++ kernels with relative keys, forward and backward. ``given``: whether ``query`` is a tensor of
    its own (else it is q, and its gradient is part of q's)."""

    @staticmethod
    def forward(ctx, q, k, v, r, query, given, M, left, right, kpm, scale):
        out, lse = cpp.kernels(q.device).attention_fwd_relk(q, k, v, kpm, scale, left, right, r,
                                                            query if given else None, -1 if M is None else M)
        ctx.given = given
        return stash(ctx, q, k, v, r, query, out, lse, M, left, right, kpm, scale)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, r, query, out, lse, M, left, right, kpm, scale = stashed(ctx)
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dquery, gd = cpp.kernels(q.device).attention_bwd_relk(
            dout, dlse, q, k, v, out, lse, kpm, scale, left, right, r, query if ctx.given else None,
            -1 if M is None else M)
        dr = fold_distances(gd, q.shape[2], r.shape[1], M).to(r.dtype)
        return dq, dk, dv, dr, (dquery if ctx.given else None), None, None, None, None, None, None


def run(call):
    a = call.attn.op_args()
    return _RelativeCuda.apply(call.q, call.k, call.v, call.r, call.query, call.query is not call.q, call.max_distance,
                               a.window_left, a.window_right, a.key_padding_mask, a.scale)


PATH = register(Path(
    backend="cuda", op=FN, name="cuda/relative", priority=20,
    caps=Capabilities(devices=DEVICES, dtypes=DTYPES, features=FEATURES[FN] - {"dropout"}), run=run, admits=_admits,
    available=_ext.available, explicit_only_devices=frozenset({"cpu"}),
    describe=lambda call: ("CUDA C++ forward and backward: the band of r per tile pair, one extra product per tile, "
                           "the relative shift in the tile; r's gradient by a distance-band pass, no atomics")))
