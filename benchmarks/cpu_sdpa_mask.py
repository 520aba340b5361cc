"""The measurement behind ``torch/cpu-sdpa-mask``'s admission rule: that row (torch's fused CPU
kernel with a materialized mask) against ``torch/cpu-blocks`` (visible key blocks), each row run
directly on the same call, forward and forward+backward, at 1 and 2 threads.

    python3 -m benchmarks.cpu_sdpa_mask --out benchmarks/results/cpu/cpu_sdpa_mask.md

A ratio below 1 means the masked kernel is faster. The last column is what the rule
(`effattn.backends.torch.attention.cpu_masked.ADMIT`) decides for the call. Each time is the median
of --runs runs after a warm-up, the two rows' runs interleaved.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

import effattn
from effattn._call import make_attn_call
from effattn.backends.torch.attention import cpu_blocks, cpu_masked

from .cpu_vs_sdpa import median_ms, write_table
from .registry import variant

# name -> keyword arguments of the call for a length L
CASES = {
    "window 64": lambda L: dict(causal=True, window=64),
    "window 256": lambda L: dict(causal=True, window=256),
    "window 512": lambda L: dict(causal=True, window=512),
    "fixed layout": lambda L: dict(causal=True, layout=variant("fixed").layout(L)),
    "padding 1/4": lambda L: dict(key_padding_mask=torch.arange(L)[None] >= (3 * L) // 4),
    "causal, padding 1/4": lambda L: dict(causal=True, key_padding_mask=torch.arange(L)[None] >= (3 * L) // 4),
}


def measure(name, L, args, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, args.heads, L, args.head_dim, generator=g).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(1, args.heads, L, args.head_dim, generator=g).to(dtype)
    call = make_attn_call(q, k, v, **CASES[name](L))
    row = {}
    for mode in ("fwd", "fwd+bwd"):
        def timed(path):
            def fn():
                if mode == "fwd":
                    with torch.no_grad():
                        path.run(call)
                else:
                    q.grad = k.grad = v.grad = None
                    path.run(call)[0].backward(dout)
            return fn
        row[mode] = median_ms([timed(cpu_masked.PATH), timed(cpu_blocks.PATH)], args.runs)
    frac = cpu_masked.visible_fraction(call)
    rule = cpu_masked._rule(call)
    return row, frac, "mask" if not rule else "blocks"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    default = torch.get_num_threads()
    header = (f"torch/cpu-sdpa-mask vs torch/cpu-blocks (effattn {effattn.__version__}): torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at start, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {args.dtype}, "
              f"B=1, H={args.heads}, D={args.head_dim}, median of {args.runs}")
    lines = [header, "",
             "| case | L | visible | threads | mask fwd ms | blocks fwd ms | fwd ratio | mask fwd+bwd ms "
             "| blocks fwd+bwd ms | fwd+bwd ratio | rule |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(header, flush=True)
    for L in args.lengths:
        for name in args.cases:
            for threads in args.threads:
                r, frac, rule = measure(name, L, args, threads)
                cells = [name, str(L), f"{frac:.3f}", str(threads)]
                for mode in ("fwd", "fwd+bwd"):
                    a, b = r[mode]
                    cells += [f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"]
                lines.append("| " + " | ".join(cells + [rule]) + " |")
                print(lines[-1], flush=True)
    torch.set_num_threads(default)
    lines.append("")
    lines.append(f"load average at end {os.getloadavg()[0]:.1f}")
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
