"""What the Triton kernels cost on a GPU target, read without a GPU.

Triton compiles for any NVIDIA target offline (``triton.compile`` with a ``GPUTarget``); ptxas and
cuobjdump ship inside Triton's wheel. This script compiles ``effattn``'s kernels for a target and
reports, per kernel, head dim, dtype and config:

- shared memory per block (against the target's opt-in limit: 227 KiB on sm_90, 163 KiB on sm_80),
- registers per thread and the stack frame (local memory: spilled registers),
- spill instructions (LDL/STL) in total and inside loops (backward branches in the SASS): a spill
  in the prologue or epilogue costs a few instructions per program, one inside the key/query-tile
  loop costs them every tile,
- the matrix instructions in the SASS: ``HGMMA`` (Hopper wgmma, the fast path on sm_90) or
  ``HMMA`` (Ampere mma.sync),
- per tile loop, its length in instructions and whether it waits for all its async copies at every
  iteration (no prefetch in flight).

It cannot say how fast a kernel runs; it says which configs cannot be fast (spilling in the loop,
no wgmma) and which do not fit, so that autotuning on the GPU picks among sound candidates. The
test suite runs it for the default configs on every CI run.

    python -m tools.triton.kernel_resources                         # sm_90, bf16, causal, every candidate
    python -m tools.triton.kernel_resources --arch 80 --configs first --features all
    python -m tools.triton.kernel_resources --configs sweep --kinds bwd --head-dims 128 --out DIR

Run it without ``TRITON_INTERPRET=1`` (Triton decides at import whether kernels are interpreted).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import datetime
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}      # opt-in shared memory per block: A100, H100/H200
KINDS = ("fwd", "bwd", "delta", "decode")
DTYPES = ("bf16", "fp32", "fp32ieee", "fp32x3")     # fp32: TF32 dots; fp32ieee: IEEE fp32 dots; fp32x3: 3xTF32
# Launch-time specialization Triton applies on a GPU to contiguous (B, H, L, D) inputs with D and L
# multiples of 16: unit strides become the constant 1, the other strides and lengths get
# divisibility 16 (without it loads are not vectorized or pipelined and shared memory is
# underestimated). An int argument equal to 1 is specialized too: the backward's n_split (no GQA
# split) and the stride of its partial-sum buffers then (0).
_UNIT = {"q_d", "k_d", "v_d", "kpm_l", "do_d", "dk_d", "dv_d", "dq_d", "dl_l", "n_split"}
_DIV16 = {"q_b", "q_h", "q_l", "k_b", "k_h", "k_l", "v_b", "v_h", "v_l", "kpm_b", "do_b", "do_h", "do_l", "dq_b",
          "dq_h", "dq_l", "dqp_t", "dqp_b", "dqp_h", "dqp_l", "dk_s", "dk_b", "dk_h", "dk_l", "dv_s", "dv_b", "dv_h", "dv_l", "dl_b", "dl_h", "Lq", "Lk",
          "D", "Dv", "lay_h", "list_h", "list_t", "listk_h", "listk_t", "keys_per_split"}
# strides passed as one tuple argument (``<name>_strides``): the names of its elements, each specialized as
# the scalar of that name would be (Triton specializes a tuple's ints one by one at launch)
STRIDE_TUPLES = {f"{t}_strides": tuple(f"{t}_{a}" for a in "bhld") for t in ("q", "k", "v", "do", "dq")}
STRIDE_TUPLES.update(dk_strides=tuple(f"dk_{a}" for a in "sbhld"), dv_strides=tuple(f"dv_{a}" for a in "sbhld"),
                     dl_strides=("dl_b", "dl_h", "dl_l"), kpm_strides=("kpm_b", "kpm_l"),
                     dqp_strides=("dqp_t", "dqp_b", "dqp_h", "dqp_l"))
# a config's trailing tags -> the constexpr switch they turn on (forward trials, five-product backward);
# a tag "r<N>" caps the registers per thread at N (Triton's maxnreg option)
TAGS = {"tma": "KV_TMA", "ws": "WARP_SPEC", "dq5": "FIVE"}
_DOT_PREC = {"fp32": "tf32", "fp32x3": "tf32x3"}
_FLOATS = {"qk_scale", "scale", "inv_keep"}
_DATA = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
_POINTERS = {"KPM": "*u8", "LAY": "*u8", "LAY_SEEN": "*u8", "LISTS": "*i32", "ITEMS": "*i32", "ITEMS1": "*i32", "ITEMS2": "*i32", "LISTS1": "*i32", "LISTS2": "*i32", "COUNTS": "*i32",
             "LSE": "*fp32", "DELTA": "*fp32", "DQP": "*fp32", "DLSE": "*fp32", "OP": "*fp32", "LP": "*fp32", "CNT": "*i32"}
# which constraints a compile enables: "causal" is the hot path of the benchmarks; "layout" a causal
# block-sparse layout whose blocks the tiles nest in (e.g. block 128: partial tiles need no layout
# lookup), "layout-gather" one they do not nest in (block 16, 32, 48: partial tiles read the layout
# per element); "all" turns on every feature (window on both sides, a layout read per element in
# partial tiles, padding mask, dropout, lse gradient)
_OFF = dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_LAYOUT=False, LAYOUT_MASK=False, HAS_KPM=False, DROPOUT=False,
            HAS_DLSE=False)
FEATURES = {
    "dense": _OFF,
    "causal": dict(_OFF, HAS_RIGHT=True),
    "window": dict(_OFF, HAS_LEFT=True, HAS_RIGHT=True),
    "layout": dict(_OFF, HAS_RIGHT=True, HAS_LAYOUT=True),
    "layout-gather": dict(_OFF, HAS_RIGHT=True, HAS_LAYOUT=True, LAYOUT_MASK=True),
    # training with dropout and padding (causal): the heaviest combination models use
    "dropout": dict(_OFF, HAS_RIGHT=True, HAS_KPM=True, DROPOUT=True),
    "all": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_LAYOUT=True, LAYOUT_MASK=True, HAS_KPM=True, DROPOUT=True,
                HAS_DLSE=True),
}


def sweep_configs(kind: str = "fwd") -> List[tuple]:
    """A grid around the candidates: (BLOCK_M, BLOCK_N, warps, stages) with 2k..16k tile elements;
    for the backward, (dK/dV tiles, dQ tiles, warps, stages) around its candidates."""
    if kind == "bwd":
        return [(m1, n1, m2, n2, w, st) for m1, n1 in ((16, 128), (32, 64), (32, 128), (64, 64), (64, 128))
                for m2, n2 in ((64, 32), (128, 32), (128, 64)) for w in (4, 8) for st in (1, 2, 3)]
    return [c for c in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
            if 32 * 64 <= c[0] * c[1] <= 128 * 128]


def configs_for(kind: str, head_dim: int, dtype: str, which: str, gqa: bool = False) -> List[tuple]:
    """(index, config) pairs: the backend's candidate list ("all"), its first ("first": the untimed
    default), or the sweep grid ("sweep", index -1)."""
    from effattn.backends.triton.attention import configs
    if kind == "delta":                                    # (rows, -, Triton's default warps and stages)
        return [(0, (configs.delta_block(head_dim), 0, 4, 3))]
    if kind == "decode":       # split-KV decode: its config per packed row count (G * Lq)
        from effattn.backends.triton.attention import decode
        elem = 4 if dtype.startswith("fp32") else 2
        rows = [r for r in (16, 32, 64, 128) if decode.fits(r, head_dim, head_dim, elem, dtype == "fp32ieee")]
        return [(i, (r,) + decode.config(head_dim, head_dim, r, elem)) for i, r in enumerate(rows)][
            :1 if which == "first" else None]
    if which == "sweep":
        return [(-1, c) for c in sweep_configs(kind)]
    cands = list(enumerate(configs.candidates(kind, head_dim, 4 if dtype.startswith("fp32") else 2, gqa=gqa)))
    return cands[:1] if which == "first" else cands


def compile_kernel(arch: int, kind: str, head_dim: int, dtype: str, config: tuple, features: str = "causal",
                   idx64: bool = False, switches: Optional[dict] = None, gqa: bool = False):
    """Compiles one kernel for ``sm_<arch>`` as the launcher would specialize it for contiguous
    inputs (head dim a power of two: no padding masks); ``switches`` sets constexprs that default
    to off (the forward's ``KV_TMA``, ``WARP_SPEC`` trials). Multi-head attention by default: the
    query heads per KV head ``G`` is 1, which Triton specializes as a constant (as it does at launch);
    ``gqa``: G a runtime value (grouped-query attention, G > 1). Returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from effattn.backends.triton import attention as ta
    fn = {"fwd": ta.fwd_kernel, "bwd": ta.bwd_kernel, "delta": ta.delta_kernel,
          "decode": ta.decode.decode_kernel}[kind]
    *blocks, warps, stages = (c for c in config if not isinstance(c, str))
    maxnreg = next((int(t[1:]) for t in config if isinstance(t, str) and t[:1] == "r" and t[1:].isdigit()), None)
    switches = dict({TAGS[t]: True for t in config if t in TAGS}, **(switches or {}))
    elem = "fp32" if dtype.startswith("fp32") else dtype
    consts = dict(BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_D=head_dim, BLOCK_DV=head_dim, COUNT=False,
                  PAD_D=False, PAD_DV=False, DOT_PREC=_DOT_PREC.get(dtype, "ieee"), INTERP_BF16=False,
                  IDX64=idx64, FOLD_SCALE=True, BLOCK_R=blocks[0], KV_TMA=False, WARP_SPEC=False, VARLEN=False, FIVE=False,
                  POS=False, POS_CAUSAL=False, QPOS=None, KPOS=None,   # positions off: None pointers, as launched
                  **FEATURES[features])                      # FOLD_SCALE: any positive scale
    if kind == "decode":     # the merge's rows: 4 real ones in 16 (GQA 4, one query: H = 32 over Hkv = 8)
        from effattn.backends.triton.attention import decode
        merge_rows = 4 if blocks[0] == 16 else blocks[0]
        consts.update(MERGE_ROWS=merge_rows, SPLIT_CHUNK=decode.split_chunk(merge_rows, head_dim, warps),
                      LAYOUT_ROWS=False)                     # a layout's first query block holds the queries
    if kind == "fwd" and arch >= 90 and elem != "fp32":    # the launcher's TMA default there (`launch.tma_default`)
        consts["KV_TMA"] = True
    consts.update(switches or {})
    # heaviest-first program order as the launcher picks it for calls with a right bound (causal):
    # query tiles from the last down, key tiles (the backward's dK/dV programs) from the first up
    causal = bool(consts.get("HAS_RIGHT"))
    consts["ORDER"] = 1 if causal else 0
    if kind == "bwd":                  # dK/dV programs' tiles (..1), then the dQ programs' (..2)
        consts.update(BLOCK_M1=blocks[0], BLOCK_N1=blocks[1], BLOCK_M2=blocks[2], BLOCK_N2=blocks[3],
                      LAYOUT_MASK1=consts["LAYOUT_MASK"], LAYOUT_MASK2=consts["LAYOUT_MASK"],
                      ORDER1=-1 if causal else 0, ORDER2=consts["ORDER"])
    consts = {n: v for n, v in consts.items() if n in fn.arg_names}
    missing = [fn.arg_names[i] for i in getattr(fn, "constexprs", []) if fn.arg_names[i] not in consts]
    if missing:      # it would compile as a runtime argument: another kernel than the launcher's
        raise ValueError(f"{kind}: no value for constexpr {missing}")
    consts.update({n: 1 for n in fn.arg_names if n in _UNIT or (n == "G" and not gqa)})
    sig, attrs = {}, {}
    for j, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in STRIDE_TUPLES:
            sig[n] = stride_tuple(j, STRIDE_TUPLES[n], _UNIT, _DIV16, consts, attrs)
            continue
        elif n in _POINTERS or n in _DATA:
            sig[n] = _POINTERS.get(n) or "*" + elem
        else:
            sig[n] = "fp32" if n in _FLOATS else "i64" if n == "seed" else "i32"
        # a length the kernel does not specialize (do_not_specialize) gets no hint from the launcher either
        if sig[n].startswith("*") or (sig[n] == "i32" and n in _DIV16 and not fn.params[j].do_not_specialize):
            attrs[(j,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def stride_tuple(j: int, names, unit, div16, consts: dict, attrs: dict) -> tuple:
    """The signature of the stride tuple at argument ``j`` whose elements are named ``names``, as
    the launcher specializes it: elements in ``unit`` become the constant 1 (into ``consts``), those
    in ``div16`` get the divisibility hint (into ``attrs``), each by its path ``(j, i)``."""
    for i, e in enumerate(names):
        if e in unit:
            consts[(j, i)] = 1
        elif e in div16:
            attrs[(j, i)] = [["tt.divisibility", 16]]
    return tuple("constexpr" if e in unit else "i32" for e in names)


def cuobjdump() -> Optional[str]:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SPILL = re.compile(r"^(@!?U?P\w+\s+)?(LDL|STL)\b")
_HGMMA_N = re.compile(r"\bHGMMA\.\d+x(\d+)x")     # wgmma's N: 64 x N x K per warp group
_BAR = re.compile(r"^(@!?U?P\w+\s+)?BAR\.")        # CTA barriers (bar.sync / bar.arrive)
_WAIT_ALL = re.compile(r"^(@!?U?P\w+\s+)?DEPBAR\.LE\s+SB0,\s*0x0\b")
# copies into shared memory: TMA (UTMALDG), cp.async (LDGSTS); register reallocation between warp
# groups (USETMAXREG: warp specialization); opcode = the first word after a predicate
_OPCODES = {"UTMALDG": "utmaldg", "LDGSTS": "ldgsts", "USETMAXREG": "setmaxreg"}


def sass_stats(sass: str) -> Dict[str, object]:
    """Counts in a SASS listing: spill instructions, those inside loops (between a backward branch
    and its target), matrix instructions, the narrowest wgmma N inside a loop (``wgmma_min_n``:
    64 x 16 products run far below the tensor cores' rate; None without wgmma in a loop), and per
    innermost loop (the tile loops: full tiles first)
    its length in instructions, its CTA barriers (``BAR.*``) and whether it waits for all its async
    copies (``DEPBAR.LE SB0, 0x0``: nothing stays in flight across iterations, i.e. no prefetch)."""
    instrs = [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(sass)]
    loops = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    spills = [a for a, t in instrs if _SPILL.match(t)]
    widths = [int(m.group(1)) for a, t in instrs if any(lo <= a <= hi for lo, hi in loops)
              for m in [_HGMMA_N.search(t)] if m]
    return dict(spills=len(spills), loop_spills=sum(any(lo <= a <= hi for lo, hi in loops) for a in spills),
                wgmma_min_n=min(widths) if widths else None,
                hgmma=sum(t.startswith("HGMMA") or " HGMMA" in t for _, t in instrs),
                hmma=sum(t.startswith("HMMA") or " HMMA" in t for _, t in instrs),
                loop_instrs=[sum(lo <= a <= hi for a, _ in instrs) for lo, hi in inner],
                tile_loop_spills=[sum(lo <= a <= hi for a in spills) for lo, hi in inner],
                loop_barriers=[sum(lo <= a <= hi and bool(_BAR.match(t)) for a, t in instrs) for lo, hi in inner],
                loop_wait_all=[any(lo <= a <= hi and _WAIT_ALL.match(t) for a, t in instrs) for lo, hi in inner])


def opcode_counts(sass: str) -> Dict[str, int]:
    """The instructions in all and the `_OPCODES` ones (TMA loads, cp.async, register hand-off)."""
    ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(2)).split(" ")[0].split(".")[0] for m in _INSTR.finditer(sass)]
    return dict(instrs=len(ops), **{name: sum(op == code for op in ops) for code, name in _OPCODES.items()})


def resources(kernel) -> Dict[str, object]:
    """Shared memory from Triton's metadata; registers, stack and SASS counts from cuobjdump."""
    out: Dict[str, object] = dict(shared=kernel.metadata.shared)
    tool = cuobjdump()
    if tool is None:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if m:
        out.update(regs=int(m.group(1)), stack=int(m.group(2)))
    out.update(sass_stats(sass), **opcode_counts(sass))
    return out


def warps_of(config: tuple) -> int:
    """The warps of a config: its second-to-last number (trailing tags such as ``"dq5"`` skipped)."""
    return [c for c in config if not isinstance(c, str)][-2]


SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}     # shared memory per SM (1 KiB of it reserved per CTA)


