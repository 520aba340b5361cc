"""The row ``torch/paged-gather`` of op ``"paged_attention"``: the used pages gathered into one
contiguous right-aligned copy (torch gather, one copy of the keys per call), then `effattn.attention`
with the caller's backend, whose bottom-right alignment places every row's queries. Serves every call."""
from __future__ import annotations

import torch

from ....functional import attention
from ....paged import GATHER_NOTE, OP, contiguous_keys
from ...base import FEATURES, Capabilities, Path, register


def _run(call):
    k, v, kpm = contiguous_keys(call)
    return attention(call.q, k, v, causal=call.causal, window=call.window, key_padding_mask=kpm, scale=call.scale,
                     return_lse=call.return_lse, backend=call.backend)


PATH = register(Path(
    backend="torch", op=OP, name="torch/paged-gather", priority=100,
    caps=Capabilities(devices=frozenset({"cpu", "cuda"}),
                      dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                      max_head_dim=1 << 30, features=FEATURES[OP]),
    run=_run, notes=lambda call: [GATHER_NOTE],
    describe=lambda call: "then effattn.attention on the copy"))
