"""The Triton backend: fused softmax attention kernels (`attention/`) and linear attention (`linear/`)."""
from . import attention  # noqa: F401  (registers the op)
from . import linear  # noqa: F401  (registers the op)
