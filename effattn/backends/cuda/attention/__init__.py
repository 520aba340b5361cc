"""The CUDA backend's softmax-attention paths: ``cuda/decode`` (split-KV, a few query rows) and
``cuda/prefill`` (FA2-class kernels; the Hopper forward inside, `hopper`). `tiling` holds the kernels'
tile shapes and layout lists, `ops` the torch ops."""
from . import decode, ops  # noqa: F401  (each registers its row)
