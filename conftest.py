"""Test setup shared by both test folders (pyproject.toml's testpaths: tests/ for the library,
benchmarks/tests/ for the benchmarks); each folder's own fixtures stay in it.

- Without CUDA, Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before
  triton is first imported, so it is set here, at collection time.
- Triton configs are pinned (no per-kind autotuning compiles): a GPU test run stays within one
  device call; the benchmark suite (python -m benchmarks.suite) exercises the autotuned configs.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("EFFATTN_TRITON_AUTOTUNE", "0")
