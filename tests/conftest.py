"""Shared test setup.

- Without CUDA, Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before
  triton is first imported, so it is set here, at collection time. Triton configs are pinned.
- Outputs are poisoned: torch.empty / empty_like / new_empty hand out NaN-filled float tensors, so an
  element a kernel forgets to write fails the comparison instead of passing by luck.
- `gpu`-marked tests run only where CUDA is present; with ``EFFATTN_GPU_SMOKE=1`` the ones also
  marked `toy` (tests/test_gpu.py) run on the CPU at toy sizes, to check them before a GPU session.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests pin the Triton configs (no per-kind autotuning compiles): a GPU test run stays within one
# device call; the benchmark suite (python -m benchmarks.run --suite gpu) exercises the autotuned configs.
os.environ.setdefault("EFFATTN_TRITON_AUTOTUNE", "0")

import pytest  # noqa: E402

import effattn  # noqa: E402
from effattn.backends import base  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU_SMOKE = os.environ.get("EFFATTN_GPU_SMOKE") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "toy: a gpu test that EFFATTN_GPU_SMOKE=1 runs on the CPU at toy sizes")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not (GPU_SMOKE and "toy" in item.keywords):
            item.add_marker(skip)


def op_backends(op, device=DEVICE):
    """Names of the backends of `op` usable on `device` in this installation (explicitly named), read
    from their declarations: a new backend is tested by registering it, nothing else."""
    names = []
    for b in base.backends_for(op):
        if device.type in b.caps.devices and b.available(device) is None:
            names.append(b.name)
    return names


def kernel_backends(op, device=DEVICE):
    """`op_backends` less the float64 reference (the backend that declares float64, as the test
    oracle computes): the kernels that the GPU tests judge against the oracle."""
    return [n for n in op_backends(op, device) if torch.float64 not in base._REGISTRY[op][n].caps.dtypes]


def attention_backends(device=DEVICE):
    return op_backends("attention", device)


def declared_dtypes(op, backend):
    """The dtypes backend `backend` declares for `op`, float64 first when served (the oracle's)."""
    dtypes = base._REGISTRY[op][backend].caps.dtypes
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    return [d for d in order if d in dtypes]


_real = {"empty": torch.empty, "empty_like": torch.empty_like}
_real_new_empty = torch.Tensor.new_empty


def _poison(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta":
        t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_real["empty"](*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_real["empty_like"](*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: _poison(_real_new_empty(self, *a, **k)))
    yield
