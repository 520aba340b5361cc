"""The row ``triton/relative`` of op ``"relative_attention"``: the fused forward and backward
(``kernels.py``, launched from ``launch.py``: the position term per tile, no (Lq, Lk) matrix; r's
gradient by a distance-band pass, no atomics). No dropout (the torch row serves it)."""
from __future__ import annotations

import torch

from ....relative import FN, stash, stashed
from ...base import FEATURES
from ..runtime import own_kernel_row
from .launch import relative_backward, relative_forward


class _RelativeTriton(torch.autograd.Function):
    """The relative kernels, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, r, query, M, left, right, kpm, scale):
        out, lse = relative_forward(q, k, v, r, query, M, left, right, kpm, scale)
        return stash(ctx, q, k, v, r, query, out, lse, M, left, right, kpm, scale)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, r, query, out, lse, M, left, right, kpm, scale = stashed(ctx)
        dout = torch.zeros_like(out) if dout is None else dout
        grads = relative_backward(dout, dlse, q, k, v, r, query, out, lse, M, left, right, kpm, scale)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v, r, query))) + (None,) * 5


def _run(call):
    a = call.attn
    return _RelativeTriton.apply(call.q, call.k, call.v, call.r, call.query, call.max_distance, a.window_left,
                                 a.window_right, a.key_padding_mask, a.scale)


PATH = own_kernel_row(FN, "triton/relative", _run, FEATURES[FN] - {"dropout"},
                      describe=lambda call: "triton forward and backward (position term per tile, no (Lq, Lk) "
                                            "matrix; r's gradient by a distance-band pass, no atomics)")
