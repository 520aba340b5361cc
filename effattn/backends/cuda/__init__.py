"""The CUDA C++ backend for softmax attention (kernels in csrc/, FlashAttention-2 class on
mma.sync / ldmatrix / cp.async, sm_80 and newer), forward and backward, every mask kind.

On a GPU of compute capability 9.0 the forward at head dims 33..128 runs the Hopper kernel
(csrc/attn_fwd_sm90.cuh, wgmma) when the extension has sm_90a code (``attention/hopper.py`` decides;
explain says which forward runs).

Layers: the kernels (csrc/attn_fwd.cuh, csrc/attn_fwd_sm90.cuh, csrc/attn_bwd.cuh) -> launchers
(csrc/attention.cu, attention_bwd.cu, attention_sm90.cu) -> the C++ ops
(csrc/binding/) -> the autograd ops (``attention/ops.py``, row ``cuda/prefill``; ``attention/decode.py``,
row ``cuda/decode``).

CUDA tensors use ``effattn._C`` (built by setup.py). CPU tensors are served only with
``EFFATTN_CUDA_EMU=1``, and only when the backend is named (``backend="cuda"``): the same kernel
source runs through a host emulation of the GPU primitives, built on first use with the host
compiler. That is a test vehicle (thousands of emulated warp mma per second), not a CPU backend.

Linear attention (its own kernels, csrc/linear_*.cuh) lives in ``linear/``.

Inputs whose last dimension is not contiguous, whose head dims are not multiples of 8, or whose
rows are not 16-byte aligned are copied (zero-padded) once per call: the kernels load 16-byte rows
with cp.async.
"""
from . import attention, linear, lsh  # noqa: F401  (each registers its rows)
from ._ext import available as _available  # noqa: F401  (the rows' runtime check)
