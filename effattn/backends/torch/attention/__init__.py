"""The torch backend's softmax-attention paths, one row each: ``torch/cpu-flash`` (torch's flash CPU
kernel), ``torch/cpu-blocks`` (visible key blocks on CPU) and ``torch/reference`` (the chunked
reference: every device, dropout, empty shapes) and ``torch/score`` (calls with score terms)."""
from . import cpu_blocks, cpu_flash, reference, score  # noqa: F401  (each registers its row)
