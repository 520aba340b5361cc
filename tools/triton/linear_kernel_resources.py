"""Offline GPU-target compiles of the linear-attention Triton kernels (no GPU needed).

The companion of ``tools/triton/kernel_resources.py`` (whose measuring helpers it reuses) for
``effattn/backends/triton/linear``: each of the two kernels is compiled once per role it plays in a
call (forward state and output passes, the backward's reverse state pass and its dq / dk / dv output
passes, the non-causal reduction and output, the decoding step, the feature map) in its default config, for
contiguous inputs, and reported with shared memory, registers, stack, spills (in loops / all) and
the matrix instructions (HGMMA = Hopper wgmma).

    python -m tools.triton.linear_kernel_resources                      # sm_90, F = Dv = 128, bf16 + fp16
    python -m tools.triton.linear_kernel_resources --arch 80 --feature-dims 64,128 --out DIR

Each dtype's roles are compiled with the feature map where ``launch.MAP_ONCE`` puts it (once per token in
the map kernel, or in the passes on each loaded tile); the forward's roles also with the other placement,
and the summary "Where the feature map runs" gives the forward's instructions per chunk of 64 positions
both ways (the model behind ``MAP_ONCE``). Run it without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List

from .kernel_resources import SMEM_LIMIT, _narrow, _prefetch, compile_all, resources, stride_tuple, write_tables

# role -> (kernel, constexpr flags) with the feature map (MAP 1 = elu + 1) run once per token in the "map"
# kernel: the passes read their operands as they are and the output pass applies only the map's derivative
# (MAP_X, the backward's dq / dk). With no map between a load and its dot, Triton feeds the dot straight
# from the pipelined shared-memory buffer, and any other use of the tile reads that buffer again: the
# row sums are products (`_pairs`), `shared_tile_reductions` checks it. IN_PASS: the operands each role
# maps itself where the map runs in the passes (ops.py: q, k and their features' places)
_STATE = dict(REVERSE=False, STORE=True, C_X=1, MAP_B=0, MAP_C=0)
_OUT = dict(NB=1, CAUSAL=True, REVERSE=False, MAP_A=0, MAP_B=0, MAP_C=0, MAP_X=0, A_X=0, B_X=0, HAS_STATE=True,
            STATE_Z=False, Z_MODE=0, HAS_BASE=False, BASE_Z=False, WITH_DEN=False, NORMALIZE=False)
ROLES = {
    "state-fwd": ("state", dict(_STATE)),
    "state-bwd-reverse": ("state", dict(_STATE, REVERSE=True, C_X=2)),
    "state-noncausal-split": ("state", dict(_STATE, STORE=False)),
    "out-fwd-normalized": ("out", dict(_OUT, STATE_Z=True, Z_MODE=1, WITH_DEN=True, NORMALIZE=True)),
    "out-fwd-plain": ("out", dict(_OUT)),
    "out-dq": ("out", dict(_OUT, MAP_X=1, A_X=2, B_X=1, STATE_Z=True, Z_MODE=2)),
    "out-dk": ("out", dict(_OUT, REVERSE=True, MAP_X=1, A_X=1, B_X=2, STATE_Z=True, Z_MODE=2)),
    "out-dv": ("out", dict(_OUT, REVERSE=True)),
    "out-noncausal": ("out", dict(_OUT, CAUSAL=False, STATE_Z=True, Z_MODE=1, WITH_DEN=True, NORMALIZE=True)),
    "sums": ("sums", dict(C_X=1, MAP_B=0)),
    "sums-weighted": ("sums", dict(C_X=2, MAP_B=0)),
    "step": ("step", dict(MAP=1, NORMALIZE=True)),
    "map": ("map", dict(MAP=1)),
}
IN_PASS = {"sums": dict(MAP_B=1), "sums-weighted": dict(MAP_B=1), "state-fwd": dict(MAP_B=1), "state-bwd-reverse": dict(MAP_B=1), "state-noncausal-split": dict(MAP_B=1),
           "out-fwd-normalized": dict(MAP_A=1, MAP_B=1), "out-fwd-plain": dict(MAP_A=1, MAP_B=1),
           "out-dq": dict(MAP_C=1), "out-dk": dict(MAP_C=1), "out-dv": dict(MAP_A=1, MAP_B=1),
           "out-noncausal": dict(MAP_A=1)}
FORWARD = ("sums", "state-fwd", "out-fwd-normalized")   # the causal forward's passes (with the map: its model)
_BF16_DATA = {"Ap", "Bp", "Cp", "GXp", "OUT", "Q", "K", "V", "Xp", "Y", "X2p", "Y2"}
_POINTERS = {"Ap", "Bp", "Cp", "GXp", "OUT", "Q", "K", "V", "Xp", "Y", "X2p", "Y2", "ST", "CX", "ZS", "STZ", "FIN", "FINZ", "AX", "BX", "BASE",
             "BASEZ", "DEN", "S", "Z", "S_OUT", "Z_OUT"}
# stride tuples (kernels.py): the names of their elements
_TUPLES = {f"{x}_strides": tuple(f"{x}_s{a}" for a in "bhlf") for x in ("a", "b", "c", "gx", "x", "x2")}
_TUPLES.update(st_strides=("st_bh", "st_c", "st_a", "st_f"), stz_strides=("stz_bh", "stz_c"),
               base_strides=("base_bh", "base_a", "base_f"), o_strides=("o_b", "o_h", "o_l", "o_f"))
_UNIT = {"a_sf", "b_sf", "c_sf", "gx_sf", "x_sf", "x2_sf", "o_f", "st_f", "base_f"}   # contiguous (B, H, L, F) operands
# runtime ints without the divisibility hint (every other int and every pointer gets it, as at a launch
# with contiguous inputs and feature dims multiple of 16)
_NO_HINT = {"a_shift", "b_shift", "GA", "Ha", "Hb", "b_H", "H", "H2", "G", "gbase", "n_chunks", "chunks_per_block"}


def map_once(dtype: str, feat: int) -> bool:
    """Whether the launchers map features once per token for `dtype` at `feat` features (``launch.MAP_ONCE``)."""
    import torch

    from effattn.backends.triton.linear import launch
    return launch.map_once({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype], feat)


def compile_role(arch: int, role: str, feat: int, dtype: str, config=None, once=None):
    """Compiles `role` for sm_<arch> with F = Dv = `feat` in its default config (``config``: this
    (BK, BV, warps, stages) instead), with the feature map once per token or in the passes (``once``;
    None: as the launchers place it for `dtype`). Returns (kernel, config string)."""
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from effattn.backends.triton.linear import kernels, launch
    kind, flags = ROLES[role]
    fn = {"state": kernels.chunk_state_kernel, "out": kernels.chunk_out_kernel, "step": kernels.step_kernel,
          "map": kernels.map_kernel, "sums": kernels.chunk_sum_kernel}[kind]
    elem = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dtype]
    consts = dict(flags)
    if not (map_once(dtype, feat) if once is None else once):
        consts.update(IN_PASS.get(role, {}))
    if kind == "step":
        bf, bv, warps, stages = min(64, feat), min(128, feat), 4, 3
        consts.update(BF=bf, BV=bv, INTERP_BF16=False)
        cfg = f"BF{bf}xBV{bv}x{warps}"
    elif kind == "map":
        bl, bf, warps, stages = launch.MAP_ROWS, min(128, feat), 4, 3
        consts.update(BL=bl, BF=bf, INTERP_BF16=False)
        cfg = f"BL{bl}xBF{bf}x{warps}"
    elif kind == "sums":
        bz, warps, stages = min(launch.SUM_ROWS_F, feat), 4, 3
        consts.update(CH=64, BZ=bz)
        cfg = f"CH64xBZ{bz}x{warps}"
    else:
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        bk, bv, warps, stages = launch._fit(config or launch.candidates(kind, torch_dtype)[0], feat, feat)
        consts.update(CH=64, BK=bk, BV=bv, DT=tl.bfloat16 if dtype == "bf16" else tl.float32,
                      DOT_PREC="tf32" if dtype != "bf16" else "ieee", INTERP_BF16=False)
        if kind == "state":
            consts["NV"] = -(-feat // bv)
        cfg = f"CH64xBK{bk}xBV{bv}x{warps}x{stages}"
    consts.update({n: 1 for n in fn.arg_names if n in _UNIT})
    state_elem = "bf16" if dtype == "bf16" else "fp32"
    sig, attrs = {}, {}
    for j, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in _TUPLES:
            sig[n] = stride_tuple(j, _TUPLES[n], _UNIT, set(_TUPLES[n]) - _UNIT, consts, attrs)
            continue
        elif n in _BF16_DATA:
            sig[n] = "*" + elem
        elif n == "ST":
            sig[n] = "*" + state_elem
        elif n in _POINTERS:
            sig[n] = "*fp32"
        else:
            sig[n] = "fp32" if n == "eps" else "i32"
        if sig[n].startswith("*") or (sig[n] == "i32" and n not in _NO_HINT):
            attrs[(j,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    return k, cfg


def shared_tile_reductions(ttgir: str) -> List[str]:
    """The ``tt.reduce`` ops of a TTGIR module that reduce (through elementwise ops, not through a dot) a
    tile read from a shared-memory buffer that an async copy fills (a pipelined load) and that is read
    more than once (also by a dot, in another layout). Triton 3.6's pipeliner on sm_90 got such a
    reduction wrong: the linear kernels' normalizer ``z`` of bf16 FAVOR+ features on an H200. The
    kernels take those sums as products instead (``_pairs`` in kernels.py); this finds the pattern."""
    lines = ttgir.splitlines()
    defs = {}
    for ln in lines:
        m = re.match(r"\s*(%[\w.]+)(?::\d+)?(?:,\s*%[\w.]+)*\s*=\s*(.*)", ln)
        if m:
            defs[m.group(1)] = m.group(2)

    def root(md: str) -> str:                      # a buffer view -> its allocation
        d = defs.get(md, "")
        while d.startswith("ttg.memdesc"):
            md = re.findall(r"%[\w.]+", d)[0]
            d = defs.get(md, "")
        return md

    filled = {root(m.group(1)) for m in (re.search(r"ttg\.async_copy_global_to_local %[\w.]+, (%[\w.]+)", ln)
                                         for ln in lines) if m}
    found = []
    for ln in lines:
        m = re.search(r'"tt\.reduce"\((%[\w.]+)\)', ln)
        stack, seen = ([m.group(1)] if m else []), set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            d = defs.get(v, "")
            if "warp_group_dot" in d or d.startswith("tt.dot"):
                continue                           # a product's result: registers of its own
            if d.startswith("ttg.local_load"):
                buf = re.findall(r"%[\w.]+", d)[0]
                readers = [x for x in lines if re.search(re.escape(buf) + r"\b", x)
                           and not re.match(r"\s*" + re.escape(buf) + r"\b", x)]
                if root(buf) in filled and len(readers) > 1:
                    found.append(ln.strip())
                    break
            stack += re.findall(r"%[\w.]+", d.split(" : ")[0])
    return found


def measure(job) -> Dict[str, object]:
    arch, role, feat, dtype, once, *config = job
    row = dict(arch=arch, role=role, feat=feat, dtype=dtype,
               map="-" if role in ("step", "map") else ("once" if once else "in pass"))
    try:
        k, cfg = compile_role(arch, role, feat, dtype, config[0] if config else None, once)
        row["config"] = cfg
        row.update(resources(k))
        row["tile_reductions"] = len(shared_tile_reductions(k.asm["ttgir"]))
        row["fits"] = row["shared"] <= SMEM_LIMIT.get(arch, SMEM_LIMIT[80])
    except Exception as e:  # noqa: BLE001 - a compile error is a result
        row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
    return row


def to_markdown(rows: List[dict], meta: dict) -> str:
    lines = [f"# effattn linear-attention Triton kernels: offline resources ({meta['target']})", "",
             f"triton {meta['triton']}, {meta['date']}; `{meta['command']}`. Default configs (chunk 64 "
             "positions; BK = contracted feature tile, BV = output feature tile, warps, stages). Shared "
             f"memory in KiB (limit {SMEM_LIMIT.get(meta['arch'], 0) // 1024}); regs per thread; stack "
             "bytes; spills = LDL/STL instructions in loops / in all; HGMMA = wgmma instructions. fp16 "
             "calls run their dots on fp32 operands (TF32), hence no HGMMA on bf16 operands there.", "",
             "Per chunk loop (the innermost loops, in SASS order): instructions, CTA barriers (BAR) and "
             "prefetch (no loop waits for all its async copies). Tile reductions: `shared_tile_reductions` (a "
             "reduction of a pipelined shared-memory tile that a dot also reads; must be 0).", "",
             "Map: where the feature map runs (once: the map kernel, in pass: each loaded tile); each dtype's "
             "default first, the forward's passes also the other way. min N: the narrowest wgmma (64 x N) in "
             "a loop, flagged below 32.", "",
             "| role | F = Dv | dtype | map | config | smem | regs | stack | spills loop/all | HGMMA | min N | HMMA | "
             "instrs per chunk | barriers per chunk | prefetch | tile reductions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['role']} | {r['feat']} | {r['dtype']} | {r['map']} | error: {r['error'][:100]} ||||||")
            continue
        smem = f"{r['shared'] / 1024:.0f}" + ("" if r["fits"] else " (too big)")
        lines.append(f"| {r['role']} | {r['feat']} | {r['dtype']} | {r['map']} | {r['config']} | {smem} | "
                     f"{r.get('regs', '?')} | {r.get('stack', '?')} | {r.get('loop_spills', '?')}/{r.get('spills', '?')} | "
                     f"{r.get('hgmma', '?')} | {_narrow(r.get('wgmma_min_n'))} | {r.get('hmma', '?')} | "
                     f"{'/'.join(map(str, r.get('loop_instrs', []))) or 'no loop: ' + str(r.get('instrs', '?'))} | "
                     f"{'/'.join(map(str, r.get('loop_barriers', [])))} | {_prefetch(r)} | "
                     f"{r.get('tile_reductions', '?')} |")
    lines += placement_table(rows)
    return "\n".join(lines) + "\n"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward_per_chunk(rows: List[dict], feat: int, dtype: str, once: bool):
    """(instructions, state chain) of the causal forward per chunk of 64 positions and key head at F = Dv =
    `feat` with the map `once` per token or in the passes, from the compiled rows: the normalizer's chunk
    sums (`chunk_sum_kernel`: Fb tiles x all its instructions, one tile a program), the state programs
    (Fb x Fc tiles) x the state loop, the output programs (Fc tiles) x their feature loops (the products'
    and the denominator's, each Fa / BK trips), and with `once` the map kernel's instructions for q and k
    (64 rows each); the chain is the state loop (a program's chunks run one after another). None where a
    row is missing."""
    place = "once" if once else "in pass"
    got = {r["role"]: r for r in rows if r["feat"] == feat and r["dtype"] == dtype and "error" not in r
           and r["map"] in (place, "-")}
    loops = ("state-fwd", "out-fwd-normalized")
    if not all(role in got for role in FORWARD) or not all(got[role].get("loop_instrs") for role in loops) \
            or (once and "map" not in got):
        return None
    tiles = {role: [int(x) for x in re.findall(r"B[KVZ](\d+)", got[role]["config"])] for role in FORWARD}
    (sk, sv), (ok, ov), (sz,) = tiles["state-fwd"], tiles["out-fwd-normalized"], tiles["sums"]
    state = _cdiv(feat, sk) * _cdiv(feat, sv) * got["state-fwd"]["loop_instrs"][0] + _cdiv(feat, sz) * got["sums"]["instrs"]
    out = _cdiv(feat, ov) * _cdiv(feat, ok) * sum(got["out-fwd-normalized"]["loop_instrs"])
    total = state + out
    if once:
        bl, bf = (int(x) for x in re.findall(r"B[LF](\d+)", got["map"]["config"]))
        total += 2 * _cdiv(64, bl) * _cdiv(feat, bf) * got["map"]["instrs"]
    return total, got["state-fwd"]["loop_instrs"][0]


def placement_table(rows: List[dict]) -> List[str]:
    """The summary "Where the feature map runs": per dtype and F, the forward per chunk both ways and the
    placement with fewer instructions beside the launchers' (``launch.MAP_ONCE``)."""
    lines = ["", "## Where the feature map runs", "",
             "The causal forward per chunk of 64 positions and key head (`forward_per_chunk`: state programs x "
             "state loop + output programs x output loop x its trips + with the map once, the map kernel for q "
             "and k), instructions and the state chain (one state loop: the sequential part). Fewer: the "
             "placement with fewer instructions; launchers: `launch.MAP_ONCE`.", "",
             "| dtype | F = Dv | once: instrs, chain | in pass: instrs, chain | once vs in pass | fewer | launchers |",
             "|---|---|---|---|---|---|---|"]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for feat in dict.fromkeys(r["feat"] for r in rows):
            a, b = forward_per_chunk(rows, feat, dtype, True), forward_per_chunk(rows, feat, dtype, False)
            if a is None or b is None:
                continue
            fewer = "once" if a[0] < b[0] else "in pass"
            lines.append(f"| {dtype} | {feat} | {a[0]}, {a[1]} | {b[0]}, {b[1]} | {100 * (a[0] - b[0]) / b[0]:+.0f}% | "
                         f"{fewer} | {'once' if map_once(dtype, feat) else 'in pass'} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--feature-dims", default="128", help="comma list of F = Dv (64, 128, 256)")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--roles", default=",".join(ROLES))
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--config", help="BKxBVxWARPSxSTAGES instead of each kind's default (e.g. 64x64x4x3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per kernel (for tests)")
    ap.add_argument("--default-placement-only", action="store_true",
                    help="compile each dtype's feature-map placement only (no placement model)")
    ap.add_argument("--out", help="write <stem>.md / .json here")
    ap.add_argument("--stem", default="linear_resources", help="the written tables' name (default linear_resources)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    roles = args.roles.split(",")
    if not set(roles) <= set(ROLES):
        ap.error(f"--roles takes {', '.join(ROLES)}")
    extra = (tuple(int(x) for x in args.config.split("x")),) if args.config else ()
    jobs = []
    for f in args.feature_dims.split(","):
        for dt in args.dtypes.split(","):
            once = map_once(dt, int(f))
            jobs += [(args.arch, role, int(f), dt, once, *extra) for role in roles]
            if not args.default_placement_only:       # the forward the other way: the placement model
                jobs += [(args.arch, role, int(f), dt, not once, *extra) for role in roles if role in FORWARD]
    rows, meta = compile_all(measure, jobs, args, "tools.triton.linear_kernel_resources", argv)
    md = to_markdown(rows, meta)
    if not args.json:
        print(md)
    if args.out:
        write_tables(args.out, args.stem, rows, meta, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
