"""effattn: fused efficient attention for PyTorch (Triton and CUDA kernels, torch reference)."""
from . import backends, bias, layouts  # noqa: F401  (registers the backends)
from .functional import attention, explain
from .feature_maps import FavorFeatures
from .linear import linear_attention
from .lsh import explain_lsh, lsh_attention
from .relative import relative_attention
from .merge import merge_attention
from .packed import cu_seqlens_from_position_ids
from . import ops  # noqa: F401
from . import nn  # noqa: E402  (uses the functions above)
from .nn import KVCache, swap_attention

__version__ = "0.1.0"
__all__ = ["attention", "linear_attention", "explain", "FavorFeatures", "layouts", "bias", "nn", "swap_attention",
           "KVCache", "lsh_attention", "explain_lsh", "relative_attention", "merge_attention",
           "cu_seqlens_from_position_ids", "ops", "__version__"]
