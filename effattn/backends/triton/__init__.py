"""The Triton backend: fused softmax attention kernels (`attention/`) and linear attention (`linear/`)."""
from . import (  # noqa: F401  (registers the ops)
    attention,
    linear,  # noqa: F401  (registers the op)
    lsh,
    paged,
    relative,
)
