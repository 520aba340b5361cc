"""The torch backend's softmax-attention paths, one row each: ``torch/cpu-flash`` (torch's flash CPU
kernel), ``torch/cpu-blocks`` (visible key blocks on CPU), ``torch/cpu-segments`` (packed sequences on
CPU, segment by segment on those two) and ``torch/reference`` (the chunked reference: every device,
dropout, empty shapes, the segment work list of packed sequences, positions and fp32 outputs)."""
from . import cpu_blocks, cpu_flash, cpu_segments, reference  # noqa: F401  (each registers its row)
