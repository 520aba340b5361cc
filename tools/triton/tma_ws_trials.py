"""The forward kernel's TMA and warp-specialization trials, compiled offline (no GPU).

Compiles the forward kernel for sm_90 with its trial switches (forward.py: ``KV_TMA`` loads K and V
through tensor descriptors, ``WARP_SPEC`` warp-specializes the full-tile loop) off and on, for the
backend's candidate configs, and reports per compile what tools.triton.kernel_resources reads from
the SASS, plus the copy instructions: ``UTMALDG`` (TMA loads), ``LDGSTS`` (cp.async) and
``USETMAXREG`` (the register hand-off of warp-specialized kernels). Run it once per triton version
and merge the JSON lines into the table (benchmarks/results/offline-sm90/tma_ws_trials.md):

    python -m tools.triton.tma_ws_trials --json > t39.jsonl
    /path/to/triton-3.6/python -m tools.triton.tma_ws_trials --json > t36.jsonl
    python -m tools.triton.tma_ws_trials --table t36.jsonl t39.jsonl

Run it without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
from typing import Dict, List

# "default": the plain loads (compile_kernel turns KV_TMA on for sm_90 otherwise: the launcher's default)
SWITCHES = {"default": dict(KV_TMA=False), "tma": dict(KV_TMA=True), "ws": dict(KV_TMA=False, WARP_SPEC=True),
            "tma+ws": dict(KV_TMA=True, WARP_SPEC=True)}


def jobs(arch: int) -> List[tuple]:
    """(arch, D, features, config index, config, switch name): every bf16 forward candidate at
    D = 64, 128 (causal, the hot path), the first candidate also with a window and a layout."""
    from tools.triton import kernel_resources as kr
    out = []
    for D in (64, 128):
        for i, cfg in kr.configs_for("fwd", D, "bf16", "all"):
            for feats in ("causal",) + (("window", "layout") if i == 0 else ()):
                out += [(arch, D, feats, i, cfg, sw) for sw in SWITCHES]
    return out


def measure(job: tuple) -> Dict[str, object]:
    import triton

    from tools.triton import kernel_resources as kr
    arch, D, feats, i, cfg, sw = job
    row = dict(triton=triton.__version__, arch=arch, head_dim=D, features=feats, index=i,
               config="x".join(map(str, cfg)), switches=sw)
    try:
        k = kr.compile_kernel(arch, "fwd", D, "bf16", cfg, feats, switches=SWITCHES[sw])
        row.update(kr.resources(k))
    except Exception as e:  # noqa: BLE001 - a variant the compiler rejects is a result
        row["error"] = f"{type(e).__name__}: {str(e).strip()[-300:]}"
    return row


def tile_loops(row: dict) -> List[int]:
    """Lengths of the tile loops (innermost loops of more than 20 instructions: the 2-instruction
    loops of a TMA kernel are its barrier waits)."""
    return [n for n in row.get("loop_instrs", []) if n > 20]


def table(rows: List[dict]) -> str:
    lines = ["| triton | D | features | config (M, N, warps, stages) | switches | regs | stack | spills loop/all | "
             "smem KiB | HGMMA | UTMALDG | LDGSTS | USETMAXREG | instrs per tile (full / partial) | all instrs | "
             "prefetch |", "|" + "---|" * 16]
    for r in rows:
        head = f"| {r['triton']} | {r['head_dim']} | {r['features']} | {r['config']} | {r['switches']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:120]} |" + " |" * 10)
            continue
        waits = r.get("loop_wait_all", [])
        lines.append(f"{head} {r['regs']} | {r['stack']} | {r['loop_spills']}/{r['spills']} | "
                     f"{r['shared'] / 1024:.0f} | {r['hgmma']} | {r['utmaldg']} | {r['ldgsts']} | {r['setmaxreg']} | "
                     f"{' / '.join(map(str, tile_loops(r)))} | {r['instrs']} | {'no' if any(waits) else 'yes'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON row per compile")
    ap.add_argument("--table", nargs="*", help="JSON-lines files to merge into a markdown table")
    a = ap.parse_args(argv)
    if a.table:
        rows = [json.loads(line) for path in a.table for line in open(path) if line.startswith("{")]
        print(table(rows), end="")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    rows = []
    with concurrent.futures.ProcessPoolExecutor(a.processes) as pool:
        for row in pool.map(measure, jobs(a.arch)):
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
    if not a.json:
        print(table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
