"""effattn: fused efficient attention for PyTorch (Triton and CUDA kernels, torch reference)."""
from . import backends, bias, layouts  # noqa: F401  (registers the backends)
from .functional import attention, explain
from .feature_maps import FavorFeatures
from .linear import linear_attention
from .lsh import explain_lsh, lsh_attention
from .relative import relative_attention
from . import nn  # noqa: E402  (uses the functions above)
from .nn import KVCache, swap_attention

__version__ = "0.1.0"
__all__ = ["attention", "linear_attention", "explain", "FavorFeatures", "layouts", "bias", "nn", "swap_attention",
           "KVCache", "lsh_attention", "explain_lsh", "relative_attention", "__version__"]
