"""What each score term adds to the Triton score-terms kernels on a GPU target, read without a GPU.

Compiles ``score_fwd_kernel`` and ``score_bwd_kernel`` (effattn/backends/triton/attention/
score_kernels.py) offline for ``sm_<arch>`` (as `tools.triton.kernel_resources` does for the main
kernels) as the launcher specializes them for a causal call: its tiles and warps
(`score._blocks`), its constant-tile switch (``FAST``: off with ALiBi or a dense bias), once with
no term and once per term (softcap, sinks, ALiBi, a relative table, adaptive span one-sided and
bidirectional, a dense bias) and with several of them; beside them the plain kernels (``fwd_kernel``,
``bwd_kernel``: a call without terms) in their default config. Reports registers, stack, spills and
the tile loops' instructions per tile, each against the plain kernel, and, for the terms that have
constant tiles, the loop with ``FAST`` off (every tile elementwise, the keys seen reduced from the
tile's visibility), which is what the kernels compile to where the constant path cannot apply.

    python -m tools.triton.score_kernel_resources                    # sm_90, bf16, head dim 64: prints
    python -m tools.triton.score_kernel_resources --out benchmarks/results/offline-sm90   # score_terms.md, .json
    python -m tools.triton.score_kernel_resources --arch 80 --head-dim 128 --dtype fp16

Run it without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import sys
from types import SimpleNamespace
from typing import Dict, List, Optional

from .kernel_resources import STRIDE_TUPLES, compile_kernel, configs_for, resources, stride_tuple

TERMS = {"none": {}, "softcap": dict(SOFTCAP=True), "sinks": dict(SINKS_ON=True), "alibi": dict(ALIBI=True),
         "relative": dict(REL=True), "span": dict(SPAN=True), "span-bidirectional": dict(SPAN=True, SPAN_BIDIR=True),
         "dense": dict(DENSE=True),
         "table+span+softcap+sinks": dict(SOFTCAP=True, SINKS_ON=True, REL=True, SPAN=True),
         "all": dict(SOFTCAP=True, SINKS_ON=True, ALIBI=True, REL=True, SPAN=True, DENSE=True)}
_FLOATS = {"scale", "softcap", "ramp", "inv_keep"}
_POINTERS = {"KPM": "*u8", "LAY": "*u8", "LSE": "*fp32", "DELTA": "*fp32", "SINKS": "*fp32", "SL": "*fp32",
             "TAB": "*fp32", "Z": "*fp32", "BIAS": "*fp32", "PART": "*fp32", "DBIAS": "*fp32", "DK": "*fp32",
             "DV": "*fp32", "CNT": "*i32", "ITEMS": "*i32", "ITEMS1": "*i32", "ITEMS2": "*i32"}
_UNIT = {"q_d", "k_d", "v_d", "do_d", "kpm_l", "bias_k"}
_TUPLES = dict(STRIDE_TUPLES, bias_strides=("bias_b", "bias_h", "bias_q", "bias_k"))


def launch_config(kind: str, head_dim: int, term: str):
    """(BLOCK_M, BLOCK_N, warps) the launcher picks for a call with `term` (`score._blocks`) and
    whether its constant-tile path is compiled in (``FAST``: no ALiBi, no dense bias; causal, no
    layout, no padding here)."""
    from effattn.backends.triton.attention import score
    flags = TERMS[term]
    n_bias = sum(bool(flags.get(f)) for f in ("ALIBI", "REL", "SPAN", "DENSE"))
    call = SimpleNamespace(terms=[None] * n_bias, softcap=1.0 if flags.get("SOFTCAP") else None)
    block = score._blocks(head_dim, head_dim, kind == "bwd", call)
    return block, not (flags.get("ALIBI") or flags.get("DENSE"))


def compile_score_kernel(arch: int, kind: str, head_dim: int, dtype: str, term: str, block=None, warps=None,
                         stages=2, fast: Optional[bool] = None, varlen=False):
    """One of the score kernels compiled for ``sm_<arch>`` with causal masking and the constexprs of
    `term`, for contiguous inputs (``varlen``: on packed sequences' work lists); tiles, warps and
    ``FAST`` as the launcher's unless given. Returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from effattn.backends.triton.attention import score_kernels as sk
    (bm, bn, w), launch_fast = launch_config(kind, head_dim, term)
    block = block or (bm, bn)
    warps = warps or w
    fn = {"fwd": sk.score_fwd_kernel, "bwd": sk.score_bwd_kernel}[kind]
    consts = dict(BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_D=head_dim, BLOCK_DV=head_dim, BLOCK_P=16,
                  HAS_LEFT=False, HAS_RIGHT=True, HAS_LAYOUT=False, HAS_KPM=False, DROPOUT=False, SOFTCAP=False,
                  SINKS_ON=False, ALIBI=False, REL=False, REL_BIDIR=True, SPAN=False, SPAN_BIDIR=False, DENSE=False,
                  FAST=launch_fast if fast is None else fast, COUNT=False, DOT_PREC="ieee", INTERP_BF16=False,
                  IDX64=False, VARLEN=varlen)
    consts.update(TERMS[term])
    if consts["SPAN"]:       # the launcher bounds the window by the span's horizon (both sides: bidirectional)
        consts["HAS_LEFT"] = True
    consts = {n: v for n, v in consts.items() if n in fn.arg_names}
    missing = [fn.arg_names[i] for i in getattr(fn, "constexprs", []) if fn.arg_names[i] not in consts
               and fn.arg_names[i] not in _UNIT]
    if missing:      # it would compile as a runtime argument: another kernel than the launcher's
        raise ValueError(f"{kind}: no value for constexpr {missing}")
    consts.update({n: 1 for n in fn.arg_names if n in _UNIT})
    sig, attrs = {}, {}
    for j, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in _TUPLES:              # no divisibility hints here (none for the scalars either)
            sig[n] = stride_tuple(j, _TUPLES[n], _UNIT, (), consts, attrs)
        elif n in _POINTERS:
            sig[n] = _POINTERS[n]
        elif n in ("Q", "K", "V", "O", "DO", "DQ"):
            sig[n] = "*" + dtype
        else:
            sig[n] = "fp32" if n in _FLOATS else "i64" if n == "seed" else "i32"
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))


