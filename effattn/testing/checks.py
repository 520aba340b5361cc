"""Checks of a call's behaviour beyond its values: CUDA-graph replay and torch.compile give what eager
gives; `tf32` pins torch's fp32 matmul precision around a block. The GPU tests and the benchmark
suite's ``checks`` section use them."""
from typing import List

import torch


class tf32:
    """Context: torch's fp32 matmul precision set to TF32 (``on``) or IEEE, whichever API exists."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.attr = "fp32_precision" if hasattr(m, "fp32_precision") else "allow_tf32"
        self.prev = getattr(m, self.attr)
        setattr(m, self.attr, ("tf32" if self.on else "ieee") if self.attr == "fp32_precision" else self.on)

    def __exit__(self, *exc):
        setattr(torch.backends.cuda.matmul, self.attr, self.prev)


def graph_replay_matches_eager(step) -> List[bool]:
    """``step()`` -> tuple of tensors, eagerly, then captured in a CUDA graph (after a warm-up on a
    side stream, as torch asks) and replayed: bitwise equality per tensor."""
    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return [torch.equal(a, b) for a, b in zip(eager, captured)]


def compile_matches_eager(f, inputs, backend: str = "inductor"):
    """``torch.compile(f, fullgraph=True)`` against eager, forward and the gradients of a squared
    sum: (bitwise equal per tensor, largest absolute difference)."""
    got = torch.compile(f, fullgraph=True, backend=backend)(*inputs)
    got = (got,) + torch.autograd.grad(got.float().square().sum(), inputs)
    ref = f(*inputs)
    ref = (ref,) + torch.autograd.grad(ref.float().square().sum(), inputs)
    same = [torch.equal(a, b) for a, b in zip(got, ref)]
    return same, max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
