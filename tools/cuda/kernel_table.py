"""The offline table of the CUDA C++ kernels: what each kernel asks of an SM and what its main loop issues, read
from nvcc's output without a GPU (the CUDA counterpart of tools/triton/kernel_resources.py).

Each translation unit is compiled as setup.py compiles it (tools/cuda/nvcc.py: GENCODE, sm_80 and sm_90a; the
Hopper forward's unit and the Hopper backward's, bwd_sm90_<hd>_<dtype>.cu, for sm_90a only) and read per kernel and architecture:

- registers, spill stores / loads (ptxas -v), static shared memory (cuobjdump -res-usage), threads per block
  (the ELF's EIATTR_MAX_THREADS: every kernel has __launch_bounds__);
- dynamic shared memory: the launcher's size from effattn/backends/cuda/resources.py (the resource tests
  check those sizes against the launches' own), linear attention's from its configs (below);
- CTAs per SM from registers, shared memory and threads against the architecture's limits
  (resources.ARCHS: A100 for sm_80 code, H100 for sm_90a), and which limit decides it;
- the main tile loop in the SASS: the outermost backward branch (a BRA to a lower address) whose span holds
  the kernel's tensor-core instructions (HGMMA where it has any, else HMMA): its static instruction count,
  the instructions of one trip (nvcc.shortest_trip: the path with every tensor-core instruction and the
  fewest others, nested loops once), its tensor-core instructions and block barriers (BAR.SYNC); "-" for
  kernels without tensor cores;
- static counts over the whole kernel of HGMMA, UTMALDG (TMA loads), SYNCS (mbarrier operations), LDGSTS
  (cp.async), HMMA (mma.sync) and LDSM (ldmatrix).

    python3 -m tools.cuda.kernel_table                      # representative units -> benchmarks/results/offline-sm90
    python3 -m tools.cuda.kernel_table --units all          # every unit the dispatch launches
    python3 -m tools.cuda.kernel_table --units attention/inst/fwd_64_bf16_causal_nodrop.cu --out DIR

The unit list comes from csrc/generate_instances.py (forward and backward instances, the Hopper backward's
units) and `EXTRA_UNITS`: a new
generated instance is picked up by the next run; a new hand-written unit is one line in EXTRA_UNITS.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

from effattn.backends.cuda import resources
from tools.cuda import nvcc

ROOT = os.path.dirname(nvcc.CSRC)
OUT = os.path.join(ROOT, "benchmarks", "results", "offline-sm90")
NAME = "cuda_kernels.md"
# units outside the generated instances, with the architectures they are compiled for here (the Hopper
# forward has code for sm_90a only: its sm_80 object holds no kernel)
EXTRA_UNITS = {"attention/fwd_sm90.cu": ("sm_90a",), "attention/decode.cu": nvcc.ARCHS,
               "linear/linear.cu": nvcc.ARCHS}
# the representative instances (default): head dims 64 and 128, both dtypes; the forward at every mask kind with
# and without dropout; the backward at causal (the fused kernel), any (fused and two-pass) and layout (two-pass)
REP_HEAD_DIMS = (64, 128)
REP_BWD_KINDS = ("causal", "any", "layout")
# the devices each architecture's code is counted against (resources.ARCHS)
CC_OF = {"sm_80": (8, 0), "sm_90a": (9, 0)}
COLUMNS = ("unit", "arch", "kernel", "instance", "regs", "spill st/ld", "smem static", "smem dynamic", "threads",
           "CTAs/SM", "loop static", "trip", "loop MMA", "loop BAR", "HGMMA", "UTMALDG", "SYNCS", "LDGSTS", "HMMA", "LDSM")


def generator():
    """csrc/generate_instances.py as a module (standard library only)."""
    spec = importlib.util.spec_from_file_location("generate_instances", os.path.join(nvcc.CSRC, "generate_instances.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mask_kinds() -> Dict[int, str]:
    """MaskKind's values (csrc/attention/common.cuh) -> the generator's names."""
    with open(os.path.join(nvcc.CSRC, "attention", "common.cuh"), encoding="utf-8") as f:
        enum = re.search(r"enum MaskKind : int \{([^}]*)\}", f.read()).group(1)
    names = {e: n for n, e in generator().MASK_KINDS}
    return {int(v): names[k] for k, v in re.findall(r"(k\w+) = (\d+)", enum)}


def hopper_backward_units() -> List[str]:
    """The Hopper backward's generated units (bwd_sm90_<hd>_<dtype>.cu: one per head-dim bucket and dtype, its
    mask kinds inside), in the generator's order."""
    gen = generator()
    return [f"attention/inst/bwd_sm90_{hd}_{dtype}.cu" for hd in gen.HOPPER_HEAD_DIMS for dtype, _ in gen.DTYPES]


