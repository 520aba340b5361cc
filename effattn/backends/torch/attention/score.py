"""Row ``torch/score``: calls with score terms (softcap, sinks, bias terms, adaptive span) on the
chunked score-terms reference of `effattn.score` (forward and backward, deterministic parameter
gradients), on CPU and CUDA tensors, with packed sequences (segment-local distances), positions
(absolute distances and dropout draws) and fp32 outputs. The other torch rows take no score terms."""
import torch

from .... import score
from ...base import FEATURES, Capabilities, Path, register


def _admits(call):
    return [] if call.score is not None else ["no score terms (the plain torch rows serve the call)"]


def _describe(call):
    return ("score terms (" + ", ".join(sorted(call.score.features())) + "): the chunked score-terms reference, "
            "several times slower than the fused CPU paths")


PATH = register(Path(
    backend="torch", op="attention", name="torch/score", priority=99,
    caps=Capabilities(devices=frozenset({"cpu", "cuda"}),
                      dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                      max_head_dim=256, features=FEATURES["attention"]),
    run=lambda call: score.run(call), admits=_admits, describe=_describe))