def ctas_per_sm(arch: int, shared: int, regs: Optional[int], warps: int) -> int:
    """CTAs of a kernel one SM holds at once: by shared memory (plus the 1 KiB the driver reserves
    per CTA), by registers (65536 per SM, allocated per warp in units of 256) and by warps (64)."""
    by_smem = SMEM_PER_SM.get(arch, SMEM_PER_SM[80]) // (shared + 1024)
    by_regs = 65536 // (warps * -(-(regs or 255) * 32 // 256) * 256)
    return max(0, min(by_smem, by_regs, 64 // warps, 32))


def measure(job: tuple) -> Dict[str, object]:
    arch, kind, head_dim, dtype, index, config, features, idx64, *rest = job
    gqa = bool(rest and rest[0])
    row = dict(arch=arch, kind=kind, head_dim=head_dim, dtype=dtype, features=features + ("+gqa" if gqa else ""),
               idx64=idx64, index=index, config="x".join(map(str, config)))
    try:
        row.update(resources(compile_kernel(arch, kind, head_dim, dtype, config, features, idx64, gqa=gqa)))
        row["fits"] = row["shared"] <= SMEM_LIMIT.get(arch, SMEM_LIMIT[80])
        row["ctas_per_sm"] = ctas_per_sm(arch, row["shared"], row.get("regs"), warps_of(config))
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is a result, not a crash
        row["error"] = f"{type(e).__name__}: {str(e)[-500:]}"
    return row


COLUMNS = ["arch", "kind", "head_dim", "dtype", "features", "idx64", "index", "config", "shared", "fits", "regs",
           "stack", "spills", "loop_spills", "hgmma", "hmma", "wgmma_min_n", "ctas_per_sm", "loop_instrs", "loop_wait_all", "error"]


def to_markdown(rows: List[dict], meta: dict) -> str:
    lines = [f"# effattn Triton kernels: offline resources ({meta['target']})", "",
             f"triton {meta['triton']}, {meta['date']}; `{meta['command']}`. Shared memory in KiB (limit "
             f"{SMEM_LIMIT.get(meta['arch'], 0) // 1024}); regs per thread; stack bytes; spill = LDL/STL "
             "instructions (in loops / in all); CTAs/SM = CTAs one SM holds (shared memory, registers, warps); "
             "HGMMA = wgmma instructions; min N = the narrowest wgmma (64 x N) in a tile loop, flagged "
             "below 32; features: +gqa = G a runtime value (else MHA, G = 1); instrs per tile = length of each "
             "innermost loop (the tile loops: full tiles, then partial ones); prefetch = no tile loop waits "
             "for all its async copies (DEPBAR.LE SB0, 0x0). Index = position in the "
             "backend's candidate list (0 = the untimed default, -1 = sweep only).", "",
             "The backward's config is (dK/dV M, N, dQ M, N, warps, stages); its tile loops: dK/dV full, "
             "partial, dQ full, partial.", "",
             "| kernel | D | dtype | features | config (M, N, warps, stages) | index | smem | regs | CTAs/SM | stack | "
             "spills loop/all | HGMMA | min N | HMMA | instrs per tile | prefetch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['head_dim']} | {r['dtype']} | {r['features']} | {r['config']} | "
                         f"{r['index']} | error: {r['error'][:80]} |||||||||")
            continue
        smem = f"{r['shared'] / 1024:.0f}" + ("" if r["fits"] else " (too big)")
        lines.append(f"| {r['kind']} | {r['head_dim']} | {r['dtype']} | {r['features']} | {r['config']} | "
                     f"{r['index']} | {smem} | {r.get('regs', '?')} | {r.get('ctas_per_sm', '?')} | "
                     f"{r.get('stack', '?')} | {r.get('loop_spills', '?')}/{r.get('spills', '?')} | "
                     f"{r.get('hgmma', '?')} | {_narrow(r.get('wgmma_min_n'))} | {r.get('hmma', '?')} | {'/'.join(map(str, r.get('loop_instrs', [])))} | "
                     f"{_prefetch(r)} |")
    return "\n".join(lines) + "\n"


def _narrow(n) -> str:
    """The narrowest wgmma N in a tile loop, flagged below 32 (a 64 x 16 product: slow)."""
    return "-" if n is None else (f"**{n}** (narrow)" if n < 32 else str(n))


def _prefetch(row: dict) -> str:
    """'yes' when no tile loop waits for all its copies, else which loops do (0 = the first)."""
    waits = row.get("loop_wait_all")
    if waits is None:
        return "?"
    return "yes" if not any(waits) else "waits all in loop " + ",".join(str(i) for i, w in enumerate(waits) if w)


def write_tables(out: str, stem: str, rows, meta: dict, md: str, csv_columns=None) -> None:
    """``<stem>.json`` (meta + rows), ``<stem>.md`` and, given ``csv_columns``, ``<stem>.csv`` under ``out``."""
    os.makedirs(out, exist_ok=True)
    if csv_columns is not None:
        with open(os.path.join(out, f"{stem}.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=csv_columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(md)


def compile_all(measure_fn, jobs, args, module: str, argv) -> tuple:
    """Runs ``measure_fn`` over ``jobs`` in ``args.processes`` processes (printing each row as JSON
    with ``args.json``); returns the rows and the table's metadata (target, triton, date, command)."""
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.processes, len(jobs)))) as pool:
        for row in pool.map(measure_fn, jobs):
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    import triton
    meta = dict(target=f"sm_{args.arch}", arch=args.arch, triton=triton.__version__,
                date=datetime.date.today().isoformat(),
                command=f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]))
    return rows, meta


