"""Backends register themselves on import; `base` holds the registry."""
from . import base, torch_attention  # noqa: F401

try:  # optional: needs triton
    from . import triton_attention  # noqa: F401
except ImportError:  # pragma: no cover - exercised where triton is absent
    pass

# --- CUDA C++ backend (csrc/; effattn/backends/cuda/) ---
from . import cuda  # noqa: E402,F401
# --- end CUDA C++ backend ---
