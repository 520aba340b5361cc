"""The torch backend's linear-attention paths, one row each: ``torch/linear-cpu-chunks`` (causal
calls in the chunked form as a dozen batched ops, CPU), ``torch/linear-cpu-slices`` (the reference's
math on slices in parallel, CPU) and ``torch/linear-chunked`` (the chunked reference)."""
from . import cpu_chunks, cpu_slices, reference  # noqa: F401  (each registers its row)
