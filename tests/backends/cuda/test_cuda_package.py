"""The CUDA extension as a package ships and builds (no GPU needed):

- ``targets.py``: TORCH_CUDA_ARCH_LIST -> nvcc ``-gencode`` flags with PTX of the highest
  architecture embedded, and which devices a build runs on (the backend refuses a device that has
  no code in the extension instead of failing at launch);
- the source distribution carries every file the build needs (csrc/, MANIFEST.in);
- marked ``cuda_torch_build``: the sdist installs against a CUDA build of torch and nvcc, with
  ``TORCH_CUDA_ARCH_LIST="8.0;9.0a"``, and ``effattn._C`` then imports without a GPU and registers
  every op. It runs where ``EFFATTN_CUDA_TORCH_PYTHON`` names the python of such an environment
  (``python3 -m venv venv-cu && venv-cu/bin/pip install torch==2.14.1``) and takes minutes.
"""
import glob
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from effattn.backends import base
from effattn.backends.cuda import _ext, targets
from tests.backends.cuda.nvcc_units import find_tool
from tests.conftest import CSRC

ROOT = os.path.dirname(CSRC)
CUDA_TORCH_PYTHON = os.environ.get("EFFATTN_CUDA_TORCH_PYTHON")
ARCH_LIST = "8.0;9.0a"
# every op the binding registers on CUDA tensors (csrc/binding/*.cpp)
OPS = ("attention_fwd", "attention_bwd", "attention_fwd_sm90", "has_sm90a", "attention_decode", "linear_state",
       "linear_out", "linear_step", "linear_favor", "built_targets")


def test_gencode_embeds_ptx_of_the_highest_architecture():
    flags, built = targets.gencode(ARCH_LIST)
    assert built == ["sm_80", "sm_90a", "compute_90"]
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                     "-gencode=arch=compute_90,code=compute_90"]
    # +PTX of an arch-specific entry is that entry's PTX; the portable PTX still comes last
    assert targets.gencode("8.0 9.0a+PTX")[1] == ["sm_80", "sm_90a", "compute_90a", "compute_90"]
    assert targets.gencode("8.6+PTX;8.0")[1] == ["sm_86", "compute_86", "sm_80"]
    assert targets.gencode("10.0;8.0")[1] == ["sm_100", "sm_80", "compute_100"]


@pytest.mark.parametrize("arch_list, what", [("Hopper", "cannot read 'Hopper'"), ("7.5", "below compute capability"),
                                             ("8.0;9", "cannot read '9'"), (" ; ", "empty")])
def test_gencode_names_an_entry_it_cannot_build(arch_list, what):
    with pytest.raises(ValueError, match=what):
        targets.gencode(arch_list)


@pytest.mark.parametrize("built, runs, refused", [
    (["sm_80", "sm_90a", "compute_90"], [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)], [(7, 5)]),
    (["sm_80", "sm_90a"], [(8, 0), (8, 6), (9, 0)], [(10, 0), (12, 0), (7, 5)]),   # no PTX: no Blackwell
    (["sm_90a"], [(9, 0)], [(8, 0), (9, 1), (10, 0)]),                            # arch-specific SASS
    (["sm_86", "compute_86"], [(8, 6), (8, 9), (9, 0)], [(8, 0)]),                # PTX runs forward only
    (["sm_90a", "compute_90a"], [(9, 0)], [(10, 0)]),                             # so does 90a's PTX: not at all
])
def test_which_devices_a_build_runs_on(built, runs, refused):
    for cc in runs:
        assert targets.runs_on(built, cc) is None, (built, cc)
    for cc in refused:
        why = targets.runs_on(built, cc)
        assert why is not None and f"{cc[0]}.{cc[1]}" in why, (built, cc, why)


def test_cuda_backend_refuses_a_gpu_its_build_cannot_run(monkeypatch):
    """The backends' availability reads the build's targets: a Blackwell GPU (10.0) is refused by an
    sm_80 + sm_90a build with the reason, admitted once compute_90 PTX is in it."""
    monkeypatch.setattr(_ext, "_cuda_problem", [None])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    gpu = torch.device("cuda", 0)
    for op in ("attention", "linear_attention"):
        backend = next(b for b in base.backends_for(op) if b.name == "cuda")
        monkeypatch.setattr(_ext, "built_targets", lambda: ["sm_80", "sm_90a"])
        why = backend.available(gpu)
        assert why is not None and "no code this GPU (compute capability 10.0) can run" in why, (op, why)
        assert "sm_80, sm_90a" in why and 'TORCH_CUDA_ARCH_LIST="10.0"' in why
        monkeypatch.setattr(_ext, "built_targets", lambda: ["sm_80", "sm_90a", "compute_90"])
        assert backend.available(gpu) is None, op


