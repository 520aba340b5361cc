"""Test setup shared by both test folders (pyproject.toml's testpaths: tests/ for the library,
benchmarks/tests/ for the benchmarks); each folder's own fixtures stay in it.

- Without CUDA, Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before
  triton is first imported, so it is set here, at collection time.
- Triton configs are pinned (no per-kind autotuning compiles): a GPU test run stays within one
  device call; the benchmark suite (python -m benchmarks.suite) exercises the autotuned configs.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("EFFATTN_TRITON_AUTOTUNE", "0")

# Under pytest-xdist (the README's test command runs `-n auto --dist loadfile`) the workers share the cores this process
# may use: each takes its share of torch threads instead of all of them, so they do not oversubscribe.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def one_torch_thread():
    """One torch thread for tests of many tiny ops (on a loaded 2-core machine two threads spend most
    of their time synchronizing); the previous count is restored."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def pytest_runtest_logreport(report):
    """With ``EFFATTN_FAILURE_LOG=FILE`` each failure's report is appended to FILE as it happens, so a
    run killed by a time limit (a lent GPU's call) still tells which test failed and why."""
    path = os.environ.get("EFFATTN_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
