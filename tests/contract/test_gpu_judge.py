"""The GPU tests' judge (tests/contract/test_gpu.py), checked on the CPU: its error scale comes from the
entries the naive low-precision computation got finite, and a kernel's non-finite output always fails."""
import pytest
import torch

from tests.contract.test_gpu import judge, naive_error


def test_naive_error_skips_entries_the_naive_computation_overflowed():
    ref = torch.zeros(4, 3, dtype=torch.float64)
    lo = torch.tensor([[0.5, -0.25, 0.0]] * 2 + [[float("nan"), float("inf"), 1.0]] * 2)
    assert naive_error(lo, ref) == 1.0
    lo[2:, 2] = float("nan")
    assert naive_error(lo, ref) == 0.5
    with pytest.raises(AssertionError, match="not finite anywhere"):
        naive_error(torch.full((2, 2), float("nan")), torch.zeros(2, 2))


def test_judge_fails_non_finite_output_and_large_error_passes_close_output():
    ref = torch.zeros(8, dtype=torch.float64)
    low = torch.full((8,), 0.01)
    low[0] = float("nan")                                   # an overflowed naive entry
    judge((torch.full((8,), 0.015),), (ref,), (low,), torch.float16, names=("out",))
    with pytest.raises(AssertionError, match="error"):
        judge((torch.full((8,), 0.05),), (ref,), (low,), torch.float16, names=("out",))
    bad = torch.zeros(8)
    bad[3] = float("inf")
    with pytest.raises(AssertionError, match="not finite"):
        judge((bad,), (ref,), (low,), torch.float16, names=("out",))
