"""The relative, paged, LSH and linear Triton kernels compiled offline as their launchers launch them.

Each case runs one effattn launcher on small CPU tensors with every Triton launch recorded instead of
run (`benchmarks.suite.kernels.spy`; the autotuners take their default config), then compiles each
recorded launch for ``sm_<arch>`` through Triton's own binder (``warmup`` with a stand-in driver:
the arguments are specialized as at a launch on such a GPU, by keyword or by position, tuples element
by element). A row: the case, the launch's place in it, an override of its constexprs (``gpu``: the
choices a CUDA tensor gives that a CPU one does not: ``LOW`` half-precision dots, the relative kernels'
32-row tiles), then shared memory, registers, stack, spills, matrix instructions, instruction counts
and a hash of the SASS instructions (kernel names left out: two kernels with the same hash run the same
code). A changed launch path (argument names, keyword launches, stride tuples) compiles to the same
kernels iff every row's hash is unchanged.

    python -m tools.triton.launch_resources                        # sm_90, every case
    python -m tools.triton.launch_resources --cases paged,lsh --json

Run it without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List

import torch

from .kernel_resources import cuobjdump, resources

# constexpr overrides per variant: a CUDA tensor's choices (half-precision dots, 32-row relative tiles)
GPU = dict(LOW=True, BM=32, BN=32, BD=32, W=64, W2=64)


def _rel(past_only: bool, left: int, right: int, kpm: bool):
    def run(dtype):
        from effattn.backends.triton.relative.launch import relative_backward, relative_forward
        B, H, Hkv, L, D = 2, 4, 2, 128, 64
        q, query = torch.randn(B, H, L, D, dtype=dtype), torch.randn(B, H, L, D, dtype=dtype)
        k, v = torch.randn(B, Hkv, L, D, dtype=dtype), torch.randn(B, Hkv, L, D, dtype=dtype)
        M = None if past_only else 32
        r = torch.randn(H, 64 if past_only else 2 * M + 1, D, dtype=dtype)
        pad = torch.zeros(B, L, dtype=torch.bool) if kpm else None
        out, lse = relative_forward(q, k, v, r, query, M, left, right, pad, 0.125)
        relative_backward(torch.randn_like(out), None, q, k, v, r, query, out, lse, M, left, right, pad, 0.125)
    return run


def _paged(H: int, Hkv: int, Lq: int, left: int, right: int, keys_per_split=None):
    def run(dtype):
        from effattn.backends.triton.paged.launch import paged_forward
        B, D, page, pages = 2, 64, 16, 64
        q = torch.randn(B, H, Lq, D, dtype=dtype)
        kp, vp = (torch.randn(B * pages, page, Hkv, D, dtype=dtype) for _ in range(2))
        table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
        lens = torch.full((B,), pages * page, dtype=torch.int32)
        paged_forward(q, kp, vp, table, lens, left, right, 0.125, keys_per_split=keys_per_split)
    return run


def _lsh(causal: bool, kpm: bool, dropout_p: float):
    def run(dtype):
        # the triton/lsh row: the block-sparse attention kernels with positions (``POS``) on the sorted rows
        from effattn.backends.triton.attention import launch
        from effattn.lsh import cached_lsh_layout
        from effattn.numerics import draw_seed
        N, L, D, CL = 4, 256, 64, 64
        q, k, v = (torch.randn(1, N, L, D, dtype=dtype) for _ in range(3))
        q_pos = torch.stack([torch.randperm(L) for _ in range(N)]).to(torch.int32)
        k_pos = q_pos.masked_fill(torch.rand(N, L) < 0.1, -1) if kpm else q_pos
        mask = cached_lsh_layout(L, CL, [0, L // CL - 1]).mask
        seed = draw_seed() if dropout_p > 0 else None
        pos = dict(out_fp32=True, q_pos=q_pos, k_pos=k_pos, pos_causal=causal)
        out, lse = launch.fwd(q, k, v, mask, CL, None, seed, 1.0, dropout_p, -1, -1, **pos)
        launch.bwd(torch.randn(out.shape, dtype=dtype), None, q, k, v, out, lse, mask, CL, None, seed, 1.0, dropout_p,
                   -1, -1, **pos)
    return run


def _linear(kind: str):
    def run(dtype):
        from effattn.backends.triton.linear import ops
        B, H, Hkv, L, F = 1, 4, 2, 256, 128
        q = torch.randn(B, H, L, F, dtype=dtype)
        k, v = torch.randn(B, Hkv, L, F, dtype=dtype), torch.randn(B, Hkv, L, F, dtype=dtype)
        if kind == "causal":
            out, den, _, _ = ops.causal_fwd(q, k, v, None, None, 0, 1, True, 1e-6, False)
            ops.causal_bwd(torch.randn_like(out), None, None, q, k, v, out, den, None, None, 0, 1, True, 1e-6, False)
        elif kind == "noncausal":
            S, z = ops.kv_state_fwd(k, v, 1, False)
            out, den = ops.apply_fwd(q, S, z, None, None, 1, True, 1e-6, dtype, False)
            dq, dS, dz, _, _ = ops.apply_bwd(torch.randn_like(out), q, S, z, None, None, out, den, 1, True, 1e-6,
                                             False)
            ops.kv_state_bwd(dS, dz, k, v, 1, False)
        else:
            ops.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], torch.zeros(B, H, F, F), torch.zeros(B, H, F), 1, True,
                     1e-6)
    return run


CASES: Dict[str, Callable] = {
    "relative-bidir-causal-kpm": _rel(False, -1, 0, True),
    "relative-past-window": _rel(True, 48, 0, False),
    "relative-bidir-dense": _rel(False, -1, -1, False),
    "paged-prefill-causal": _paged(4, 4, 64, -1, 0),
    "paged-decode-split-gqa": _paged(8, 2, 1, -1, 0, keys_per_split=512),
    "paged-decode-window-mha": _paged(4, 4, 4, 128, 0),
    "lsh-causal-kpm-dropout": _lsh(True, True, 0.1),
    "lsh-plain": _lsh(False, False, 0.0),
    "linear-causal": _linear("causal"),
    "linear-noncausal": _linear("noncausal"),
    "linear-step": _linear("step"),
}
_FAMILY = ("relative", "paged", "lsh", "linear")


@contextlib.contextmanager
def _defaults_only():
    """The autotuned launchers take their first (default) config, as under EFFATTN_TRITON_AUTOTUNE=0."""
    env = os.environ.get("EFFATTN_TRITON_AUTOTUNE")
    capturing = torch.cuda.is_current_stream_capturing
    os.environ["EFFATTN_TRITON_AUTOTUNE"] = "0"
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = capturing
        if env is None:
            os.environ.pop("EFFATTN_TRITON_AUTOTUNE", None)
        else:
            os.environ["EFFATTN_TRITON_AUTOTUNE"] = env


def record(case: str, dtype: torch.dtype) -> list:
    """The launches of `case` (`benchmarks.suite.kernels.Variant`s) in launch order, duplicates kept once."""
    from benchmarks.suite.kernels import spy
    torch.manual_seed(0)
    with _defaults_only(), spy(launch=False) as seen:
        CASES[case](dtype)
    return list({v.key: v for v in seen}.values())


def sass_hash(kernel) -> str:
    """sha256 (first 16 hex digits) of the SASS instructions, without the kernel's name."""
    tool = cuobjdump()
    if tool is None:
        return "?"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    instrs = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", sass)
    return hashlib.sha256("\n".join(instrs).encode()).hexdigest()[:16]