def instance_units() -> List[str]:
    """Every generated unit (csrc/attention/inst): the forward and backward instances in the generator's order,
    then the Hopper backward's."""
    gen = generator()
    return ([f"attention/inst/{name}" for name, _ in gen.forward_instances() + gen.backward_instances()]
            + hopper_backward_units())


def representative_units() -> List[str]:
    """The forward and backward instances at REP_HEAD_DIMS (the backward at REP_BWD_KINDS), every Hopper
    backward unit, then EXTRA_UNITS."""
    out = []
    hopper = hopper_backward_units()
    for unit in instance_units():
        if unit in hopper:
            out.append(unit)
            continue
        prefix, hd, _, kind, _ = os.path.basename(unit)[:-3].split("_")
        if int(hd) in REP_HEAD_DIMS and (prefix == "fwd" or kind in REP_BWD_KINDS):
            out.append(unit)
    return out + list(EXTRA_UNITS)


def archs_of(unit: str) -> Tuple[str, ...]:
    """The Hopper backward units are read for sm_90a only: their sm_80 code holds Delta, dq's conversion and an
    empty attn_bwd_sm90_kernel (its body is sm_90a code), which the dispatch never launches on sm_80."""
    if os.path.basename(unit).startswith("bwd_sm90_"):
        return ("sm_90a",)
    return EXTRA_UNITS.get(unit, nvcc.ARCHS)


# ------------------------------------------------------------------------------------ one kernel's name

def demangle(names: List[str]) -> Dict[str, str]:
    """{mangled: demangled} through c++filt (binutils)."""
    res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, res.stdout.splitlines()))


def template_args(demangled: str) -> Tuple[str, List[str]]:
    """("attn_fwd_kernel", ["64", "true", "3", ...]) of "void effattn::attn_fwd_kernel<64, true, 3, ...>(...)"."""
    m = re.match(r"(?:void )?(?:effattn::)?(\w+)(?:<(.*?)>)?\(", demangled)
    if m is None:
        return demangled, []
    return m.group(1), [a.strip() for a in (m.group(2) or "").split(",") if a.strip()]


def _lin_smem(base: str, np_: int) -> Optional[int]:
    """Linear attention's dynamic shared memory (csrc/linear: LinStateConfig, LinOutConfig, LinFavorConfig;
    the step kernel's is 2 F fp32 values, given here at F = 128)."""
    ch = 64                                                             # kLinChunk
    return {"lin_state_kernel": 2 * np_ * ch * 64 * 2 + 16 * 64 * 4,
            "lin_out_kernel": np_ * (2 * ch * 32 + 32 * 64 + 32 * 16) * 2,
            "lin_favor_kernel": 2 * np_ * 64 * 32 * 2,
            "lin_step_kernel": 2 * 128 * 4}.get(base)


def tma_key_tile() -> int:
    """The TMA Hopper forward's key tile (every instance), read from kFwdTmaKeyTile in
    csrc/attention/fwd_sm90_tma.cuh."""
    with open(os.path.join(nvcc.CSRC, "attention", "fwd_sm90_tma.cuh"), encoding="utf-8") as f:
        m = re.search(r"constexpr int kFwdTmaKeyTile = (\d+);", f.read())
    if m is None:
        raise RuntimeError("kFwdTmaKeyTile not found in fwd_sm90_tma.cuh")
    return int(m.group(1))


