"""Shared test setup.

- The environment (Triton's interpreter without CUDA, pinned Triton configs) is set by the
  repository's root conftest.py, shared with benchmarks/tests/.
- Outputs are poisoned: torch.empty / empty_like / new_empty hand out NaN-filled float tensors, so an
  element a kernel forgets to write fails the comparison instead of passing by luck.
- `gpu`-marked tests run only where CUDA is present; with ``EFFATTN_GPU_SMOKE=1`` the ones also
  marked `toy` (tests/contract/test_gpu.py) run on the CPU at toy sizes, to check them before a GPU session.
- Helpers several modules share: `random_qkv`, `capture_step` (a CUDA graph of a decode step), the CUDA emulation fixtures (`emulation`,
  `real_and_emulated`) and the csrc/emu self-test builds (`build_selftest`, `selftest_runner`, `run_sanitized`).
"""
import hashlib
import os
import shutil
import subprocess

import pytest
import torch

from effattn.backends import base

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU_SMOKE = os.environ.get("EFFATTN_GPU_SMOKE") == "1"


def capture_step(fn):
    """``(warm, graph, out)``: ``fn()`` run once on a side stream (the warm-up that compiles the kernels,
    outside the capture), then recorded, not run, in a ``torch.cuda.CUDAGraph`` whose replays rewrite
    ``out``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return warm, graph, out


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")
    config.addinivalue_line("markers", "toy: a gpu test that EFFATTN_GPU_SMOKE=1 runs on the CPU at toy sizes")
    config.addinivalue_line("markers", "cuda_torch_build: builds the CUDA extension against the CUDA torch that "
                            "EFFATTN_CUDA_TORCH_PYTHON names (skipped without it; minutes)")
    config.addinivalue_line("markers", "cuda_arch_sweep: compiles the CUDA kernels for sm_86, sm_89, sm_100 and "
                            "sm_120 (runs with EFFATTN_CUDA_ARCH_SWEEP=1; minutes per architecture)")
    config.addinivalue_line("markers", "mutation: every mutation of csrc/emu/mutate.py (runs with "
                            "EFFATTN_MUTATION=1; about half a minute per mutation)")


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
def torch_threads_restored():
    """Each test starts with the thread count the one before it found: a test (or a benchmark it calls) that
    sets one thread would otherwise change which CPU rows serve the next tests of the same worker."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_real["empty"](*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_real["empty_like"](*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: _poison(_real_new_empty(self, *a, **k)))
    yield


# ------------------------------------------------------------------ helpers several test modules share


def random_qkv(B, H, Hkv, Lq, Lk, D, Dv, g, dtype=None, device=DEVICE, transposed=False):
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) drawn from generator `g` in that order;
    with `transposed`, views of (B, L, H, D) tensors (non-contiguous)."""
    def rnd(h, L, d):
        x = torch.randn(B, L, h, d, generator=g) if transposed else torch.randn(B, h, L, d, generator=g)
        x = (x if dtype is None else x.to(dtype)).to(device)
        return x.transpose(1, 2) if transposed else x
    return rnd(H, Lq, D), rnd(Hkv, Lk, D), rnd(Hkv, Lk, Dv)


EMU_DEFAULT_SCHEDULE = 1   # warp-serial: the emulator's default (csrc/emu/emu.h), what tests restore


@pytest.fixture(scope="module")
def emulation():
    """EFFATTN_CUDA_EMU=1 for the module that asks for it (other modules' backend lists stay as they
    are); yields the emulated ops. Modules of the emulated CUDA kernels use it for every test:
    ``pytestmark = pytest.mark.usefixtures("emulation")``."""
    from effattn.backends.cuda import _ext
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EFFATTN_CUDA_EMU", "1")
        problem = _ext.emu_problem()
        assert problem is None, problem
        yield torch.ops.effattn_cuda_emu
        torch.ops.effattn_cuda_emu.emu_set_schedule(EMU_DEFAULT_SCHEDULE)


def need_cuda_extension():
    """Skips the test unless the real CUDA extension (effattn._C) loads; returns the loader module."""
    from effattn.backends.cuda import _ext
    if _ext.cuda_problem():
        pytest.skip(f"effattn._C: {_ext.cuda_problem()}")
    return _ext


@pytest.fixture(scope="module")
def real_and_emulated():
    """The real CUDA extension and, with EFFATTN_CUDA_EMU=1, its emulation (GPU tests that compare
    the two); skips without either."""
    _ext = need_cuda_extension()
    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the emulated kernels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EFFATTN_CUDA_EMU", "1")
        assert _ext.emu_problem() is None, _ext.emu_problem()
        yield


CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def build_selftest(flags=(), source="selftest.cpp"):
    """The self-test binary of csrc/emu/`source` built with g++ for `flags`, cached on the sources' hash."""
    from effattn.backends.cuda import _ext
    h = hashlib.sha1((" ".join(flags) + source).encode())
    for f in _ext.sources():
        h.update(open(f, "rb").read())
    root = os.environ.get("EFFATTN_CUDA_EMU_DIR", os.path.join(os.path.expanduser("~"), ".cache", "effattn"))
    exe = os.path.join(root, f"{os.path.splitext(source)[0]}-{h.hexdigest()[:16]}")
    if not os.path.exists(exe):
        os.makedirs(root, exist_ok=True)
        cmd = ["g++", "-std=c++17", "-O1", "-DEFFATTN_CUDA_EMU", "-I", CSRC, *flags,
               os.path.join(CSRC, "emu", source), "-o", exe + ".tmp"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
        os.replace(exe + ".tmp", exe)
    return exe


def selftest_runner(source="selftest.cpp"):
    """``run(*args, stdin=None)``: the completed process of the self-test of csrc/emu/`source`."""
    exe = build_selftest((), source)

    def run(*args, stdin=None):
        return subprocess.run([exe, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=120)
    return run


SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g"]


def run_sanitized(source, *args):
    """stdout of the self-test of csrc/emu/`source` run with `args` in its AddressSanitizer + UBSan
    build; fails with the report's first lines."""
    exe = build_selftest(SANITIZE, source)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    res = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    report = res.stderr
    for mark in ("ERROR: AddressSanitizer", "runtime error"):
        if mark in report:                   # from the report's start: the faulting line comes first
            report = report[report.index(mark):]
    assert res.returncode == 0, report[:4000]
    assert "ERROR: AddressSanitizer" not in res.stderr and "runtime error" not in res.stderr, report[:4000]
    return res.stdout


def fragment_maps(stdout):
    """A self-test's ``maps`` output, lines ``KIND n... row col`` -> {(KIND, n...): (row, col)}."""
    got = {}
    for line in stdout.splitlines():
        f = line.split()
        nums = tuple(int(x) for x in f[1:])
        got[(f[0],) + nums[:-2]] = nums[-2:]
    return got