# --exact: the kernels the GPU suite launched in the first H100 run (D = 128, bf16, MHA, fwd + bwd), as
# its precompile planner records them (the launchers run on meta tensors: the very specializations)
EXACT_CASES = {"dense": dict(causal=False), "causal": dict(causal=True), "window": dict(window=(1024, 0)),
               "layout128": dict(layout=True)}


def exact_variants(length: int = 8192):
    """(mode, config, Variant) for every forward / backward launch of the suite's D = 128 bf16 MHA calls
    at ``length`` (B = 1, H = 16): the autotuners' candidates, each as the launcher specializes it."""
    import torch

    from benchmarks.suite import kernels
    from effattn.layouts import sliding_and_summary
    out = []
    for mode, kw in EXACT_CASES.items():
        layout = sliding_and_summary(length, 128, 4, 16) if kw.get("layout") else None
        call = kernels.Call("attention", 1, 16, 16, length, length, 128, torch.bfloat16, True,
                            causal=kw.get("causal", True), window=kw.get("window"), layout=layout)
        variants, failed = kernels.plan_variants([call])
        if failed:
            raise RuntimeError(f"{mode}: {failed}")
        for v in variants:
            kw_v = dict(v.kwargs)
            if v.name == "fwd_kernel":         # K / V through TMA: the launchers' default on sm_90
                tags = ("tma",) * bool(kw_v.get("KV_TMA")) + tuple(f"r{kw_v['maxnreg']}" for _ in [0]
                                                                   if kw_v.get("maxnreg"))
                out.append((mode, "fwd", (kw_v["BLOCK_M"], kw_v["BLOCK_N"], kw_v["num_warps"], kw_v["num_stages"])
                            + tags, v))
            elif v.name == "bwd_kernel" and kw_v.get("FIVE"):        # the five-product backward: no dQ tiles
                out.append((mode, "bwd", (kw_v["BLOCK_M1"], kw_v["BLOCK_N1"], 0, 0, kw_v["num_warps"],
                                          kw_v["num_stages"], "dq5"), v))
            elif v.name == "bwd_kernel":
                out.append((mode, "bwd", (kw_v["BLOCK_M1"], kw_v["BLOCK_N1"], kw_v["BLOCK_M2"], kw_v["BLOCK_N2"],
                                          kw_v["num_warps"], kw_v["num_stages"]), v))
    return out


