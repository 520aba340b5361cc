"""The Triton backend: fused softmax attention kernels (`attention/`) and linear attention (`linear/`)."""
from . import attention, lsh, paged, relative  # noqa: F401  (registers the ops)
from . import linear  # noqa: F401  (registers the op)
