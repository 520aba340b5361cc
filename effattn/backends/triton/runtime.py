"""Runtime facts of the Triton backend: whether it can run here (GPU, or the interpreter on CPU) and
torch's TF32 setting. Shared by every Triton op.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch

from ..base import Capabilities, Path, register

try:
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

# Triton decides at import time whether @triton.jit functions run in its interpreter.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_I32_MAX = 2**31 - 1
_log = logging.getLogger(__name__)


def _tf32_enabled() -> bool:
    """Whether torch lets fp32 matmuls use TF32 on CUDA. torch >= 2.9 has ``fp32_precision`` (which
    resolves inheritance from ``torch.backends.fp32_precision``); reading the legacy ``allow_tf32``
    there raises once the new API was used, so it is only the fallback for older torch. Under
    torch.compile it is read once, when the graph is traced (Dynamo cannot trace the getter)."""
    matmul = torch.backends.cuda.matmul
    try:
        return matmul.fp32_precision == "tf32"
    except AttributeError:
        return bool(matmul.allow_tf32)


if hasattr(torch, "compiler") and hasattr(torch.compiler, "assume_constant_result"):
    _tf32_enabled = torch.compiler.assume_constant_result(_tf32_enabled)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _version(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:2] if x.isdigit())


def _interpreter_problem(triton_version: str, numpy_version: str) -> Optional[str]:
    """Triton's interpreter before 3.7 turns a loop bound computed in the kernel into a 1-element
    array, which numpy >= 2.4 refuses to convert to an int: every kernel here has such loops."""
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        return (f"Triton's interpreter in triton {triton_version} cannot run kernels with computed loop "
                f"bounds under numpy {numpy_version}: use triton >= 3.7 or numpy < 2.4")
    return None


if triton is not None:
    import numpy
    _INTERPRETER_PROBLEM = _interpreter_problem(triton.__version__, numpy.__version__)


def _available(device: torch.device) -> Optional[str]:
    if triton is None:
        return "triton is not installed"
    if device.type == "cpu":
        if not (_INTERPRET and os.environ.get("TRITON_INTERPRET") == "1"):
            return "CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter), set before triton is imported"
        return _INTERPRETER_PROBLEM
    return None


def own_kernel_row(op: str, name: str, run, features, **more):
    """A row of an op with Triton kernels of its own (``lsh_attention``, the paged KV cache,
    ``relative_attention``: their folders here): CUDA, or a CPU in Triton's interpreter when named,
    float16/bfloat16/float32, head dim <= 256."""
    caps = Capabilities(devices=frozenset({"cuda", "cpu"}),
                        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
                        max_head_dim=256, features=frozenset(features))
    return register(Path(backend="triton", op=op, name=name, priority=10, caps=caps, run=run,
                         available=_available, explicit_only_devices=frozenset({"cpu"}), **more))
