"""effattn: fused efficient attention for PyTorch (Triton and CUDA kernels, torch reference)."""
from . import backends, layouts  # noqa: F401  (registers the backends)
from .functional import attention, explain
from .feature_maps import FavorFeatures
from .linear import linear_attention

__version__ = "0.1.0"
__all__ = ["attention", "linear_attention", "explain", "FavorFeatures", "layouts", "__version__"]
