"""The torch backend's linear-attention paths, one row each: ``torch/linear-cpu-quadratic`` (short
causal calls in the quadratic form, CPU), ``torch/linear-cpu-slices`` (the reference's math on slices
in parallel, CPU) and ``torch/linear-chunked`` (the chunked reference)."""
from . import cpu_quadratic, cpu_slices, reference  # noqa: F401  (each registers its row)
