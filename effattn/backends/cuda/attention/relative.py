"""The row ``cuda/relative`` of op ``"relative_attention"``: the CUDA C++ forward with relative keys
(`effattn.bias.RelativeKeys`; csrc/attention/relkeys.cu, ``relk_add`` in csrc/attention/fwd.cuh). Per
(query tile, key tile) pair the kernel loads the band of ``r`` rows the pair's distances clamp to, multiplies
each warp's query rows with its part of the band on the tensor cores (one extra product per tile) and adds
element ``(i, j)`` from column ``i - j + const`` of that product: the relative shift done in the tile, never
an ``(Lq, Lk)`` or ``(Lq, n_dist)`` matrix. Causal, windows, key padding and GQA as the forward; any
``query`` (Transformer-XL's ``q + v_bias``) or q itself.

Forward only: a call that needs gradients is refused (`explain` says so; ``triton/relative`` and
``torch/relative`` serve it), as is dropout. The backward (gradients of q, query and r without atomics)
is not written yet.
"""
from __future__ import annotations

from typing import List

import torch

from ....relative import FN
from ...base import FEATURES, Capabilities, Path, register
from .. import _ext, resources
from . import cpp
from .ops import DEVICES, DTYPES
from .tiling import bucket

BACKWARD_MISSING = ("forward only: the CUDA C++ backward of relative keys is not written yet (triton/relative and "
                    "torch/relative serve calls that need gradients)")


def _admits(call) -> List[str]:
    why = []
    if torch.is_grad_enabled() and any(t.requires_grad for t in (call.q, call.k, call.v, call.r, call.query)):
        why.append(BACKWARD_MISSING)
    hd = bucket(call.q.shape[-1], call.v.shape[-1])
    return why + resources.refusals([resources.Need("relative-keys forward", resources.relk_smem(hd))],
                                    resources.device_limits(call.q.device))


def run(call):
    a = call.attn.op_args()
    query = None if call.query is call.q else call.query
    M = -1 if call.max_distance is None else call.max_distance
    out, lse = cpp.kernels(call.q.device).attention_fwd_relk(call.q, call.k, call.v, a.key_padding_mask, a.scale,
                                                             a.window_left, a.window_right, call.r, query, M)
    return out, lse


PATH = register(Path(
    backend="cuda", op=FN, name="cuda/relative", priority=20,
    caps=Capabilities(devices=DEVICES, dtypes=DTYPES, features=FEATURES[FN] - {"dropout"}), run=run, admits=_admits,
    available=_ext.available, explicit_only_devices=frozenset({"cpu"}),
    describe=lambda call: ("CUDA C++ forward: the band of r per tile pair, one extra product per tile, the relative "
                           "shift in the tile; forward only")))