def tuned_picks(path: str) -> Dict[tuple, set]:
    """{(kernel, mode): the configs the GPU autotuner picked} from a suite's ``tuned.json``."""
    with open(path) as f:
        tuned = json.load(f)
    picks: Dict[tuple, set] = {}
    for entry in tuned.get("effattn.backends.triton.attention.launch", []):
        kind, mode = entry[0].strip("'"), entry[5].strip("'")
        picks.setdefault((kind, mode), set()).add(tuple(entry[-1]))
    return picks


def measure_exact(job: tuple) -> Dict[str, object]:
    """Compiles one recorded launch for ``sm_<arch>`` through Triton's own launch path (``warmup``
    with a stand-in driver: the binder specializes its arguments as at a launch on such a GPU)."""
    arch, mode, kind, config, var, index, picked = job
    row = dict(arch=arch, kind=kind, head_dim=128, dtype="bf16", features=mode, idx64=False, index=index,
               config="x".join(map(str, config)), picked=picked)
    try:
        import importlib

        from triton.runtime import driver

        from benchmarks.suite import kernels
        driver.set_active(kernels._OfflineDriver(arch))
        fn = getattr(importlib.import_module(var.module), var.name)
        compiled = fn.warmup(*var.args, grid=(1,), **dict(var.kwargs))
        row.update(resources(compiled))
        row["fits"] = row["shared"] <= SMEM_LIMIT.get(arch, SMEM_LIMIT[80])
        row["ctas_per_sm"] = ctas_per_sm(arch, row["shared"], row.get("regs"), warps_of(config))
    except Exception as e:  # noqa: BLE001 - a result
        row["error"] = f"{type(e).__name__}: {str(e)[-500:]}"
    return row


