"""The row ``torch/relative`` of op ``"relative_attention"``: blocks of query rows with a recomputing
backward, memory O(rows x max(Lk, n_dist)); with dropout, the dense (B, H, Lq, Lk) scores under
autograd (`effattn.relative.torch_relative`). Serves every call."""
from __future__ import annotations

import torch

from ....relative import FN, UNFUSED_NOTE, torch_relative
from ...base import FEATURES, Capabilities, Path, register

PATH = register(Path(
    backend="torch", op=FN, name="torch/relative", priority=100,
    caps=Capabilities(devices=frozenset({"cpu", "cuda"}),
                      dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                      max_head_dim=1 << 30, features=FEATURES[FN]),
    run=torch_relative, describe=lambda call: UNFUSED_NOTE))