def describe(demangled: str, kinds: Dict[int, str]) -> Tuple[str, str, Optional[int]]:
    """(kernel, instance in words, dynamic shared memory in bytes or None when unknown) of one kernel."""
    base, a = template_args(demangled)
    dtype = lambda flag: "bf16" if flag == "true" else "fp16"          # noqa: E731
    drop = lambda flag: "dropout" if flag == "true" else "no dropout"  # noqa: E731
    if base == "attn_fwd_kernel":                  # HD, BF16, KIND, TERMS, RELK, DROP, WM, ROWS (a class), KT
        hd, rows, kt = int(a[0]), 4 * int(a[6]), int(a[8]) if len(a) > 8 else 0
        keys = kt or resources.fwd_key_tile(hd, rows)                  # KT 0: FwdConfig's default key tile
        smem = resources.relk_smem(hd) if a[4] == "true" else resources.fwd_smem(hd, rows, kt)
        extra = (", bias terms" if a[3] == "true" else "") + (", relative keys" if a[4] == "true" else "")
        return base, f"D{hd} {dtype(a[1])} {kinds[int(a[2])]} {drop(a[5])}, {rows} x {keys} tile{extra}", smem
    # the Hopper forwards' kAny instance carries dropout (a run-time flag); their other kinds have none
    hdrop = lambda k: "with run-time dropout" if kinds[int(k)] == "any" else "no dropout"  # noqa: E731
    if base == "attn_fwd_sm90_kernel":                                 # HD, BF16, KIND: 128 x 64 tiles
        return (base, f"D{a[0]} {dtype(a[1])} {kinds[int(a[2])]} {hdrop(a[2])}, 128 x 64 tile",
                resources.hopper_smem(int(a[0])))
    if base == "attn_fwd_sm90_tma_kernel":                             # HD, BF16, KIND: kFwdTmaKeyTile
        keys = tma_key_tile()
        return (base, f"D{a[0]} {dtype(a[1])} {kinds[int(a[2])]} {hdrop(a[2])}, 128 x {keys} tile",
                resources.hopper_smem(int(a[0]), keys))
    if base == "attn_bwd_sm90_kernel":                                 # HD, BF16, KIND: 128 keys x 64 rows
        hd = int(a[0])
        return base, f"D{hd} {dtype(a[1])} {kinds[int(a[2])]} no dropout", resources.hopper_bwd_smem(hd)
    if base in ("attn_dkdv_kernel", "attn_dq_kernel"):                 # HD, BF16, TERMS, KIND, DROP
        hd = int(a[0])
        smem = resources.dkdv_smem(hd) if base == "attn_dkdv_kernel" else resources.dq_smem(hd)
        terms = ", bias terms" if a[2] == "true" else ""
        return base, f"D{hd} {dtype(a[1])} {kinds[int(a[3])]} {drop(a[4])}{terms}", smem
    if base == "attn_bwd_fused_kernel":                                # HD, BF16, KIND, DROP
        hd = int(a[0])
        return base, f"D{hd} {dtype(a[1])} {kinds[int(a[2])]} {drop(a[3])}", resources.bwd_fused_smem(hd)
    if base == "attn_decode_split_kernel":                             # HD, BF16, STAGES
        hd, stages = int(a[0]), int(a[2])
        return base, f"D{hd} {dtype(a[1])}, {stages} stage(s)", resources.decode_smem(hd, stages)
    if base in ("attn_delta_kernel", "attn_dq_convert_kernel", "attn_decode_combine_kernel"):
        return base, dtype(a[0]), 0
    if base.startswith("lin_"):
        np_ = int(a[0]) if a else 0
        what = f"{np_} bf16 part(s)" if a else "F = 128"
        return base, what, _lin_smem(base, np_)
    return base, ", ".join(a), None


# ------------------------------------------------------------------------------------------ one unit

def _count(body: str, op: str) -> int:
    return len(re.findall(rf"(?<![\w.]){op}(?=[\s.])", body))


def read_unit(unit: str, report: str, obj: str, kinds: Dict[int, str]) -> List[Dict[str, str]]:
    """The table's rows of one compiled unit, one per (kernel, arch)."""
    entries = nvcc.ptxas_entries(report)
    names = demangle(sorted({e[1] for e in entries}))
    usage = nvcc.resource_usage(obj)
    rows = []
    for arch in archs_of(unit):
        sass = nvcc.sass_of(obj, arch)
        threads = nvcc.max_threads(obj, arch)
        for e_arch, name, regs, st, ld in entries:
            if e_arch != arch:
                continue
            body = next(iter(nvcc.functions(sass, name + "\n") or nvcc.functions(sass, name)), "")
            kernel, inst, dyn = describe(names[name], kinds)
            static = usage[(arch, name)]["SHARED"]
            nthreads = threads[name]
            if dyn is None:
                ctas = "?"
            else:
                n, limit = resources.ctas_per_sm(regs, dyn + static, nthreads, resources.ARCHS[CC_OF[arch]])
                ctas = f"{n} ({limit})"
            mma = "HGMMA" if _count(body, "HGMMA") else "HMMA" if _count(body, "HMMA") else None
            loop = nvcc.tile_loop(body, mma) if mma else None
            rows.append({"unit": unit, "arch": arch, "kernel": kernel, "instance": inst, "regs": str(regs),
                         "spill st/ld": f"{st}/{ld}", "smem static": str(static),
                         "smem dynamic": "?" if dyn is None else str(dyn), "threads": str(nthreads),
                         "CTAs/SM": ctas,
                         "loop static": str(loop["instrs"]) if loop else "-",
                         "trip": str(loop["trip"]) if loop else "-",
                         "loop MMA": f"{len(loop['mma'])} {mma}" if loop else "-",
                         "loop BAR": str(loop["barriers"]) if loop else "-",
                         **{op: str(_count(body, op)) for op in ("HGMMA", "UTMALDG", "SYNCS", "LDGSTS", "HMMA",
                                                                 "LDSM")}})
    return rows


