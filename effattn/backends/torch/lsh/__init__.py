"""The row ``torch/lsh`` of op ``"lsh_attention"``: each round's chunks as one batched product over
gathered neighbour chunks (`effattn.lsh.torch_rounds`), the scores kept for autograd, memory linear
in L. Serves every call (float64, dropout, any ``chunk_len``)."""
from __future__ import annotations

import torch

from ....lsh import FN, torch_rounds
from ...base import FEATURES, Capabilities, Path, register

PATH = register(Path(
    backend="torch", op=FN, name="torch/lsh", priority=100,
    caps=Capabilities(devices=frozenset({"cpu", "cuda"}),
                      dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                      max_head_dim=1 << 30, features=FEATURES[FN]),
    run=torch_rounds,
    describe=lambda call: "torch path: per-round chunk attention over gathered neighbour chunks, scores kept "
                          "for autograd, memory linear in L"))
