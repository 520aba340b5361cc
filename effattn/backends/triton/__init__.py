"""The Triton backend: fused softmax attention kernels (`attention/`)."""
from . import attention  # noqa: F401  (registers the op)
