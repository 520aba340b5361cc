"""effattn: fused efficient attention for PyTorch (Triton and CUDA kernels, torch reference)."""
from . import (  # noqa: F401  (registers the backends)
           backends,
           bias,
           layouts,
           nn,  # noqa: E402  (uses the functions above)
           ops,  # noqa: F401
)
from .feature_maps import FavorFeatures
from .functional import attention, explain
from .linear import linear_attention
from .lsh import explain_lsh, lsh_attention
from .merge import merge_attention
from .nn import KVCache, swap_attention
from .packed import cu_seqlens_from_position_ids
from .relative import relative_attention

__version__ = "0.1.0"
__all__ = ["attention", "linear_attention", "explain", "FavorFeatures", "layouts", "bias", "nn", "swap_attention",
           "KVCache", "lsh_attention", "explain_lsh", "relative_attention", "merge_attention",
           "cu_seqlens_from_position_ids", "ops", "__version__"]
