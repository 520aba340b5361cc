"""A test-only path, as a contributor would add one: this module plus one registry line.

``torch/test-dense`` serves softmax attention on CPU by materializing the ``(Lq, Lk)`` scores with
the visibility rule's token mask (`Rule.materialize`): the plainest correct implementation, which
`test_paths.py` then runs through every generic check. It is registered only while a test asks for
it (the `registered` fixture there), so dispatch elsewhere never sees it.
"""
import math

import torch

from effattn.backends.base import FEATURES, Capabilities, Path
from effattn.numerics import compute_dtype


def _run(call):
    cdt = compute_dtype(call.q.dtype)
    G = call.H // call.Hkv
    q = call.q.to(cdt)
    k, v = (t.to(cdt).repeat_interleave(G, dim=1) for t in (call.k, call.v))
    s = torch.matmul(q, k.transpose(-1, -2)) * call.scale
    mask = call.rule.materialize(key_padding_mask=call.key_padding_mask, device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])      # empty rows: 0
    return torch.matmul(p, v).to(call.q.dtype), lse


PATH = Path(backend="torch", op="attention", name="torch/test-dense", priority=1000,
            caps=Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32, torch.float64}),
                              features=FEATURES["attention"] - {"dropout"}),
            run=_run)
