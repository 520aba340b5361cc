"""Time and peak memory of Reformer's LSH attention, relative-position attention and paged decoding
against their baselines (one table, markdown on stdout and CSV with ``--csv``):

- ``lsh``: `effattn.lsh_attention` (each path it has here) vs dense `effattn.attention`, forward+backward;
- ``relative``: `effattn.relative_attention` (each path) vs the dense formula under autograd
  (the unfused reference: scores + the relative term as a ``(B, H, L, L)`` matrix), forward+backward;
- ``paged``: a decode step over a paged cache (each path) vs `effattn.attention` on contiguous keys.

    python -m benchmarks.lsh_relative_paged --lengths 4096 16384 65536          # on a GPU
    python -m benchmarks.lsh_relative_paged --lengths 1024 2048 --heads 2      # a CPU smoke run

Uses `benchmarks.measure` (median time, peak memory beyond the inputs); an out-of-memory or failing
configuration gets its one-line error in the table instead of numbers.
"""
from __future__ import annotations

import argparse
import csv
import sys
from typing import Callable, Dict, List

import torch

import effattn
from effattn.relative import relative_scores

from .measure import free_memory, is_oom, one_line, peak_memory_mib, time_ms


def _fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run():
        fn().float().sum().backward()
    return run


def _cases(kind: str, L: int, args, device, dtype) -> Dict[str, Callable[[], None]]:
    B, H, D = args.batch, args.heads, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_(grad)

    paths = ["torch"] + (["triton"] if device.type == "cuda" else [])
    if kind == "lsh":
        qk, v = t(B, H, L, D), t(B, H, L, D)
        cases = {f"lsh-{p}": _fwd_bwd(lambda p=p: effattn.lsh_attention(qk, v, n_hashes=args.n_hashes, chunk_len=64,
                                                                        backend=p)) for p in paths}
        cases["dense"] = _fwd_bwd(lambda: effattn.attention(qk, qk, v))
        return cases
    if kind == "relative":
        q, k, v, r = t(B, H, L, D), t(B, H, L, D), t(B, H, L, D), t(H, L, D)
        cases = {f"relative-{p}": _fwd_bwd(lambda p=p: effattn.relative_attention(q, k, v, r, causal=True, backend=p))
                 for p in paths}

        def unfused():
            s = (q @ k.transpose(-1, -2) + relative_scores(q, r, L)) / D ** 0.5
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=device).triu(1), float("-inf"))
            return torch.softmax(s.float(), -1).to(dtype) @ v
        cases["unfused-reference"] = _fwd_bwd(unfused)
        return cases
    # paged: one decode step, pages of 16 scattered over the pool
    ps = 16
    n_pages = B * (L // ps)
    kp, vp = t(n_pages, ps, H, D, grad=False), t(n_pages, ps, H, D, grad=False)
    table = torch.randperm(n_pages, device=device, generator=g).view(B, L // ps).to(torch.int32)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    q = t(B, H, 1, D, grad=False)
    k = kp[table.long()].reshape(B, L, H, D).transpose(1, 2)
    v = vp[table.long()].reshape(B, L, H, D).transpose(1, 2)
    cases = {f"paged-{'gather' if p == 'torch' else p}": (lambda p=p: effattn.attention(
        q, kp, vp, block_table=table, seqlens=lens, causal=True, backend=p)) for p in paths}
    cases["contiguous"] = lambda: effattn.attention(q, k, v, causal=True)
    return cases


def run(args) -> List[Dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for kind in args.kinds:
        for L in args.lengths:
            try:
                cases = _cases(kind, L, args, device, dtype)
            except Exception as e:                       # noqa: BLE001 - reported in the table
                rows.append(dict(kind=kind, impl="setup", length=L, ms=None, peak_mib=None, error=one_line(e)))
                continue
            for name, fn in cases.items():
                row = dict(kind=kind, impl=name, length=L, ms=None, peak_mib=None, error="")
                try:
                    with torch.set_grad_enabled(kind != "paged"):
                        row["ms"] = round(time_ms(fn, device, budget_s=args.budget), 3)
                        row["peak_mib"] = peak_memory_mib(fn, device)
                except Exception as e:                   # noqa: BLE001 - OOM or a refusal, reported
                    row["error"] = ("OOM: " if is_oom(e) else "") + one_line(e)
                free_memory(device)
                rows.append(row)
    return rows


def markdown(rows: List[Dict]) -> str:
    lines = ["| kind | implementation | L | ms | peak MiB | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {r['kind']} | {r['impl']} | {r['length']} | {r['ms'] if r['ms'] is not None else ''} | "
                     f"{peak} | {r['error']} |")
    return "\n".join(lines)


def main(argv=None) -> List[Dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["lsh", "relative", "paged"], choices=["lsh", "relative", "paged"])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--n-hashes", type=int, default=2)
    p.add_argument("--dtype", default="float16" if torch.cuda.is_available() else "float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--csv")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args)
    print(markdown(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
