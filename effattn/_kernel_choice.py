"""How the ops with a Triton kernel of their own beside a torch path (`lsh_attention`, the paged KV
cache) pick one: the Triton kernel when it can serve and runs on CUDA (``backend="auto"``), on a CPU
only when named (Triton's interpreter), and a clear error when named but unable."""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch
from torch import Tensor


def basic_triton_reasons(x: Tensor) -> List[str]:
    """Why no Triton kernel of these ops can take ``x`` (its device, float64, head dim)."""
    from .backends.triton.runtime import _available
    why = []
    problem = _available(x.device)
    if problem:
        why.append(problem)
    if x.dtype == torch.float64:
        why.append("float64 (torch path only)")
    if max(x.shape[-1], 1) > 256:
        why.append("head dim > 256")
    return why


def choose(fn: str, backend: str, device: torch.device, reasons: Callable[[], List[str]],
           other: str) -> Tuple[str, List[str]]:
    """``("triton" | other, why not triton)`` for ``backend``: "auto" or "triton" consult
    ``reasons()`` (which may import triton); any other name takes the ``other`` path."""
    if backend not in ("auto", "triton"):
        return other, [f"backend={backend!r} asked for"]
    try:
        why = reasons()
    except ImportError as e:                        # triton not installed
        why = [f"triton unavailable ({e})"]
    if backend == "triton":
        if why:
            raise ValueError(f"{fn}: backend='triton' cannot serve this call: {'; '.join(why)}")
        return "triton", []
    if not why and device.type != "cuda":
        why = ["on cpu only when asked for by name (Triton's interpreter)"]
    return (other, why) if why else ("triton", [])
