"""The torch backend's path ``torch/cpu-segments``: a packed call (``cu_seqlens``) on the CPU, each
segment run as its own call of the torch backend's CPU rows (``torch/cpu-flash`` for causal / dense
segments, ``torch/cpu-blocks`` for windows, the reference for what they leave), outputs and lse
concatenated in place order. Dropout and fp32 outputs stay on the reference row's work list (one
dropout stream over the whole packed call)."""
from __future__ import annotations

from typing import List

import torch

from ...._call import AttnCall
from ....numerics import compute_dtype
from ....visibility import Rule, clamp_window
from ...base import FEATURES, SCORE_FEATURES, Capabilities, Path, register, select
from . import cpu_blocks
from .cpu_blocks import CPU_DTYPES


def _admits(call) -> List[str]:
    if call.cu_seqlens is None:
        return ["not a packed call (no cu_seqlens)"]
    if not cpu_blocks.ENABLED:
        return ["fused CPU paths turned off (cpu_blocks.ENABLED is False)"]
    return []


def _segment_call(call, q0, q1, k0, k1) -> AttnCall:
    """Segment ``(q0, q1, k0, k1)`` of a packed call as a plain call (bottom-right inside it)."""
    Lq, Lk = q1 - q0, k1 - k0
    rule = Rule(Lq, Lk, *clamp_window(call.rule.left, call.rule.right, Lq, Lk))
    return AttnCall(call.q[:, :, q0:q1], call.k[:, :, k0:k1], call.v[:, :, k0:k1], call.causal, rule, None, None,
                    call.scale, 0.0, True)


def _run(call):
    outs, lses = [], []
    for q0, q1, k0, k1, _ in sorted(call.segments):
        sub = _segment_call(call, q0, q1, k0, k1)
        o, lse = select("attention", sub, "torch").run(sub)
        outs.append(o)
        lses.append(lse)
    if not outs:                       # every segment empty: rows that see no key
        return (call.q.new_zeros(call.B, call.H, call.Lq, call.Dv),
                torch.full((call.B, call.H, call.Lq), float("-inf"), dtype=compute_dtype(call.q.dtype),
                           device=call.q.device))
    return torch.cat(outs, 2), torch.cat(lses, 2)


PATH = register(Path(
    backend="torch", op="attention", name="torch/cpu-segments", priority=97,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=CPU_DTYPES,
                      features=FEATURES["attention"] - SCORE_FEATURES - {"dropout", "out_fp32", "positions", "layout",
                                                        "key_padding_mask"}),
    run=_run, admits=_admits,
    describe=lambda call: "packed segments one by one on the CPU rows (torch's flash kernel, visible blocks)"))
