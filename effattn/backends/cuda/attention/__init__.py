"""The CUDA backend's softmax-attention paths: ``cuda/decode`` (split-KV, a few query rows),
``cuda/prefill`` (FA2-class kernels; the Hopper forward inside, `hopper`) and, for op
``"paged_attention"``, ``cuda/paged-decode`` (the split-KV kernels reading pages in place) and
``cuda/paged-prefill`` (the mma.sync forward reading pages in place, any Lq), and for op
``"relative_attention"``, ``cuda/relative`` (attention with relative keys, forward and backward). `tiling`
holds the kernels' tile shapes and layout lists, `ops` the torch ops."""
from . import decode, ops, paged, relative  # noqa: F401  (each registers its row)
