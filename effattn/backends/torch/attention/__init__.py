"""The torch backend's softmax-attention paths, one row each: ``torch/cpu-flash`` (torch's flash CPU
kernel), ``torch/cpu-sdpa-mask`` (the same kernel with a materialized mask, where measured faster),
``torch/cpu-blocks`` (visible key blocks on CPU) and ``torch/reference`` (the chunked
reference: every device, dropout, empty shapes)."""
from . import cpu_blocks, cpu_flash, cpu_masked, reference  # noqa: F401  (each registers its row)
