"""effattn's CPU paths against SDPA in the same process: time ratios at 1 thread and at torch's
default thread count, forward and forward+backward.

    python3 -m benchmarks.cpu_vs_sdpa                      # B=1, H=8, D=64, L=256..4096, fp32
    python3 -m benchmarks.cpu_vs_sdpa --lengths 2048 4096 --out benchmarks/results/cpu/cpu_vs_sdpa.md

SDPA gets the same problem in its best CPU form: ``is_causal`` for causal attention, a boolean
``(L, L)`` mask for the sliding window and the block layout (SDPA has no other way to express them),
a boolean ``(B, 1, 1, L)`` mask for key padding (``(B, 1, L, L)`` with causal), causal softmax
attention for causal linear attention (the quadratic computation linear attention replaces). Masks
are built outside the timing. A ratio below 1 means effattn is faster. Each time is the median of
at least --runs rounds after one warm-up run (more until a row's mode took --min-seconds: short calls
get many rounds), effattn's and SDPA's runs interleaved in each round; each ratio comes with its 95%
interval, a bootstrap over the rounds resampled as pairs: an interval that reaches 1.0 means the two
are not told apart at this noise. The "load" column is the machine's 1-minute load average when the
row was measured.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

import effattn
from effattn.visibility import Rule

from .registry import variant

WINDOW = 256

# name -> (effattn call, SDPA call, SDPA's form); each gets (q, k, v, L)
CASES = {
    "dense": (lambda q, k, v, L, m: effattn.attention(q, k, v),
              lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v), "no mask"),
    "causal": (lambda q, k, v, L, m: effattn.attention(q, k, v, causal=True),
               lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v, is_causal=True), "is_causal"),
    f"window {WINDOW}": (lambda q, k, v, L, m: effattn.attention(q, k, v, causal=True, window=WINDOW),
                         lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                         "bool (L, L) mask"),
    "fixed layout": (lambda q, k, v, L, m: effattn.attention(q, k, v, causal=True, layout=m[1]),
                     lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m[0]),
                     "bool (L, L) mask"),
    "padding 1/4": (lambda q, k, v, L, m: effattn.attention(q, k, v, key_padding_mask=m[1]),
                    lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m[0]),
                    "bool (B, 1, 1, L) mask"),
    "causal, padding 1/4": (lambda q, k, v, L, m: effattn.attention(q, k, v, causal=True, key_padding_mask=m[1]),
                            lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m[0]),
                            "bool (B, 1, L, L) mask"),
    "causal linear elu": (lambda q, k, v, L, m: effattn.linear_attention(q, k, v, causal=True, feature_map="elu"),
                          lambda q, k, v, L, m: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          "is_causal (softmax)"),
}


def masks_for(name: str, L: int, batch: int = 1):
    if name.startswith("window"):
        return Rule.of(L, L, causal=True, window=WINDOW).materialize()
    if name == "fixed layout":
        layout = variant("fixed").layout(L)
        return Rule.of(L, L, causal=True, layout=layout).materialize(), layout
    if "padding" in name:                      # the last quarter of the keys is padding (True = ignore)
        pad = (torch.arange(L) >= (3 * L) // 4)[None].expand(batch, L)
        keep = ~pad[:, None, None, :]
        if name.startswith("causal"):
            keep = keep & Rule.of(L, L, causal=True).materialize()
        return keep, pad
    return None


def median_ms(fns, runs: int):
    """Median time of each function, their runs interleaved so that a change in the machine's load
    affects all of them alike."""
    return [statistics.median(t) for t in interleaved_ms(fns, runs)]


def interleaved_ms(fns, runs: int, min_seconds: float = 0.0):
    """Each function's times (ms), their runs interleaved: at least ``runs`` rounds, more until the
    rounds took ``min_seconds`` (a short call gets many rounds, so its ratio's interval is narrow)."""
    t_warm = time.perf_counter()
    for fn in fns:
        fn()                                                       # warm-up
    per_round = max(time.perf_counter() - t_warm, 1e-6)
    rounds = max(runs, min(int(min_seconds / per_round) + 1, 20 * max(runs, 1)))
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
    return times


def ratio_interval(a, b, level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """The ratio median(a) / median(b) and its ``level`` bootstrap interval, the rounds resampled as
    pairs (a round ran both; a change of load between rounds moves both). An interval reaching 1.0
    means the two are not told apart at this noise."""
    rng = random.Random(seed)
    n = len(a)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(a[i] for i in idx) / statistics.median(b[i] for i in idx))
    ratios.sort()
    lo, hi = ratios[int((1 - level) / 2 * resamples)], ratios[int((1 + level) / 2 * resamples) - 1]
    return statistics.median(a) / statistics.median(b), lo, hi


def measure(name: str, L: int, args, threads: int):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, L, args.head_dim, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(args.batch, args.heads, L, args.head_dim, generator=g)
    ours, sdpa, _ = CASES[name]
    m = masks_for(name, L, args.batch)
    row = {}

    def timed(f, mode):
        if mode == "fwd":
            def fn():
                with torch.no_grad():
                    f(q, k, v, L, m)
        else:
            def fn():
                q.grad = k.grad = v.grad = None
                f(q, k, v, L, m).backward(dout)
        return fn

    for mode in ("fwd", "fwd+bwd"):
        fns = [timed(ours, mode), timed(sdpa, mode)] + ([timed(sdpa, mode)] if args.control else [])
        a, b, *c = interleaved_ms(fns, args.runs, args.min_seconds)
        row[("effattn", mode)], row[("sdpa", mode)] = statistics.median(a), statistics.median(b)
        row[("ratio", mode)] = ratio_interval(a, b)
        row[("rounds", mode)] = len(a)
        if c:                       # SDPA against itself, third in each round: the noise of a ratio
            row[("control", mode)] = ratio_interval(c[0], b)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--runs", type=int, default=5, help="at least this many interleaved rounds per row and mode")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="more rounds until a row's mode took this long (short calls: many rounds)")
    p.add_argument("--control", action="store_true",
                   help="also time SDPA a second time in each round and report SDPA / SDPA (the noise)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    p.add_argument("--default-threads", type=int, default=None,
                   help="torch's default thread count, when the caller has changed it (benchmarks.run)")
    args = p.parse_args(argv)
    default = args.default_threads or torch.get_num_threads()
    header = (f"effattn {effattn.__version__} vs SDPA on CPU: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, fp32, "
              f"B={args.batch}, H={args.heads}, D={args.head_dim}, medians of at least {args.runs} interleaved "
              f"rounds (more until {args.min_seconds:g} s per row and mode); the ratio's 95% interval is a paired "
              f"bootstrap over the rounds; torch's default thread count here: {default}")
    control = " | SDPA/SDPA fwd (95%) | SDPA/SDPA fwd+bwd (95%)" if args.control else ""
    lines = [header, "",
             "| case | SDPA form | L | threads | effattn fwd ms | SDPA fwd ms | fwd ratio | fwd 95% | effattn fwd+bwd ms "
             "| SDPA fwd+bwd ms | fwd+bwd ratio | fwd+bwd 95% | rounds" + control + " | load |",
             "|---" * (14 + 2 * args.control) + "|"]
    print(header, flush=True)
    for L in args.lengths:
        for name in args.cases:
            for threads in sorted({1, default}):
                r = measure(name, L, args, threads)
                cells = [name, CASES[name][2], str(L), str(threads)]
                for mode in ("fwd", "fwd+bwd"):
                    a, b = r[("effattn", mode)], r[("sdpa", mode)]
                    ratio, lo, hi = r[("ratio", mode)]
                    cells += [f"{a:.1f}", f"{b:.1f}", f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}"]
                cells.append(f"{r[('rounds', 'fwd')]}/{r[('rounds', 'fwd+bwd')]}")
                if args.control:
                    cells += ["{:.3f} ({:.3f}-{:.3f})".format(*r[("control", mode)]) for mode in ("fwd", "fwd+bwd")]
                cells.append(f"{os.getloadavg()[0]:.1f}")
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    torch.set_num_threads(default)
    lines += ["", f"finished {datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC"]
    write_table(lines, args.out)


def write_table(lines, out):
    """Writes the table's lines (markdown) to the file `out`, when given."""
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