def kernel_and_binding_sources():
    """csrc/ files relative to the repository root, as the sdist lists them."""
    files = glob.glob(os.path.join(CSRC, "**", "*.*"), recursive=True)
    return sorted(os.path.relpath(f, ROOT) for f in files if f.endswith((".h", ".cuh", ".cu", ".cpp", ".md")))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The source distribution `python -m build --sdist` makes of this checkout (no CUDA build)."""
    pytest.importorskip("build", reason="needs the `build` package (the 'test' extra)")
    out = tmp_path_factory.mktemp("sdist")
    env = dict(os.environ, EFFATTN_BUILD_CUDA="0")
    res = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                          "--outdir", str(out), ROOT],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    found = glob.glob(str(out / "effattn-*.tar.gz"))
    assert len(found) == 1, found
    return found[0]


def test_sdist_carries_what_the_cuda_build_needs(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = kernel_and_binding_sources()
    assert any(n.startswith("csrc/binding/") for n in needed) and any(n.endswith(".cu") for n in needed)
    assert len([n for n in needed if n.startswith("csrc/attention/inst/") and n.endswith(".cu")]) >= 80
    missing = [n for n in needed + ["setup.py", "pyproject.toml", "MANIFEST.in", "effattn/backends/cuda/targets.py",
                                    "csrc/generate_instances.py"]
               if n not in names]
    assert not missing, missing


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def cuda_torch_install(sdist, tmp_path_factory):
    """(site folder, seconds) of `pip install --no-build-isolation` of the sdist with the CUDA torch's
    python, TORCH_CUDA_ARCH_LIST="8.0;9.0a", into a folder of its own."""
    if not CUDA_TORCH_PYTHON:
        pytest.skip("set EFFATTN_CUDA_TORCH_PYTHON to the python of an environment with a CUDA build of torch "
                    "(python3 -m venv venv-cu && venv-cu/bin/pip install torch==2.14.1) to build the extension "
                    "against it (minutes)")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to build the extension against a CUDA torch")
    probe = subprocess.run([CUDA_TORCH_PYTHON, "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                           text=True)
    assert probe.returncode == 0 and probe.stdout.strip() not in ("", "None"), \
        f"EFFATTN_CUDA_TORCH_PYTHON={CUDA_TORCH_PYTHON} has no CUDA build of torch: {probe.stdout}{probe.stderr}"
    site = tmp_path_factory.mktemp("site")
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=ARCH_LIST, EFFATTN_BUILD_CUDA="1",
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
               PATH=os.path.dirname(CUDA_TORCH_PYTHON) + os.pathsep + os.environ.get("PATH", ""))
    start, cpu = time.perf_counter(), children_cpu_seconds()
    res = subprocess.run([CUDA_TORCH_PYTHON, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
                          "--target", str(site), sdist], capture_output=True, text=True, env=env, timeout=3000)
    seconds, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    log = res.stdout + res.stderr
    # the binding compiles in the C++ standard torch chooses; only nvcc keeps C++17
    host = [line for line in log.splitlines() if "binding/" in line and ".cpp" in line and " -c " in line]
    assert host and not any("-std=c++17" in line for line in host), host[:2]
    # the CPU time tells what a less busy machine takes: about cpu / cores with MAX_JOBS >= cores
    print(f"\nthe CUDA extension built from the sdist in {seconds:.0f} s, {cpu:.0f} s of CPU "
          f"(MAX_JOBS={env['MAX_JOBS']})")
    return str(site), seconds


@pytest.mark.cuda_torch_build
def test_extension_builds_against_cuda_torch_and_registers_every_op(cuda_torch_install):
    site, _ = cuda_torch_install
    script = ("import torch, effattn._C, effattn.backends.cuda._ext as e\n"
              "assert e.cuda_problem() is None\n"
              f"missing = [n for n in {OPS!r} if not hasattr(torch.ops.effattn_cuda, n)]\n"
              "assert not missing, missing\n"
              "print(','.join(e.built_targets()), torch.ops.effattn_cuda.has_sm90a(), torch.cuda.is_available())\n")
    env = dict(os.environ, PYTHONPATH=site, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([CUDA_TORCH_PYTHON, "-c", script], capture_output=True, text=True, env=env,
                         cwd=site, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.split() == ["sm_80,sm_90a,compute_90", "True", "False"], res.stdout


@pytest.mark.cuda_torch_build
def test_extension_carries_sass_per_target_and_forward_compatible_ptx(cuda_torch_install):
    """Every kernel translation unit has sm_80 and sm_90a SASS and compute_90 PTX (which a driver
    compiles for a GPU newer than both)."""
    site, _ = cuda_torch_install
    exe = find_tool("cuobjdump")
    if exe is None:
        pytest.fail("cuobjdump not found: pip install nvidia-cuda-cuobjdump (the 'test' extra)")
    (lib,) = glob.glob(os.path.join(site, "effattn", "_C*.so"))
    units = len(glob.glob(os.path.join(CSRC, "*", "*.cu")) + glob.glob(os.path.join(CSRC, "*", "inst", "*.cu")))
    listing = {}
    for what in ("elf", "ptx"):
        res = subprocess.run([exe, f"--list-{what}", lib], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        listing[what] = [line.rsplit(".", 2)[-2] for line in res.stdout.splitlines() if line.strip()]
    assert sorted(listing["elf"]) == sorted(["sm_80", "sm_90a"] * units), listing
    assert listing["ptx"] == ["sm_90"] * units, listing
