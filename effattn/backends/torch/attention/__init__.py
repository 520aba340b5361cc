"""The torch backend's softmax-attention paths, one row each: ``torch/cpu-flash`` (torch's flash CPU
kernel), ``torch/cpu-sdpa-mask`` (the same kernel with a materialized mask, where measured faster),
``torch/cpu-blocks`` (visible key blocks on CPU), ``torch/cpu-segments`` (packed sequences on CPU,
segment by segment on those), ``torch/reference`` (the chunked reference: every device, dropout,
empty shapes, the segment work list of packed sequences, positions and fp32 outputs) and
``torch/score`` (calls with score terms)."""
from . import cpu_blocks, cpu_flash, cpu_masked, cpu_segments, reference, score  # noqa: F401  (each registers its row)
