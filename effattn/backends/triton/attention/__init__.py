"""The Triton backend for softmax attention: fused FlashAttention-2 kernels (Dao 2023), forward and
backward, with tile skipping for causal / window / block-sparse calls, and a split-KV decode.

Modules, kernel to op (each reads only the ones above it): ``schedule`` (in-kernel tile schedule),
``forward`` / ``backward`` (the kernels), ``configs`` and ``launch`` (tile configs, launch plans,
autotuning), ``decode`` (the split-KV decode), ``op`` (the torch ops and the rows ``triton/decode`` and
``triton/prefill``). The design (numerics, configs and reproducibility, syncs, scheduling, index
arithmetic) is written up in docs/design/triton-attention.md.
"""
from ..runtime import triton
from .op import BACKEND  # noqa: F401  (registers the backend)

if triton is not None:
    from . import configs, decode, launch, op  # noqa: F401
    from .backward import bwd_kernel, delta_kernel  # noqa: F401
    from .forward import fwd_kernel  # noqa: F401
    from .launch import LaunchPlan, bwd, fwd  # noqa: F401
    from .op import triton_attention_bwd, triton_attention_decode, triton_attention_fwd  # noqa: F401