def build(units: List[str], work: str, processes: int, reuse: bool = False) -> List[Dict[str, str]]:
    """Compiles `units` (`processes` nvcc at a time; with `reuse`, the objects already in `work` are read
    again) and returns their rows in `units`' order."""
    kinds = mask_kinds()

    def one(unit):
        out_dir = os.path.join(work, os.path.dirname(unit).replace("/", "_"))
        os.makedirs(out_dir, exist_ok=True)
        obj = os.path.join(out_dir, os.path.basename(unit) + ".o")
        if reuse and os.path.exists(obj + ".ptxas"):          # --work from an earlier run: its objects
            with open(obj + ".ptxas", encoding="utf-8") as f:
                report = f.read()
        else:
            report, obj = nvcc.compile_unit(unit, out_dir, nvcc.gencode_for(archs_of(unit)), threads=1)
            with open(obj + ".ptxas", "w", encoding="utf-8") as f:
                f.write(report)
        return read_unit(unit, report, obj, kinds)

    with concurrent.futures.ThreadPoolExecutor(processes) as pool:
        return [row for rows in pool.map(one, units) for row in rows]


# --------------------------------------------------------------------------------------- the document

def markdown_rows(rows: List[Dict[str, str]]) -> List[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
    return lines


def read_table(path: str) -> List[Dict[str, str]]:
    """The rows of a written table (the tests read the committed one)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == len(COLUMNS) and cells[0].endswith(".cu"):
                rows.append(dict(zip(COLUMNS, cells)))
    return rows


def _row(rows, unit, arch, kernel):
    return next((r for r in rows if r["unit"] == unit and r["arch"] == arch and r["kernel"] == kernel), None)


# the PREDICTION paragraphs: the model is _MODEL (below); the rates and published figures it uses
RATE = {"sm_80": 2048, "sm_90a": 4096}
PUBLISHED = {"sm_80": {"FA2": 0.73, "cuDNN": 0.73, "name": "cuDNN"},
             "sm_90a": {"FA2": 0.35, "cuDNN": 0.75, "name": "FA3 / cuDNN"}}
CASES = (  # (title, unit, arch, kernel, products per trip, the instance's start (None: the unit's only one), the
    #         title of an earlier case to set it against (None: none))
    ("forward D128 bf16 causal, mma.sync 128 x 64, A100", "attention/inst/fwd_128_bf16_causal_nodrop.cu", "sm_80",
     "attn_fwd_kernel", 2, "D128 bf16 causal no dropout, 128 x 64", None),
    ("forward D128 bf16 causal, mma.sync 128 x 32, A100", "attention/inst/fwd_128_bf16_causal_nodrop.cu", "sm_80",
     "attn_fwd_kernel", 2, "D128 bf16 causal no dropout, 128 x 32", "forward D128 bf16 causal, mma.sync 128 x 64, A100"),
    ("forward D64 bf16 causal, mma.sync, A100", "attention/inst/fwd_64_bf16_causal_nodrop.cu", "sm_80",
     "attn_fwd_kernel", 2, None, None),
    ("forward D128 bf16 causal (kWindow), Hopper TMA 128 x 128 ping-pong, H100", "attention/fwd_sm90.cu", "sm_90a",
     "attn_fwd_sm90_tma_kernel", 2, "D128 bf16 window", None),
    ("forward D64 bf16 causal (kWindow), Hopper TMA 128 x 128 ping-pong, H100", "attention/fwd_sm90.cu", "sm_90a",
     "attn_fwd_sm90_tma_kernel", 2, "D64 bf16 window", None),
    ("forward D128 bf16 kAny, Hopper TMA 128 x 128, H100", "attention/fwd_sm90.cu", "sm_90a",
     "attn_fwd_sm90_tma_kernel", 2, "D128 bf16 any", "forward D128 bf16 causal (kWindow), Hopper TMA 128 x 128 "
     "ping-pong, H100"),
    ("forward D128 bf16 causal (kWindow), Hopper cp.async 128 x 64, H100", "attention/fwd_sm90.cu", "sm_90a",
     "attn_fwd_sm90_kernel", 2, "D128 bf16 window", None),
    ("forward D128 bf16 causal, mma.sync 128 x 64 on H100", "attention/inst/fwd_128_bf16_causal_nodrop.cu", "sm_90a",
     "attn_fwd_kernel", 2, "D128 bf16 causal no dropout, 128 x 64", None),
    ("fused backward D128 bf16 causal, A100", "attention/inst/bwd_128_bf16_causal_nodrop.cu", "sm_80",
     "attn_bwd_fused_kernel", 5, None, None),
    ("fused backward D128 bf16 causal, H100 (mma.sync)", "attention/inst/bwd_128_bf16_causal_nodrop.cu", "sm_90a",
     "attn_bwd_fused_kernel", 5, None, None),
    ("Hopper backward D128 bf16 causal, H100 (wgmma)", "attention/inst/bwd_sm90_128_bf16.cu", "sm_90a",
     "attn_bwd_sm90_kernel", 5, "D128 bf16 causal", "fused backward D128 bf16 causal, H100 (mma.sync)"),
    ("Hopper backward D64 bf16 causal, H100 (wgmma)", "attention/inst/bwd_sm90_64_bf16.cu", "sm_90a",
     "attn_bwd_sm90_kernel", 5, "D64 bf16 causal", None),
)
# one trip's (query rows, keys) where the instance does not name its tile ("M x N tile"), and the warps issuing
# the loop (csrc/attention: FwdConfig, 4 warps; FwdSm90Config / FwdTmaConfig, 8 consumer warps in two
# warpgroups; BwdFusedConfig and BwdSm90Config: 128 keys x 64 query rows per trip, 8 warps)
TRIP = {"attn_fwd_kernel": 4, "attn_fwd_sm90_kernel": 8, "attn_fwd_sm90_tma_kernel": 8,
        "attn_bwd_fused_kernel": 8, "attn_bwd_sm90_kernel": 8}
BWD_TILE = (64, 128)
# the kernels on mma.sync (HMMA): on H100 at 2/3 of the wgmma rate (the model's assumption)
MMA_SYNC = ("attn_fwd_kernel", "attn_bwd_fused_kernel")


def predictions(rows: List[Dict[str, str]]) -> List[str]:
    out = ["## PREDICTION (offline model, not a measurement)", "",
           "Model: " + " ".join(line.lstrip("# ") for line in _MODEL.splitlines()), ""]
    util = {}
    for title, unit, arch, kernel, products, inst, versus in CASES:
        row = next((r for r in rows if r["unit"] == unit and r["arch"] == arch and r["kernel"] == kernel
                    and (inst is None or r["instance"].startswith(inst))), None)
        if row is None or row["trip"] == "-":
            out.append(f"- PREDICTION {title}: not in this table (unit not compiled).")
            continue
        d = int(re.match(r"D(\d+)", row["instance"]).group(1))
        tile = re.search(r"(\d+) x (\d+) tile", row["instance"])
        m, n = (int(tile.group(1)), int(tile.group(2))) if tile else BWD_TILE
        warps = TRIP[kernel]
        flops = 2 * products * m * n * d
        slow = arch == "sm_90a" and kernel in MMA_SYNC
        rate = RATE[arch] * (2 / 3 if slow else 1)
        tensor, issue = flops / rate, int(row["trip"]) * warps / 4
        peak = tensor / max(tensor, issue) * (2 / 3 if slow else 1)
        util[title] = peak
        pub = PUBLISHED[arch]
        line = (f"- PREDICTION {title}: one trip {m} x {n} at D{d}, {products} products = {flops / 1e6:.2f} MFLOP "
                f"-> tensor {tensor:.0f} cycles; issue {row['trip']} instrs x {warps} warps / 4 = "
                f"{issue:.0f} cycles; {'issue' if issue > tensor else 'tensor'}-bound, {100 * peak:.0f}% of the "
                f"dense bf16 peak at best; ratio to FA2 {peak / pub['FA2']:.2f}, to {pub['name']} "
                f"{peak / pub['cuDNN']:.2f} ({row['CTAs/SM']} CTAs/SM)")
        if versus in util:
            line += f"; {peak / util[versus]:.2f} x the prediction for the {versus}"
        out.append(line + ".")
    return out


_MODEL = """a main-loop trip of one block costs max(issue, tensor) SM cycles, assumed fully overlapped: issue = the
trip's instructions x warps of the block that run it / 4 schedulers (one instruction per scheduler per cycle;
the trip skips the mask code, so issue is a lower bound and the prediction the best case), tensor = the trip's matrix
FLOPs / the SM's dense bf16 rate (A100: 312 TFLOP/s over 108 SMs at 1.41 GHz = 2048 FLOP/cycle; H100 SXM: 989
TFLOP/s over 132 SMs at 1.83 GHz = 4096; mma.sync on H100 assumed at 2/3 of that); utilization = tensor /
max(issue, tensor). FA2 / cuDNN are not measured here: their utilizations are published figures (FlashAttention-2
paper: forward up to 73% of peak on A100; FlashAttention-3 paper: FlashAttention-2 about 35% on H100,
FlashAttention-3 up to 75%, cuDNN taken at that level on H100 and at FA2's on A100; the backward cases
are set against the same forward figures, which overstates their ratios). The TMA forward's two consumer
warpgroups take turns on the tensor cores (ping-pong named barriers: one warpgroup's softmax under the other's
wgmma), which is what the full overlap assumes there; a trip of the Hopper and the fused backward is one 64-row
query step of a 128-key block (five products). "x the prediction for" is the ratio of two of this model's
utilizations, not a measured speedup."""


def write(rows: List[Dict[str, str]], units: List[str], out_dir: str, command: str) -> str:
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    every = instance_units() + list(EXTRA_UNITS)
    left = [u for u in every if u not in units]
    lines = ["# effattn CUDA C++ kernels: offline resources (sm_80, sm_90a)", "",
             f"nvcc {nvcc.nvcc_version()}, {datetime.date.today().isoformat()}, commit {commit}; `{command}`.", "",
             "Columns: registers per thread; spill stores / loads in bytes (ptxas); shared memory per block in bytes, "
             "static (cuobjdump -res-usage) and dynamic (the launcher's size, effattn/backends/cuda/resources.py; "
             "lin_step_kernel's at F = 128); threads per block (__launch_bounds__, EIATTR_MAX_THREADS); CTAs/SM on an "
             "A100 (sm_80 code) or H100 (sm_90a code) from registers (256-register warp units), shared memory (+1 KB "
             "reserved per block) and threads against resources.ARCHS, with the limit that decides it. The main "
             "tile loop is the outermost backward branch (BRA to a lower address) whose span holds the kernel's "
             "HGMMA (else HMMA) instructions: its static instructions ('loop static'), the instructions of one trip "
             "('trip': the path through the body with all its tensor-core instructions and the fewest others, "
             "nested loops once; what a full tile issues at the least), tensor-core instructions and BAR.SYNC; '-' "
             "for kernels without tensor cores. HGMMA .. LDSM: static counts over the whole kernel.", "",
             f"Compiled: {len(units)} of the {len(every)} units the dispatch launches from "
             f"(csrc/generate_instances.py's instances and {', '.join(EXTRA_UNITS)})."
             + (f" Not compiled here: {len(left)} units ({', '.join(os.path.basename(u) for u in left)})."
                if left else ""), "",
             *markdown_rows(rows), "", *predictions(rows), ""]
    path = os.path.join(out_dir, NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", default="representative",
                    help="'representative' (default), 'all', or comma-separated paths under csrc/")
    ap.add_argument("--out", default=OUT, help=f"the folder {NAME} is written to (default: {OUT})")
    ap.add_argument("--work", default=None, help="where the objects go (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="read the objects already in --work instead of compiling")
    ap.add_argument("--processes", type=int, default=2, help="nvcc processes at a time (default 2)")
    args = ap.parse_args(argv)
    units = (representative_units() if args.units == "representative" else
             instance_units() + list(EXTRA_UNITS) if args.units == "all" else args.units.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        rows = build(units, args.work or tmp, args.processes, args.reuse and args.work is not None)
    command = "python3 -m tools.cuda.kernel_table" + (f" --units {args.units}" if args.units != "representative" else "")
    print(write(rows, units, args.out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
