"""Drop-in ``torch.nn`` modules on effattn: attention, transformer layers, decoding caches, and
`swap_attention` to put them under an existing model."""
from ..paged import PagedKVCache
from ..reversible import ReversibleSequence
from .attention import ForwardExplanation, MultiheadAttention, dense_attention
from .cache import KVCache
from .lsh import LSHSelfAttention
from .position import AdaptiveSpan, ALiBi, T5RelativeBias
from .relative import RelPositionMultiheadAttention
from .swap import swap_attention
from .transformer import TransformerDecoder, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer

__all__ = ["MultiheadAttention", "ForwardExplanation", "KVCache", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerDecoder", "swap_attention", "dense_attention",
           "LSHSelfAttention", "ReversibleSequence", "PagedKVCache", "RelPositionMultiheadAttention",
           "ALiBi", "T5RelativeBias", "AdaptiveSpan"]
