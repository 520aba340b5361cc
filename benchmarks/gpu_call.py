"""One GPU call, prepared on the CPU: ``python3 -m benchmarks.gpu_call [--call 1|2] [--dry-run]``.

A GPU is lent rarely and for minutes, so a call is planned here and run there as one command. A call
is a list of stages (a shell command, a time budget in seconds, a log file); call 1 installs effattn
without dependencies, builds the CUDA extension for the local arch in the background while the Triton
correctness tests run at real sizes, then runs the CUDA tests and the first sections of the benchmark
suite; call 2 takes what call 1 did not reach (the other sections, the sanitizers); call 3, a session
of its own, runs the Long Range Arena plan (``python -m benchmarks.lra gpu-plan``: Table 2, then a
full ListOps run per variant) within its limit, the steps already committed skipped. Every stage runs
under ``timeout`` within its budget and within what is left of the whole call (``--limit`` seconds);
a stage that fails or runs out of time is recorded and the call goes on. Logs and results go under
``--out`` (default ``$OUT``) as one archive and a summary (a lent GPU returns at most 8 files); the last thing printed is a table of the stages and then the suite's
table of ratios. ``--dry-run`` prints the plan and the total budget on any machine;
``benchmarks/tests/test_gpu_call.py`` keeps each call within its limit.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

CALL_LIMIT_S = 590            # one device call: at most 600 s; what is left after the machine's start
# a session has 15 minutes of device time in all, the machine's start (~30 s) and its idle 30 s after each
# call included: call 1 takes most of it, call 2 runs on the still-warm machine right after
CALL_LIMITS = {1: 585, 2: 240, 3: 585}
#: the calls one session makes (15 device minutes each): call 3 has a session to itself
SESSIONS = ((1, 2), (3,))
FLA_WHEELS = ".whl"           # ignored folder carried to the GPU: fla-core (pure Python) and its kin


@dataclass(frozen=True)
class Stage:
    name: str
    command: str              # run by bash in the repository root
    budget_s: int
    background: bool = False  # started, not waited for, until a stage with wait_for names it
    wait_for: Optional[str] = None


TRITON_TESTS = ("tests/contract/test_gpu.py tests/backends/triton/test_triton_backward.py "
                "tests/backends/triton/test_triton_decode.py tests/backends/triton/test_triton_linear.py tests/core/test_paged.py")
CUDA_TESTS = ("tests/contract/test_gpu.py tests/backends/cuda/test_cuda_gpu.py tests/backends/cuda/test_cuda_linear_gpu.py "
              "tests/backends/cuda/test_cuda_decode.py tests/backends/cuda/test_cuda_wgmma.py tests/backends/cuda/test_cuda_hopper_bwd.py")
# four pytest workers share the GPU: the first H200 run spent its 210 s compiling Triton kernels one
# test at a time (41 tests ran); the image has pytest-xdist. The contract tests are collected once per
# backend: the CUDA stage after the build (collected before it, the extension is not there yet).
PYTEST = ("EFFATTN_FAILURE_LOG={out}/failures.txt python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "
          "--durations=15 -n 4")
SUITE = "python3 -m benchmarks.suite --no-plots --out {out}/suite{call}"
# the LRA plan writes into the repository's copy on the machine, where the results committed from
# earlier calls mark their steps done; its results (not its checkpoints) come back under {out}/lra, to
# be committed in benchmarks/results/lra-gpu-plan/. A run cut short restarts in the next session (its
# checkpoint stays on the machine).
LRA_RESULTS = "benchmarks/results/lra-gpu-plan"
LRA_PLAN = (f"python3 -m benchmarks.lra gpu-plan --run --out {LRA_RESULTS} --total-minutes 8.3; rc=$?; "
            f"mkdir -p {{out}}/lra && cd {LRA_RESULTS} && find . -name '*.json' -o -name '*.md' -o -name '*.csv' "
            "-o -name '*.png' | xargs -r cp --parents -t {out}/lra; exit $rc")
SANITIZE = ("compute-sanitizer --tool {tool} --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider "
            "tests/backends/cuda/test_cuda_gpu.py -k 'bf16 and not deterministic' -x")


def stages(call: int) -> List[Stage]:
    install = Stage("install", "EFFATTN_BUILD_CUDA=0 python3 -m pip install -q --no-deps --no-build-isolation -e . "
                    f"&& (ls {FLA_WHEELS}/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps "
                    f"--target /tmp/site {FLA_WHEELS}/*.whl || true)", 30)
    # on the warm machine of call 1 the built extension is still there (ignored build outputs stay)
    build = Stage("cuda-build", "if ls effattn/_C*.so >/dev/null 2>&1 && [ \"$(cat build/.sources 2>/dev/null)\" = "
                  "\"$(cat csrc/*/*.cu* csrc/*/inst/*.cu csrc/*/*.h* csrc/*/*.cpp 2>/dev/null | md5sum)\" ]; then echo kept the built extension; "
                  "else TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=12 EFFATTN_BUILD_CUDA=1 python3 setup.py -q build_ext --inplace "
                  "&& mkdir -p build && cat csrc/*/*.cu* csrc/*/inst/*.cu csrc/*/*.h* csrc/*/*.cpp 2>/dev/null | md5sum > build/.sources; fi",
                  240, background=True)
    env = Stage("env", "nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, torch.version.cuda, "
                "triton.__version__, torch.cuda.get_device_name())'; nvcc --version | tail -2", 20)
    if call == 1:
        return [
            env, install, build,
            Stage("triton-tests", f"EFFATTN_GPU_BACKENDS=triton {PYTEST} {TRITON_TESTS} "
                  "--junitxml={out}/triton-tests.xml", 180),
            # the Gluon forward trial (tools/triton/gluon_fwd.py): float64 error and time beside SDPA flash
            Stage("gluon", "python3 -m tools.triton.gluon_fwd --run > {out}/gluon.json; rc=$?; cat {out}/gluon.json; exit $rc", 25),
            Stage("cuda-tests", f"EFFATTN_GPU_BACKENDS=cuda {PYTEST} {CUDA_TESTS} --junitxml={{out}}/cuda-tests.xml",
                  100, wait_for="cuda-build"),
            Stage("suite", SUITE + " --time-limit 3.5 --sections anchors-d128,causal-64k,linear,decode --budget "
                  "precompile=40,explore=0,anchors-d128=60,causal-64k=25,linear=45,decode=10,recheck=15,checks=0",
                  215),
        ]
    if call == 2:
        return [
            env, install, build,
            Stage("suite", SUITE + " --time-limit 2.3 --sections anchors-d64,hopper,gqa,sparse-long,host --budget "
                  "precompile=30,explore=0,anchors-d64=30,hopper=10,gqa=15,sparse-long=30,host=10,recheck=10,checks=0",
                  140, wait_for="cuda-build"),
            Stage("sanitizer", " && ".join(SANITIZE.format(tool=t) for t in ("racecheck", "synccheck")), 45),
        ]
    if call == 3:
        return [env, install, Stage("lra", LRA_PLAN, 520)]
    raise SystemExit(f"--call: 1, 2 or 3, not {call}")


def total_budget(call: int) -> int:
    """Seconds the call can take: background stages overlap the foreground ones up to their waiter."""
    fg = sum(s.budget_s for s in stages(call) if not s.background)
    return fg


def plan_text(call: int, limit: int) -> str:
    lines = [f"GPU call {call} (limit {limit} s; stages within their budgets and what is left):"]
    for s in stages(call):
        how = "background" if s.background else (f"after {s.wait_for}" if s.wait_for else "")
        lines.append(f"  {s.name:<14} {s.budget_s:>4} s  {how:<18} {s.command}")
    lines.append(f"foreground budgets sum to {total_budget(call)} s ({total_budget(call) / 60:.1f} min)")
    return "\n".join(lines)


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in ("/tmp/site", os.getcwd(), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "8")
    return env


def run_call(call: int, final: Path, limit: int) -> int:
    """Runs the call's stages in a scratch folder, then packs it into ``final/call<N>.tgz`` with the
    printed summary beside it as ``summary.txt`` (a lent GPU sends back at most 8 files)."""
    final.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"gpu-call{call}-"))
    end = time.monotonic() + limit - 10
    rows, running = [], {}
    env = _env()

    def finish(name, proc, t0, log, budget):
        try:
            rc = proc.wait(timeout=max(1, min(budget, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # the stage's whole process group (pytest, nvcc, ...)
            except ProcessLookupError:
                pass
            proc.wait()
            rc = "timeout"
        rows.append((name, rc, time.monotonic() - t0, log))

    for s in stages(call):
        if s.wait_for and s.wait_for in running:
            proc, t0, log, budget = running.pop(s.wait_for)
            finish(s.wait_for, proc, t0, log, budget - (time.monotonic() - t0))
        left = end - time.monotonic()
        if left < 15:
            rows.append((s.name, "no time", 0.0, None))
            continue
        log = out / f"{s.name}.log"
        cmd = s.command.format(out=shlex.quote(str(out)), call=call)
        print(f"[{time.strftime('%H:%M:%S')}] {s.name}: {cmd}", file=sys.stderr, flush=True)
        f = open(log, "w")
        proc = subprocess.Popen(["bash", "-c", cmd], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        if s.background:
            running[s.name] = (proc, time.monotonic(), log, s.budget_s)
            continue
        finish(s.name, proc, time.monotonic(), log, s.budget_s)
    for name, (proc, t0, log, budget) in running.items():
        finish(name, proc, t0, log, budget - (time.monotonic() - t0))
    lines = [_tail(log, 30) for _, _, _, log in rows if log is not None and log.name == "suite.log"]
    lines += [_tail(out / "failures.txt", 60), f"\nGPU call {call}: stage, exit, seconds, last line"]
    lines += [f"  {name:<14} {str(rc):>8} {secs:6.0f}  {_tail(log, 1)[:300] if log else ''}" for name, rc, secs, log in rows]
    summary = "\n".join(x for x in lines if x)
    (out / "summary.txt").write_text(summary + "\n")
    (final / "summary.txt").write_text(summary + "\n")
    with tarfile.open(final / f"call{call}.tgz", "w:gz") as tar:
        tar.add(out, arcname=f"call{call}")
    print(summary)
    return 0 if all(rc == 0 for _, rc, _, _ in rows) else 1


def _tail(log: Path, n: int) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").strip().splitlines()[-n:])[:2000]
    except OSError:
        return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--call", type=int, default=1)
    p.add_argument("--limit", type=int, default=None, help="seconds for the whole call (default: CALL_LIMITS)")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/runs/gpu-call")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    a.limit = a.limit or CALL_LIMITS.get(a.call, CALL_LIMIT_S)
    if a.dry_run:
        print(plan_text(a.call, a.limit))
        return 0
    return run_call(a.call, Path(a.out), a.limit)


if __name__ == "__main__":
    sys.exit(main())