def exact_jobs(arch: int, tuned: Optional[str], which: str) -> List[tuple]:
    """The `measure_exact` jobs: every recorded launch (``which`` = "all"), or only the default
    (first candidate) and the configs ``tuned`` says the GPU autotuner picked ("picked")."""
    from effattn.backends.triton.attention import configs
    picks = tuned_picks(tuned) if tuned else {}
    jobs = []
    for mode, kind, cfg, var in exact_variants():
        cands = [tuple(c) + ("tma",) * (kind == "fwd" and "tma" in cfg and "tma" not in c)
                 for c in configs.candidates(kind, 128, 2)]        # the TMA default tags every forward config
        index = cands.index(cfg) if cfg in cands else -1
        picked = cfg in picks.get((kind, mode), set())
        if which == "all" or index == 0 or picked:
            jobs.append((arch, mode, kind, cfg, var, index, picked))
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200, 80: A100)")
    ap.add_argument("--kinds", default="fwd,bwd", help=f"comma list of {','.join(KINDS)}")
    ap.add_argument("--head-dims", default="64,128", help="comma list of 64, 128, 256")
    ap.add_argument("--dtypes", default="bf16", help=f"comma list of {','.join(DTYPES)}")
    ap.add_argument("--features", default="causal", help=f"comma list of {','.join(FEATURES)}")
    ap.add_argument("--configs", default="all", choices=("first", "all", "sweep"))
    ap.add_argument("--idx64", action="store_true", help="compile with int64 offsets throughout")
    ap.add_argument("--gqa", action="store_true", help="G (query heads per KV head) a runtime value, not 1 (MHA)")
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true", help="print one JSON object per kernel (for tests)")
    ap.add_argument("--out", help="write resources.csv / .md / .json (with --exact: exact.*) here")
    ap.add_argument("--exact", choices=("all", "picked"),
                    help="compile the launches the GPU suite records for its D = 128 bf16 MHA calls (16k tokens, "
                         "dense / causal / window / layout) through Triton's launch path instead of the grid above: "
                         "every candidate, or the defaults and the --tuned picks")
    ap.add_argument("--tuned", help="a suite's tuned.json: mark (and with --exact picked, compile) the autotuner's picks")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    try:
        import inspect

        from triton.compiler import ASTSource
        params = list(inspect.signature(ASTSource).parameters)
    except ImportError as e:
        print(f"SKIP triton's offline compile API is unavailable: {e}")
        return 0
    if params[:4] != ["fn", "signature", "constexprs", "attrs"]:
        print(f"SKIP triton's ASTSource takes {params}")
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    features = args.features.split(",")
    for name, values, allowed in (("--kinds", kinds, KINDS), ("--dtypes", args.dtypes.split(","), DTYPES),
                                  ("--features", features, FEATURES)):
        if not set(values) <= set(allowed):
            ap.error(f"{name} takes {', '.join(allowed)}")
    if args.exact:
        jobs = exact_jobs(args.arch, args.tuned, args.exact)
        rows, meta = compile_all(measure_exact, jobs, args, "tools.triton.kernel_resources", argv)
        for r in rows:
            r["index"] = f"{r['index']}{' picked' if r.get('picked') else ''}"
    else:
        jobs = [(args.arch, kind, int(hd), dt, i, cfg, feat, args.idx64, args.gqa)
                for feat in features for kind in kinds for hd in args.head_dims.split(",")
                for dt in args.dtypes.split(",") for i, cfg in configs_for(kind, int(hd), dt, args.configs, args.gqa)]
        rows, meta = compile_all(measure, jobs, args, "tools.triton.kernel_resources", argv)
    md = to_markdown(rows, meta)
    if not args.json:
        print(md)
    if args.out:
        write_tables(args.out, "exact" if args.exact else "resources", rows, meta, md, csv_columns=COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
