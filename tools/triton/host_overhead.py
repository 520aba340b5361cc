"""Host overhead of the Triton attention backend: CPU time per call with the kernel launches stubbed.

On a GPU a small attention call is bound by its host work (argument checks, dispatch, the launch
plan, Triton's launch path), not by the kernels. This measures the part effattn owns: the public
call down to the kernel launch, with each kernel replaced by a stub that only receives its
arguments (Triton's own launch path, about 10-20 us per launch on a GPU host, is not included).
It runs on CPU tensors under ``TRITON_INTERPRET=1`` (set here), so it needs no GPU.

Two columns per mode: the eager call as a user makes it (plain tensors, no mode active: the
launchers are called without the torch.library layer), and the same call through the
``effattn::triton_attention_fwd`` / ``_bwd`` ops (the path of torch.compile, tensor subclasses,
dispatch modes and the profiler), which adds torch's Python dispatch of custom ops.
``benchmarks/results/cpu/host_overhead.md`` has the numbers before and after the host-path work.

    python -m tools.triton.host_overhead                  # forward and forward+backward, us per call
    python -m tools.triton.host_overhead --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported

# (name, attention kwargs, shapes (B, H, Hkv, L, D))
CASES = [
    ("dense", dict(), (2, 8, 8, 1024, 64)),
    ("causal", dict(causal=True), (2, 8, 8, 1024, 64)),
    ("window-gqa", dict(causal=True, window=(256, 0)), (2, 8, 2, 1024, 128)),
    ("layout", "layout", (2, 8, 8, 1024, 64)),
]


class _Stub:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` records nothing and
    launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **meta: None


def stub_launches():
    from effattn.backends.triton.attention import launch
    for name in ("fwd_kernel", "delta_kernel", "bwd_kernel"):
        setattr(launch, name, _Stub())


def per_call_us(fn, min_time: float = 0.5) -> float:
    """Median over 5 rounds of the mean CPU time per call (this process's, so that other load on
    the machine does not count), each round at least `min_time` / 5 s."""
    fn()
    n, rounds = 1, []
    while True:
        t0 = time.process_time()
        for _ in range(n):
            fn()
        dt = time.process_time() - t0
        if dt > min_time / 5:
            break
        n *= 2
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        rounds.append((time.process_time() - t0) / n)
    return sorted(rounds)[2] * 1e6


def measure(min_time: float = 0.5, via_ops: bool = True):
    import torch

    import effattn
    from effattn.layouts import sliding_and_summary
    stub_launches()
    from effattn.backends import autograd
    direct = autograd.direct
    rows = []
    for name, kw, (B, H, Hkv, L, D) in CASES:
        q = torch.randn(B, H, L, D)
        k, v = (torch.randn(B, Hkv, L, D) for _ in range(2))
        if kw == "layout":
            kw = dict(causal=True, layout=sliding_and_summary(L, 64, local_blocks=4, every=4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                effattn.attention(q, k, v, backend="triton", **kw)

        def fwd_bwd():
            out = effattn.attention(*leaves, backend="triton", **kw)
            torch.autograd.grad(out, leaves, out)          # no .grad accumulation (it would touch memory)

        row = dict(case=name, shape=f"B{B} H{H} Hkv{Hkv} L{L} D{D}", fwd_us=per_call_us(fwd, min_time),
                   fwd_bwd_us=per_call_us(fwd_bwd, min_time))
        if via_ops:
            autograd.direct = lambda *tensors: False
            try:
                row.update(fwd_ops_us=per_call_us(fwd, min_time), fwd_bwd_ops_us=per_call_us(fwd_bwd, min_time))
            finally:
                autograd.direct = direct
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per measurement")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    rows = measure(args.min_time)
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| case | shape | forward us/call | via the ops | forward+backward us/call | via the ops |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        ops = [f"{r[k]:.0f}" if k in r else "-" for k in ("fwd_ops_us", "fwd_bwd_ops_us")]
        print(f"| {r['case']} | {r['shape']} | {r['fwd_us']:.0f} | {ops[0]} | {r['fwd_bwd_us']:.0f} | {ops[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
