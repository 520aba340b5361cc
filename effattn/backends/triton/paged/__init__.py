"""The row ``triton/paged`` of op ``"paged_attention"``: one kernel for decode and prefill that reads
every key/value row from its page in place (`effattn.paged_triton`), any page size."""
from __future__ import annotations

from ....paged import OP, kernel_scale
from ....paged_triton import paged_forward
from ...base import FEATURES
from ..runtime import own_kernel_row


def _run(call):
    out, lse = paged_forward(call.q, call.k_pages, call.v, call.block_table, call.seqlens, call.left, call.right,
                             kernel_scale(call))
    return (out, lse) if call.return_lse else out


PATH = own_kernel_row(OP, "triton/paged", _run, FEATURES[OP],
                      describe=lambda call: "paged kernel: reads the key/value pages in place")
