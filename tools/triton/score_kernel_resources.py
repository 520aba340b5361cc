"""What each score term adds to the Triton score-terms kernels on a GPU target, read without a GPU.

Compiles ``score_fwd_kernel`` and ``score_bwd_kernel`` (effattn/backends/triton/attention/
score_kernels.py) offline for ``sm_<arch>`` (as `tools.triton.kernel_resources` does for the main
kernels), once with no term and once per term (softcap, sinks, ALiBi, a relative table, adaptive
span, a dense bias) and with all of them, causal, and reports registers, stack, spills, shared
memory and the tile loops' instruction counts, with each term's difference to the no-term kernel.

    python -m tools.triton.score_kernel_resources                    # sm_90, bf16, head dim 64
    python -m tools.triton.score_kernel_resources --arch 80 --head-dim 128 --dtype fp16

Run it without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict

from .kernel_resources import STRIDE_TUPLES, resources, stride_tuple

TERMS = {"none": {}, "softcap": dict(SOFTCAP=True), "sinks": dict(SINKS_ON=True), "alibi": dict(ALIBI=True),
         "relative": dict(REL=True), "span": dict(SPAN=True), "dense": dict(DENSE=True)}
TERMS["all"] = {k: v for t in TERMS.values() for k, v in t.items()}
_FLOATS = {"scale", "softcap", "ramp", "inv_keep"}
_POINTERS = {"KPM": "*u8", "LAY": "*u8", "LSE": "*fp32", "DELTA": "*fp32", "SINKS": "*fp32", "SL": "*fp32",
             "TAB": "*fp32", "Z": "*fp32", "BIAS": "*fp32", "PART": "*fp32", "DBIAS": "*fp32", "DK": "*fp32",
             "DV": "*fp32", "ITEMS": "*i32", "ITEMS1": "*i32", "ITEMS2": "*i32"}
_UNIT = {"q_d", "k_d", "v_d", "do_d", "kpm_l", "bias_k"}
_TUPLES = dict(STRIDE_TUPLES, bias_strides=("bias_b", "bias_h", "bias_q", "bias_k"))


def compile_score_kernel(arch: int, kind: str, head_dim: int, dtype: str, term: str, block=(64, 64), warps=4,
                         stages=2, varlen=False):
    """One of the score kernels compiled for ``sm_<arch>`` with causal masking and the constexprs of
    `term`, for contiguous inputs (``varlen``: on packed sequences' work lists). Returns Triton's
    CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from effattn.backends.triton.attention import score_kernels as sk
    fn = {"fwd": sk.score_fwd_kernel, "bwd": sk.score_bwd_kernel}[kind]
    consts = dict(BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_D=head_dim, BLOCK_DV=head_dim, BLOCK_P=16,
                  HAS_LEFT=False, HAS_RIGHT=True, HAS_LAYOUT=False, HAS_KPM=False, DROPOUT=False, SOFTCAP=False,
                  SINKS_ON=False, ALIBI=False, REL=False, REL_BIDIR=True, SPAN=False, DENSE=False,
                  DOT_PREC="ieee", INTERP_BF16=False, IDX64=False, VARLEN=varlen)
    consts.update(TERMS[term])
    consts = {n: v for n, v in consts.items() if n in fn.arg_names}
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


def table(arch: int, head_dim: int, dtype: str) -> str:
    rows, base = [], {}
    for kind in ("fwd", "bwd"):
        for term in TERMS:
            try:
                r: Dict[str, object] = resources(compile_score_kernel(arch, kind, head_dim, dtype, term))
            except Exception as e:  # noqa: BLE001 - a rejected compile is a result
                rows.append(f"| {kind} | {term} | error: {type(e).__name__}: {str(e)[-200:]} |||||")
                continue
            if term == "none":
                base[kind] = r
            regs, loop = r.get("regs"), sum(r.get("loop_instrs") or [0])
            d_regs = "" if term == "none" or regs is None else f" ({regs - base[kind].get('regs', 0):+d})"
            d_loop = "" if term == "none" else f" ({loop - sum(base[kind].get('loop_instrs') or [0]):+d})"
            rows.append(f"| {kind} | {term} | {regs}{d_regs} | {r.get('stack')} | {r.get('spills')} | "
                        f"{r.get('shared')} | {loop}{d_loop} |")
    head = (f"Score-terms kernels, sm_{arch}, {dtype}, head dim {head_dim}, 64 x 64 tiles, 4 warps, causal\n\n"
            "| kernel | term | registers (vs none) | stack | spills | shared | loop instructions (vs none) |\n"
            "|---|---|---|---|---|---|---|")
    return "\n".join([head] + rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = ap.parse_args(argv)
    print(table(args.arch, args.head_dim, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
