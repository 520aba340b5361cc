"""The row ``triton/lsh`` of op ``"lsh_attention"``: the fused chunk + neighbours kernels
(``kernels.py``, launched from ``launch.py``: rows gathered through the sort permutation in-kernel,
O(L) memory, deterministic backward, Philox dropout)."""
from __future__ import annotations

from typing import List

import torch.nn.functional as F

from ....lsh import FN
from ..runtime import own_kernel_row
from .launch import lsh_rounds


def chunk_reasons(call) -> List[str]:
    """The kernels' tile is one chunk: a power of two in 16..128."""
    cl = call.chunk_len
    if cl < 16 or cl & (cl - 1) or cl > 128:
        return [f"chunk_len={cl}: the kernels take a power of two in 16..128"]
    return []


def _run(call):
    return lsh_rounds(call.q, F.normalize(call.q, dim=-1), call.v, call.perm, call.key_padding_mask, call.offsets,
                      call.chunk_len, call.causal, call.scale, call.dropout_p)


PATH = own_kernel_row(FN, "triton/lsh", _run, {"causal", "key_padding_mask", "dropout"}, admits=chunk_reasons,
                      describe=lambda call: "triton (fused chunk + neighbours kernels, rows gathered through the "
                                            "sort permutation, O(L) memory)")