def measure(job: tuple) -> Dict[str, object]:
    """One row: ``job = (arch, kind, head_dim, dtype, term, fast)``; term "plain" is the main kernel
    in its default config."""
    arch, kind, head_dim, dtype, term, fast = job
    row: Dict[str, object] = dict(kind=kind, term=term, fast=fast)
    try:
        if term == "plain":
            config = configs_for(kind, head_dim, dtype, "first")[0][1]
            row["config"] = "x".join(map(str, config))
            row.update(resources(compile_kernel(arch, kind, head_dim, dtype, config, "causal")))
        else:
            (bm, bn, w), _ = launch_config(kind, head_dim, term)
            row["config"] = f"{bm}x{bn}x{w}"
            row.update(resources(compile_score_kernel(arch, kind, head_dim, dtype, term, fast=fast)))
    except Exception as e:  # noqa: BLE001 - a rejected compile is a result
        row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
    return row


def jobs(arch: int, head_dim: int, dtype: str, terms=None) -> List[tuple]:
    """The plain kernels, every term as launched, and the terms with constant tiles with ``FAST`` off."""
    out = []
    for kind in ("fwd", "bwd"):
        out.append((arch, kind, head_dim, dtype, "plain", None))
        for term in terms or TERMS:
            out.append((arch, kind, head_dim, dtype, term, None))
            if launch_config(kind, head_dim, term)[1]:
                out.append((arch, kind, head_dim, dtype, term, False))
    return out


def _per_tile(row: dict) -> int:
    return sum(row.get("loop_instrs") or [0])


def _diff(x, base) -> str:
    return "" if x is None or base is None else f" ({x - base:+d})"


def to_markdown(rows: List[dict], meta: dict) -> str:
    """The table: per kernel, the plain kernel, then each term as launched, against the plain one;
    ``elementwise only``: the loop with ``FAST`` off, where the term has constant tiles."""
    off = {(r["kind"], r["term"]): r for r in rows if r.get("fast") is False}
    lines = [f"Score-terms kernels against the plain kernels, {meta['target']}, {meta['dtype']}, head dim "
             f"{meta['head_dim']}, causal; triton {meta['triton']}, {meta['date']}; `{meta['command']}`.", "",
             "Config: tiles M x N x warps as launched (`score._blocks`; the plain kernels: their default, M, N, "
             "warps, stages; the backward's dK/dV then dQ tiles). Registers per thread, stack bytes, spills = "
             "LDL/STL instructions (in loops / in all). Instructions per tile: the static length of the tile "
             "loops (innermost loops, summed; the backward's dK/dV and dQ loops together; with a relative "
             "table the dQ loop holds a loop over the tile's table entries, which counts instead), as launched; "
             "where the term has constant tiles (`score_kernels._const_tile`) the loop holds the constant and the "
             "elementwise tile code side by side (a constant tile runs the first: the product, the soft-cap, "
             "one scalar, the softmax) and the keys each tile sees are computed per key. `FAST off`: the same "
             "kernel with the constant path compiled out (every tile elementwise, the keys seen reduced from "
             "the tile's visibility), as for ALiBi, a dense bias, a layout or padding. In parentheses: the "
             "difference to the plain kernel.", "",
             "| kernel | term | config | registers | stack | spills loop/all | instructions per tile | "
             "FAST off: registers, spills loop/all, instructions per tile |", "|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        if r.get("fast") is False:
            continue
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['term']} | {r.get('config', '')} | error: {r['error'][:120]} |||||")
            continue
        if r["term"] == "plain":
            base[r["kind"]] = r
        b = base.get(r["kind"], {})
        regs, tile = r.get("regs"), _per_tile(r)
        o = off.get((r["kind"], r["term"]))
        only = "-"
        if o is not None and "error" not in o:
            only = (f"{o.get('regs')}, {o.get('loop_spills')}/{o.get('spills')}, "
                    f"{_per_tile(o)}{_diff(_per_tile(o), _per_tile(b) if b else None)}")
        lines.append(f"| {r['kind']} | {r['term']} | {r['config']} | {regs}{_diff(regs, b.get('regs'))} | "
                     f"{r.get('stack')} | {r.get('loop_spills')}/{r.get('spills')} | "
                     f"{tile}{'' if r['term'] == 'plain' else _diff(tile, _per_tile(b) if b else None)} | {only} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--terms", default=None, help="comma-separated subset of " + ", ".join(TERMS))
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--out", default=None, help="a folder: writes score_terms.md and score_terms.json there")
    args = ap.parse_args(argv)
    import triton
    todo = jobs(args.arch, args.head_dim, args.dtype, args.terms.split(",") if args.terms else None)
    with concurrent.futures.ProcessPoolExecutor(args.processes) as ex:
        rows = list(ex.map(measure, todo))
    meta = dict(target=f"sm_{args.arch}", dtype=args.dtype, head_dim=args.head_dim, triton=triton.__version__,
                date=datetime.date.today().isoformat(),
                command="python -m tools.triton.score_kernel_resources" + (" " + " ".join(argv or sys.argv[1:])
                                                                            if (argv or sys.argv[1:]) else ""))
    md = to_markdown(rows, meta)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "score_terms.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "score_terms.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
