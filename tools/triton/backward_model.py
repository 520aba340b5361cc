"""The seven-product backward against the five-product one, predicted from offline compiles.

Compiles both backward kinds (`bwd_kernel` without and with ``FIVE``) for sm_90 as the launcher
specializes them (`kernel_resources.compile_kernel`), reads their full-tile loops and predicts the
time per (query, key) pair on an H100 SXM from three bounds; it runs nothing and times nothing, so
every number it prints is a prediction:

- issue: warp instructions per pair (each tile loop's SASS length x warps / tile pairs) at 4 per
  clock per SM, 132 SMs, 1.755 GHz;
- tensor: 2 x D flops per product per pair (7 or 5 products) at the dense bf16 peak (989 TFLOP/s);
- memory (five-product only): the fp32 dQ partials, 4 x D / BLOCK_N1 bytes per pair written by
  the dK/dV programs (overlapped with them) and read again by `dq_reduce_kernel` (after them: added),
  at 3.35 TB/s.

A program's time is the larger of its issue and tensor bounds (no latency model; both kinds equally
optimistic), so the ratio between the two backwards is what to read, not the absolute times. The
GPU autotuner times both kinds where both are candidates (`configs.GPU_CONFIGS`).

    python -m tools.triton.backward_model                      # D = 64, 128; bf16; causal
    python -m tools.triton.backward_model --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SMS, CLOCK, ISSUE = 132, 1.755e9, 4           # H100 SXM: SMs, boost clock (Hz), warp instructions / clock / SM
TENSOR_FLOPS, HBM = 989e12, 3.35e12            # dense bf16 tensor peak (flop/s), HBM bandwidth (B/s)


def loop_pairs(config: tuple) -> list:
    """(tile pairs per iteration) of each full-tile loop of the backward with ``config``: the dK/dV
    programs' (and the dQ programs', seven-product only)."""
    m1, n1, m2, n2 = config[:4]
    return [m1 * n1] if "dq5" in config[6:] else [m1 * n1, m2 * n2]


def predict(config: tuple, row: dict, head_dim: int) -> dict:
    """Predicted picoseconds per (query, key) pair of the whole GPU, from one compile's resources
    ``row`` (`kernel_resources.resources`)."""
    five = "dq5" in config[6:]
    warps = config[4]
    full_loops = row["loop_instrs"][::2]               # full, partial per kind of program: the full ones
    instrs = sum(n * warps / pairs for n, pairs in zip(full_loops, loop_pairs(config)))
    issue = instrs / (SMS * ISSUE * CLOCK)
    tensor = (5 if five else 7) * 2 * head_dim / TENSOR_FLOPS
    compute = max(issue, tensor)
    partial = 4 * head_dim / config[1] / HBM if five else 0.0
    total = max(compute, partial) + partial             # writes overlap the dK/dV programs; the reduction reads after
    return dict(warp_instrs_per_pair=round(instrs, 3), issue_ps=round(issue * 1e12, 3),
                tensor_ps=round(tensor * 1e12, 3), partial_ps=round(partial * 1e12, 3), ps_per_pair=round(total * 1e12, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--features", default="causal")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    from effattn.backends.triton.attention import configs
    from tools.triton import kernel_resources as kr
    rows = []
    for hd in (int(h) for h in args.head_dims.split(",")):
        cands = configs.candidates("bwd", hd, 2)
        for cfg in [cands[0]] + [c for c in cands if configs.five_product(c)]:
            res = kr.resources(kr.compile_kernel(90, "bwd", hd, "bf16", cfg, args.features))
            row = dict(head_dim=hd, config="x".join(map(str, cfg)), regs=res.get("regs"),
                       loop_spills=res.get("tile_loop_spills"), loop_instrs=res.get("loop_instrs"),
                       **predict(cfg, res, hd))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        import triton
        print(f"sm_90 offline, triton {triton.__version__}, bf16, {args.features}; predictions (H100 SXM bounds)")
        print("| D | config | regs | spills per tile loop | instrs per tile | warp instrs / pair | issue ps | tensor ps "
              "| partials ps | ps / pair | vs default |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            base = next(b for b in rows if b["head_dim"] == r["head_dim"])
            print(f"| {r['head_dim']} | {r['config']} | {r['regs']} | {r['loop_spills']} | {r['loop_instrs']} | "
                  f"{r['warp_instrs_per_pair']} | {r['issue_ps']} | {r['tensor_ps']} | {r['partial_ps']} | "
                  f"{r['ps_per_pair']} | {r['ps_per_pair'] / base['ps_per_pair']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
