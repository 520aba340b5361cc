"""The row ``triton/paged`` of op ``"paged_attention"``: one kernel for decode and prefill that reads
every key/value row from its page in place (``kernels.py``, launched from ``launch.py``), any page
size; a decode-shaped call over a long cache splits its key range over programs (split-KV, merged by
log-sum-exp)."""
from __future__ import annotations

from ....paged import OP, kernel_scale
from ...base import FEATURES
from ..runtime import own_kernel_row
from .launch import paged_forward, split_plan


def _run(call):
    out, lse = paged_forward(call.q, call.k_pages, call.v, call.block_table, call.seqlens, call.left, call.right,
                             kernel_scale(call))
    return (out, lse) if call.return_lse else out


def _describe(call) -> str:
    n, per = split_plan(call.q, call.k_pages, call.block_table, call.left)
    split = f"; split-KV decode: {n} splits of {per} keys + combine" if n > 1 else ""
    return "paged kernel: reads the key/value pages in place" + split


PATH = own_kernel_row(OP, "triton/paged", _run, FEATURES[OP], describe=_describe)
