"""The measurement behind ``torch/cpu-sdpa-mask``'s admission rule: that row (torch's fused CPU
kernel with a materialized mask) against ``torch/cpu-blocks`` (visible key blocks), each row run
directly on the same call, forward and forward+backward, at 1 and 2 threads.

    python3 -m benchmarks.cpu_sdpa_mask --out benchmarks/results/cpu/cpu_sdpa_mask.md
    python3 -m benchmarks.cpu_sdpa_mask --compact        # the padding-skip rule (`cpu_masked.COMPACT`)
    python3 -m benchmarks.cpu_sdpa_mask --causal-blocks  # causal calls in query blocks (`cpu_flash.SPLIT`)

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
from effattn.backends.torch.attention import cpu_blocks, cpu_flash, cpu_masked

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


def step(path, call, mode: str, dout, before=lambda: None):
    """One timed step of a row on a call: its forward without autograd ("fwd"), or forward and
    backward ("fwd+bwd", the inputs' gradients cleared first); ``before()`` runs first (a rule set)."""
    def fn():
        before()
        if mode == "fwd":
            with torch.no_grad():
                path.run(call)
        else:
            call.q.grad = call.k.grad = call.v.grad = None
            path.run(call)[0].backward(dout)
    return fn


def measure(name, L, args, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, args.heads, L, args.head_dim, generator=g).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(1, args.heads, L, args.head_dim, generator=g).to(dtype)
    call = make_attn_call(q, k, v, **CASES[name](L))
    row = {}
    for mode in ("fwd", "fwd+bwd"):
        row[mode] = median_ms([step(cpu_masked.PATH, call, mode, dout), step(cpu_blocks.PATH, call, mode, dout)],
                              args.runs)
    frac = cpu_masked.visible_fraction(call)
    rule = cpu_masked._rule(call)
    return row, frac, "mask" if not rule else "blocks"


def compact_rows(args):
    """The masked row with its key padding skipped (K and V gathered at the kept keys) against the
    same row reading every key under the mask, B=1, one thread: per length, padded keys and query
    rows. Each mode's runs in blocks (the masks are kept for one padding tensor at a time), the blocks
    alternated three times; the median of each mode's runs."""
    lines = ["| Lk | padded keys | Lq | skip fwd ms | read all fwd ms | fwd ratio | skip fwd+bwd ms "
             "| read all fwd+bwd ms | fwd+bwd ratio | rule |", "|---" * 10 + "|"]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    never, always = cpu_masked.Compact(pairs_per_key=1 << 62), cpu_masked.Compact(pairs_per_key=0)
    default = cpu_masked.COMPACT
    for L in args.lengths:
        for padded in sorted({2, 8, 16, L // 32, L // 4}):
            for Lq in sorted({1, 8, 64, L}):
                q = torch.randn(1, args.heads, Lq, args.head_dim, generator=g).requires_grad_()
                k, v = (torch.randn(1, args.heads, L, args.head_dim, generator=g).requires_grad_() for _ in range(2))
                dout = torch.randn(1, args.heads, Lq, args.head_dim, generator=g)
                # one padding tensor per mode: the row keeps the masks of a tensor, built under the rule then
                calls = {rule: make_attn_call(q, k, v, key_padding_mask=torch.arange(L)[None] >= L - padded)
                         for rule in (always, never)}
                times = {}
                for mode in ("fwd", "fwd+bwd"):
                    for rule in (always, never) * 3:
                        cpu_masked.COMPACT = rule
                        fn = step(cpu_masked.PATH, calls[rule], mode, dout)
                        times.setdefault((mode, rule), []).append(median_ms([fn], args.runs)[0])
                cpu_masked.COMPACT = default
                decides = "skip" if cpu_masked._compacts(Lq, L, L - padded) else "read all"
                cells = [str(L), str(padded), str(Lq)]
                for mode in ("fwd", "fwd+bwd"):
                    a, b = (sorted(times[(mode, r)])[1] for r in (always, never))
                    cells += [f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}"]
                lines.append("| " + " | ".join(cells + [decides]) + " |")
                print(lines[-1], flush=True)
    return lines


def causal_block_rows(args):
    """``torch/cpu-flash`` on causal calls cut in 2 and 4 query blocks (each against the keys up to
    its end) against one causal kernel call, B=1, float32, at each thread count; the row's ``run``
    timed, its modes interleaved (`cpu_flash.SPLIT` set around each)."""
    lines = ["| L | threads | 1 block fwd ms | 2 blocks fwd | 4 blocks fwd | 1 block fwd+bwd ms | 2 blocks fwd+bwd "
             "| 4 blocks fwd+bwd | rule |", "|---" * 9 + "|"]
    default = cpu_flash.SPLIT
    modes = [default._replace(min_len=1, max_len=1 << 62, pieces=p) for p in (1, 2, 4)]
    for L in args.lengths:
        for threads in args.threads:
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, args.heads, L, args.head_dim, generator=g).requires_grad_() for _ in range(3))
            dout = torch.randn(1, args.heads, L, args.head_dim, generator=g)
            call = make_attn_call(q, k, v, causal=True)
            cells = [str(L), str(threads)]
            for mode in ("fwd", "fwd+bwd"):
                def use(split):
                    return lambda: setattr(cpu_flash, "SPLIT", split)
                try:
                    one, two, four = median_ms([step(cpu_flash.PATH, call, mode, dout, use(m)) for m in modes],
                                               args.runs)
                finally:
                    cpu_flash.SPLIT = default
                cells += [f"{one:.3f}", f"{two / one:.2f}x", f"{four / one:.2f}x"]
            rule = cpu_flash._blocks(q, k, True)
            lines.append("| " + " | ".join(cells + [f"{len(rule)} blocks" if rule else "1 call"]) + " |")
            print(lines[-1], flush=True)
    return lines


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
    p.add_argument("--causal-blocks", action="store_true",
                   help="time causal calls cut in query blocks against one kernel call (torch/cpu-flash)")
    p.add_argument("--compact", action="store_true",
                   help="time the key padding skip against reading every key instead (one thread, B=1)")
    args = p.parse_args(argv)
    default = torch.get_num_threads()
    if args.causal_blocks or args.compact:
        what, rows, timing = (("torch/cpu-flash, causal calls in query blocks vs one call", causal_block_rows,
                               f"median of {args.runs} interleaved runs") if args.causal_blocks else
                              ("torch/cpu-sdpa-mask, key padding skipped vs every key read", compact_rows,
                               f"1 thread, median of 3 blocks of {args.runs} runs"))
        header = (f"{what} (effattn {effattn.__version__}): torch {torch.__version__}, "
                  f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
                  f"{os.getloadavg()[0]:.1f} at start, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, float32, B=1, "
                  f"H={args.heads}, D={args.head_dim}, {timing}")
        print(header, flush=True)
        lines = [header, ""] + rows(args)
        torch.set_num_threads(default)
        write_table(lines + ["", f"load average at end {os.getloadavg()[0]:.1f}"], args.out)
        return
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