def measure(job) -> Dict[str, object]:
    arch, case, dtype, index, override, var = job
    row = dict(case=case, dtype=dtype, launch=index, kernel=var.name, override=override)
    try:
        import importlib

        from triton.runtime import driver

        from benchmarks.suite.kernels import _OfflineDriver
        driver.set_active(_OfflineDriver(arch))
        kwargs = dict(var.kwargs)
        if override == "gpu":
            kwargs.update({n: v for n, v in GPU.items() if n in kwargs})
        fn = getattr(importlib.import_module(var.module), var.name)
        compiled = fn.warmup(*var.args, grid=(1,), **kwargs)
        row.update(resources(compiled))
        row["sass"] = sass_hash(compiled)
    except Exception as e:  # noqa: BLE001 - a compile error is a result
        row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
    return row


def jobs(arch: int, cases: List[str], dtypes: List[str]) -> list:
    out = []
    for case in cases:
        for dt in dtypes:
            for i, var in enumerate(record(case, getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dt]))):
                kw = dict(var.kwargs)
                out.append((arch, case, dt, i, "", var))
                if any(n in kw and kw[n] != v for n, v in GPU.items()):
                    out.append((arch, case, dt, i, "gpu", var))
    return out


COLUMNS = ("regs", "stack", "spills", "loop_spills", "shared", "hgmma", "hmma", "instrs", "loop_instrs", "sass")


def to_markdown(rows: List[dict], arch: int) -> str:
    import triton
    lines = [f"Relative / paged / LSH / linear Triton kernels as launched, sm_{arch}, triton {triton.__version__}", "",
             "| case | dtype | launch | kernel | override | " + " | ".join(COLUMNS) + " |",
             "|---|---|---|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            cells = [f"error: {r['error'][:120]}"] + [""] * (len(COLUMNS) - 1)
        else:
            cells = [str(r.get(c, "?")) for c in COLUMNS]
        lines.append(f"| {r['case']} | {r['dtype']} | {r['launch']} | {r['kernel']} | {r['override'] or '-'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--cases", default=",".join(_FAMILY),
                    help=f"comma list of cases or families ({', '.join(_FAMILY)}); cases: {', '.join(CASES)}")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true", help="one JSON object per kernel instead of the table")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    cases = [c for name in args.cases.split(",") for c in CASES if c == name or c.startswith(name + "-")]
    if not cases:
        ap.error(f"--cases takes {', '.join(_FAMILY)} or {', '.join(CASES)}")
    todo = jobs(args.arch, cases, args.dtypes.split(","))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.processes, len(todo))), mp_context=ctx) as pool:
        rows = list(pool.map(measure, todo))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(to_markdown(rows, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
