"""One-shot GPU check of the Triton backend: correctness at real sizes, then timing and memory
against SDPA (FlashAttention-2 and cuDNN kernels) and torch.compile(flex_attention) with the same
mask, at the shapes of ../ANCHORS.md. Made for a single call on a borrowed GPU machine:

    python3 benchmarks/triton_gpu_check.py                 # ~6 min (--budget-s 360), from the repo root
    python3 benchmarks/triton_gpu_check.py --full          # every ANCHORS row, flex everywhere (~15+ min)
    python3 benchmarks/triton_gpu_check.py --dry-run       # no GPU: print the plan (shapes, FLOPs, memory)
    python3 benchmarks/triton_gpu_check.py --smoke         # no GPU: run every section at toy sizes on CPU
                                                           # (Triton's interpreter) to test this script

It never stops half way: each case runs in its own try/except and an error becomes a row
(``status`` = ``ERROR: ...``, ``skipped: <why>`` where a baseline does not apply); once
``--budget-s`` seconds have passed, the cases left are recorded as ``skipped: budget`` (a case
already started runs to its end: allow a minute or two beyond the budget). Results are written after
every case to ``--out`` (default ``$OUT`` if set, else ``benchmarks/results/gpu-check``):
``triton_gpu_check.csv`` (one row per measurement), ``triton_gpu_check.md`` (device, versions,
date, tables) and ``triton_gpu_check.json`` (both), so a run cut short keeps what it measured. A
short table is printed at the end; the exit status is 1 when a correctness case failed or a
baseline's output disagreed (``MISMATCH``).

Where the time goes: compiling. The check section pins the first config of each kernel (3-4
compiles per kind of call, ~15 kinds); the perf section autotunes (~10 configs per kind, each
compiled once) and flex compiles once per shape and mask.

Sections, in this order (correctness first: it is what the run is for):

1. ``check``: forward and gradients in bf16 (also fp16, fp32 IEEE, fp32 with TF32) against a
   float64 reference computed in row chunks, judged by the project's rule: error at most 2x (out) /
   3x (grads) the error of the same dense computation done naively in the input dtype (+ a small
   floor). Cases cover dense / causal / window / block-sparse layouts with tiles that do not match
   the layout block, GQA, Lq != Lk, Dv != D, head dim 256, a decode row against 16k keys, a
   key_padding_mask, B*H > 65535 (1-D grids), int64 offsets (keys and values viewed from an
   (L, B, 2, H, D) tensor whose span passes 2**31 elements, compared bitwise with a contiguous
   copy), bitwise-deterministic backward with dropout, CUDA-graph capture and torch.compile; and,
   last of the run, a call of a never-tuned kind made during CUDA-graph capture.
2. ``perf``: medians of ``triton.testing.do_bench`` (forward under no_grad; forward+backward), bf16:
   ANCHORS.md's B*L = 16k tokens, H*D = 2048, causal and dense, vs SDPA flash / cuDNN; B=1, H=16,
   D=128, the causal sliding window (left 1024) and the 'fixed' block-sparse layout
   (``sliding_and_summary(L, 128, 4, 16)``) at L = 16k and 64k vs flex with the same mask, next to
   causal (SDPA flash) as the dense reference; then (after the memory section) flex on the dense /
   causal rows and the rest of ANCHORS.md (D=64, more lengths). Each baseline row records the
   largest difference of its output and gradients from effattn's (relative to the baseline's
   largest value): a check of the autotuned configs, which the check section does not run.
3. ``memory``: peak memory of forward+backward beyond the inputs at L = 64k (B=1, H=16, D=128),
   effattn causal / window / fixed vs SDPA flash causal.

TFLOP/s count 4*B*H*(visible pairs)*D for the forward and 3.5x that for forward+backward, the
visible pairs counted exactly for each mask (so masked variants are charged only useful work).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["section", "case", "impl", "mode", "dtype", "B", "H", "Hkv", "Lq", "Lk", "D", "status", "ms",
          "tflops", "first_call_s", "peak_mib", "metric", "detail"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=360.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--full", action="store_true", help="every ANCHORS row (D 64 and 128, L 1k..16k), flex everywhere")
    ap.add_argument("--no-flex", action="store_true", help="skip torch.compile(flex_attention) (it compiles per shape)")
    ap.add_argument("--sections", default="check,perf,memory", help="comma-separated subset of check,perf,memory")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results/gpu-check)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan without running anything (no GPU needed)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU through Triton's interpreter: tests this script")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])
if ARGS.smoke:                       # Triton reads this when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, ROOT)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import effattn  # noqa: E402
from effattn.layouts import BlockLayout, sliding_and_summary  # noqa: E402


def log(*a):
    print(*a, flush=True)


# ============================================================================ recording and budget

class Recorder:
    """Collects rows and rewrites the CSV / markdown / JSON files after each one."""

    def __init__(self, out_dir, meta, budget_s):
        self.out_dir, self.meta, self.rows = out_dir, meta, []
        self.t0, self.budget_s = time.time(), budget_s
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)

    def elapsed(self):
        return time.time() - self.t0

    def over_budget(self):
        return self.elapsed() > self.budget_s

    def add(self, **row):
        row = {k: row.get(k, "") for k in FIELDS}
        self.rows.append(row)
        shown = {k: v for k, v in row.items() if v not in ("", None) and k not in ("section", "detail")}
        log(f"[{self.elapsed():6.1f}s] {row['section']:6s} " + " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
            + (f"  ({row['detail']})" if row["detail"] else ""))
        self.write()
        return row

    def write(self):
        if not self.out_dir:
            return
        try:
            with open(os.path.join(self.out_dir, "triton_gpu_check.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(self.rows)
            with open(os.path.join(self.out_dir, "triton_gpu_check.json"), "w") as f:
                json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1, default=str)
            with open(os.path.join(self.out_dir, "triton_gpu_check.md"), "w") as f:
                f.write(markdown(self.meta, self.rows))
        except OSError as e:              # a full disk must not end the run
            log(f"(could not write results: {e})")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown(meta, rows):
    out = ["# effattn Triton backend: GPU check", ""]
    out += [f"- {k}: {v}" for k, v in meta.items()]
    for section in ("check", "perf", "memory"):
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        cols = [c for c in FIELDS if c != "section" and any(r[c] not in ("", None) for r in sec)]
        out += ["", f"## {section}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in sec:
            out.append("| " + " | ".join(_fmt(r[c]).replace("|", "/").replace("\n", " ") for c in cols) + " |")
    return "\n".join(out) + "\n"


def summary(rows):
    """The short final table: correctness verdicts, then effattn vs the best baseline per row."""
    lines = ["", "=" * 100, "SUMMARY", "=" * 100]
    checks = [r for r in rows if r["section"] == "check"]
    bad = [r for r in checks if not str(r["status"]).startswith(("PASS", "skipped"))]
    lines.append(f"check: {sum(str(r['status']).startswith('PASS') for r in checks)} pass, {len(bad)} not pass, "
                 f"{sum(str(r['status']).startswith('skipped') for r in checks)} skipped")
    for r in bad:
        lines.append(f"  {r['status'][:12]:12s} {r['case']}: {r['metric']} {str(r['detail'])[:150]}")
    perf = [r for r in rows if r["section"] == "perf" and r["status"] == "ok"]
    keys = []
    for r in perf:
        k = (r["case"], r["mode"])
        if k not in keys:
            keys.append(k)
    if keys:
        lines.append("")
        lines.append(f"{'case':44s} {'mode':7s} {'effattn ms':>10s} {'TFLOP/s':>8s} {'best baseline':>22s} "
                     f"{'ratio':>6s}")
        for case, mode in keys:
            group = [r for r in perf if (r["case"], r["mode"]) == (case, mode)]
            ours = [r for r in group if r["impl"] == "effattn-triton"]
            base = [r for r in group if r["impl"] != "effattn-triton"]
            if not ours:
                continue
            o = ours[0]
            b = min(base, key=lambda r: r["ms"]) if base else None
            bs = f"{b['impl']} {b['ms']:.3f}" if b else "-"
            ratio = f"{o['ms'] / b['ms']:.2f}" if b else "-"
            lines.append(f"{case:44s} {mode:7s} {o['ms']:10.3f} {o['tflops']:8.0f} {bs:>22s} {ratio:>6s}")
    mem = [r for r in rows if r["section"] == "memory" and r["status"] == "ok"]
    if mem:
        lines.append("")
        lines += [f"memory {r['case']:40s} {r['impl']:16s} {r['peak_mib']:10.1f} MiB" for r in mem]
    mismatches = [r for r in rows if "MISMATCH" in str(r["metric"])]
    if mismatches:
        lines.append("")
        lines += [f"MISMATCH {r['case']} {r['impl']}: {r['metric']}" for r in mismatches]
    others = [r for r in rows if r["section"] != "check" and str(r["status"]).startswith("ERROR")]
    if others:
        lines.append("")
        lines += [f"ERROR {r['section']} {r['case']} {r['impl']} {r['mode']}: {str(r['status'])[:160]}" for r in others]
    return "\n".join(lines)


class Skip(Exception):
    """A case or implementation that does not apply here (recorded as ``skipped: <why>``)."""


def error_row(e):
    """status and detail fields for an exception."""
    if isinstance(e, Skip):
        return dict(status=f"skipped: {e}")
    oom = isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ()))
    tb = traceback.extract_tb(e.__traceback__)
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb[-3:]))
    return dict(status="OOM" if oom else f"ERROR: {type(e).__name__}: {str(e)[:300]}", detail=where)


def run_case(rec, section, case, fn, **fields):
    """Runs fn() -> None (it adds its own rows), turning an exception or the budget into a row."""
    if rec.over_budget():
        rec.add(section=section, case=case, status="skipped: budget", **fields)
        return
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a failing case is a result, not the end of the run
        rec.add(section=section, case=case, **error_row(e), **fields)
    finally:
        _free()


def _free():
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ======================================================================================= helpers

class Env:
    """Device, sizes and timing for a real run (GPU) or a smoke run (CPU, toy sizes)."""

    def __init__(self, smoke):
        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")

    def L(self, n):
        """A sequence length: `n` on the GPU, a toy one (keeping n's ratio to 4096, >= 16) in smoke."""
        return n if not self.smoke else max(16, min(96, n * 64 // 4096))

    def bench(self, fn):
        if self.smoke:
            ts = []
            for _ in range(2):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return sorted(ts)[len(ts) // 2]
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()


def visible_pairs(Lq, Lk, causal=False, left=None, right=None, layout=None, heads=1):
    """Exact number of visible (i, j) pairs summed over `heads` heads (the layout's heads, or
    `heads` copies of its single head), on the CPU in O(Lq * n_key_blocks): per query row its key
    interval [lo, hi] (bottom-right aligned) intersected with the allowed key blocks."""
    off = Lk - Lq
    if causal:
        right = 0 if right is None else min(right, 0)
    i = torch.arange(Lq, dtype=torch.int64)
    lo = torch.zeros(Lq, dtype=torch.int64) if left is None else (i + off - left).clamp(min=0)
    hi = torch.full((Lq,), Lk - 1, dtype=torch.int64) if right is None else (i + off + right).clamp(max=Lk - 1)
    if layout is None:
        return int((hi - lo + 1).clamp(min=0).sum()) * heads
    bs = layout.block_size
    mask = layout.mask.cpu()
    total = 0
    kb0 = torch.arange(mask.shape[2], dtype=torch.int64) * bs
    kb1 = (kb0 + bs - 1).clamp(max=Lk - 1)
    for h in range(mask.shape[0]):
        for r0 in range(0, Lq, 8192):
            r1 = min(r0 + 8192, Lq)
            rows = torch.arange(r0, r1)
            allowed = mask[h][rows // bs]                                    # (rows, nkb)
            inter = (torch.minimum(hi[r0:r1, None], kb1[None]) - torch.maximum(lo[r0:r1, None], kb0[None]) + 1)
            total += int((inter.clamp(min=0) * allowed).sum())
    return total * (heads if mask.shape[0] == 1 else 1)


def vis_fn(Lq, Lk, causal, left, right, layout, kpm, device):
    """vis(i0, i1) -> bool broadcastable to (B, H, i1 - i0, Lk)."""
    def fn(i0, i1):
        i = torch.arange(i0, i1, device=device)[:, None]
        j = torch.arange(Lk, device=device)[None, :]
        pos = i + Lk - Lq
        ok = torch.ones(i1 - i0, Lk, dtype=torch.bool, device=device)
        r = 0 if causal and right is None else (min(right, 0) if causal else right)
        if left is not None:
            ok &= j >= pos - left
        if r is not None:
            ok &= j <= pos + r
        ok = ok[None, None]
        if layout is not None:
            bs = layout.block_size
            m = layout.mask.to(device)
            ok = ok & m[:, torch.arange(i0, i1, device=device) // bs][:, :, torch.arange(Lk, device=device) // bs][None]
        if kpm is not None:
            ok = ok & ~kpm[:, None, None, :]
        return ok
    return fn


def chunked_reference(q, k, v, go, vis, scale, dtype, chunk=512, tf32=False):
    """Dense attention and its gradients computed naively in `dtype`, `chunk` query rows at a time.
    Returns out, dq, dk, dv (dk/dv accumulated in fp32 or fp64)."""
    G = q.shape[1] // k.shape[1]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kl, vl = k.detach().to(dtype).requires_grad_(), v.detach().to(dtype).requires_grad_()
    outs, dqs = [], []
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    with _tf32(tf32):
        for i0 in range(0, q.shape[2], chunk):
            i1 = min(i0 + chunk, q.shape[2])
            qc = q[:, :, i0:i1].detach().to(dtype).requires_grad_()
            ke, ve = kl.repeat_interleave(G, 1), vl.repeat_interleave(G, 1)
            s = torch.matmul(qc, ke.transpose(-1, -2)) * scale
            ok = vis(i0, i1)
            s = s.masked_fill(~ok, -math.inf)
            pr = torch.softmax(s.float() if dtype in (torch.float16, torch.bfloat16) else s, -1).to(dtype)
            pr = torch.where(ok.any(-1, keepdim=True), pr, torch.zeros_like(pr))
            o = torch.matmul(pr, ve)
            gq, gk, gv = torch.autograd.grad(o, (qc, kl, vl), go[:, :, i0:i1].to(dtype))
            outs.append(o.detach())
            dqs.append(gq)
            dk += gk.to(acc)
            dv += gv.to(acc)
    return torch.cat(outs, 2), torch.cat(dqs, 2), dk, dv


class _tf32:
    """Context: torch's fp32 matmul precision set to TF32 (or IEEE) through whichever API exists."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.new_api = hasattr(m, "fp32_precision")
        if self.new_api:
            self.prev = m.fp32_precision
            m.fp32_precision = "tf32" if self.on else "ieee"
        else:
            self.prev = m.allow_tf32
            m.allow_tf32 = self.on

    def __exit__(self, *exc):
        m = torch.backends.cuda.matmul
        if self.new_api:
            m.fp32_precision = self.prev
        else:
            m.allow_tf32 = self.prev


def rand(shape, dtype, device, gen=None):
    return torch.randn(*shape, dtype=torch.float32, device=device, generator=gen).to(dtype)


# ==================================================================================== 1. check

def check_cases(env):
    """id -> dict(B, H, Hkv, Lq, Lk, D, Dv, dtype, causal, left, right, layout(L) or None, kpm_frac,
    tf32). Small on the CPU smoke run."""
    bf, L = torch.bfloat16, env.L
    def c(B, H, Hkv, Lq, Lk, D, Dv=None, dtype=bf, causal=False, left=None, right=None, layout=None, kpm=0.0,
          tf32=False):
        return dict(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, Dv=Dv or D, dtype=dtype, causal=causal, left=left,
                    right=right, layout=layout, kpm=kpm, tf32=tf32)
    small_h = 2 if env.smoke else 8
    d = (lambda n: min(n, 32)) if env.smoke else (lambda n: n)
    return {
        "dense B2 H8 L2k D128": c(2, small_h, small_h, L(2048), L(2048), d(128)),
        "causal GQA H8/Hkv2 L4k D128": c(1, small_h, 2, L(4096), L(4096), d(128), causal=True),
        "window 512 causal L4k D128": c(1, small_h, small_h, L(4096), L(4096), d(128), causal=True,
                                        left=env.L(512)),
        "fixed layout bs128 causal L4k D128": c(1, small_h, small_h, L(4096), L(4096), d(128), causal=True,
                                                layout=lambda Lq: sliding_and_summary(Lq, 16 if env.smoke else 128,
                                                                                      4, 8)),
        "layout bs64 30% x tiles, kpm, D64 L4k": c(2, 4, 4, L(4096), L(4096), d(64), kpm=0.1,
                                                   layout=lambda Lq: _rand_layout(4, Lq, Lq, 16 if env.smoke else 64,
                                                                                  0.3)),
        "dense D256 H4 L2k": c(1, 4, 4, L(2048), L(2048), 64 if env.smoke else 256),
        "causal Lq1000 Lk3000 D96 Dv64 GQA": c(1, 4, 2, L(1000), L(3000), d(96), d(64), causal=True),
        "decode Lq1 Lk16k GQA H32/Hkv8 D128": c(4, 4 if env.smoke else 32, 2 if env.smoke else 8, 1, L(16384),
                                                d(128), causal=True),
        "fp16 causal L4k D128": c(1, small_h, small_h, L(4096), L(4096), d(128), dtype=torch.float16, causal=True),
        "fp32 causal L2k D64 (IEEE)": c(1, 4, 4, L(2048), L(2048), d(64), dtype=torch.float32, causal=True),
        "fp32 window L2k D64 (TF32)": c(1, 4, 4, L(2048), L(2048), d(64), dtype=torch.float32, causal=True,
                                        left=env.L(300), tf32=True),
        "B*H=65552>65535 decode Lq1 Lk128 D128 GQA": c(4 if env.smoke else 4097, 16, 4, 1,
                                                       128 if not env.smoke else 40, d(128), causal=True),
    }


def _rand_layout(H, Lq, Lk, bs, density, seed=1):
    g = torch.Generator().manual_seed(seed)
    return BlockLayout(torch.rand(H, -(-Lq // bs), -(-Lk // bs), generator=g) < density, bs)


def check_one(rec, env, name, cfg):
    dev, dtype = env.dev, cfg["dtype"]
    B, H, Hkv, Lq, Lk, D, Dv = (cfg[k] for k in ("B", "H", "Hkv", "Lq", "Lk", "D", "Dv"))
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = rand((B, H, Lq, D), dtype, dev, g), rand((B, Hkv, Lk, D), dtype, dev, g), rand((B, Hkv, Lk, Dv), dtype, dev, g)
    go = rand((B, H, Lq, Dv), dtype, dev, g)
    layout = cfg["layout"](Lq).to(dev) if cfg["layout"] else None
    kpm = None
    if cfg["kpm"]:
        kpm = torch.zeros(B, Lk, dtype=torch.bool, device=dev)
        kpm[:, int(Lk * (1 - cfg["kpm"])):] = True                           # right padding
        kpm[0, : max(1, Lk // 50)] = True                                     # and some on the left
    kw = dict(causal=cfg["causal"], layout=layout, key_padding_mask=kpm)
    if cfg["left"] is not None or cfg["right"] is not None:
        kw["window"] = (cfg["left"] if cfg["left"] is not None else 10**9,
                        cfg["right"] if cfg["right"] is not None else (0 if cfg["causal"] else 10**9))
    scale = 1 / math.sqrt(D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    t0 = time.time()
    with _tf32(cfg["tf32"]):
        out = effattn.attention(*leaves, scale=scale, backend="triton", **kw)
        got = (out,) + torch.autograd.grad(out, leaves, go)
    env.sync()
    first = time.time() - t0
    vis = vis_fn(Lq, Lk, cfg["causal"], cfg["left"], cfg["right"], layout, kpm, dev)
    ref = chunked_reference(q, k, v, go.double(), vis, scale, torch.float64)
    low = chunked_reference(q, k, v, go, vis, scale, dtype, tf32=cfg["tf32"])
    ratios, verdict, worst = [], "PASS", ""
    floor = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    for nm, x, r, lo, mult in zip(("out", "dq", "dk", "dv"), got, ref, low, (2, 3, 3, 3)):
        err = (x.double() - r).abs().max().item() if x.numel() else 0.0
        nerr = (lo.double() - r).abs().max().item() if x.numel() else 0.0
        ratios.append(f"{nm} {err:.2e}/{nerr:.2e}")
        if not math.isfinite(err) or err > mult * nerr + floor:
            verdict, worst = "FAIL", worst + f" {nm}: {err:.3g} > {mult}x{nerr:.3g}+{floor:g};"
    rec.add(section="check", case=name, impl="effattn-triton", mode="fwd+bwd", dtype=str(dtype).replace("torch.", ""),
            B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, status=verdict, first_call_s=round(first, 2),
            metric="err/naive: " + ", ".join(ratios), detail=worst.strip())


def check_idx64(rec, env):
    """Keys and values viewed from one (Lk, B, 2, Hkv, D) tensor: their length stride B*2*Hkv*D makes
    the span (Lk-1)*stride exceed 2**31 elements, so the kernels take int64 offsets; the result
    must equal, bitwise, that of a contiguous copy (int32 offsets, same config)."""
    dev = env.dev
    if env.smoke:
        Lk, Hkv, D = 64, 2, 16
    else:
        Lk, Hkv, D = (1 << 20) + 64, 8, 128           # span ~ 2**20 * 2 * 8 * 128 = 2**31 + ...
    H, Lq, B = 2 * Hkv, 256 if not env.smoke else 32, 1
    g = torch.Generator(device=dev).manual_seed(1)
    kv = rand((Lk, B, 2, Hkv, D), torch.bfloat16, dev, g)
    k, v = kv[:, :, 0].permute(1, 2, 0, 3), kv[:, :, 1].permute(1, 2, 0, 3)   # (B, Hkv, Lk, D) views
    q = rand((B, H, Lq, D), torch.bfloat16, dev, g)
    go = rand((B, H, Lq, D), torch.bfloat16, dev, g)
    from effattn.backends.triton import attention as ta
    span = (Lk - 1) * k.stride(2) + (D - 1) * k.stride(3)
    wide = ta._Problem(q, k, v, None, 0, None, None, 1.0, 0.0, -1, 0).idx64
    results = []
    for kk, vv in ((k.contiguous(), v.contiguous()), (k, v)):            # contiguous first: it tunes the config
        leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
        out = effattn.attention(*leaves, causal=True, backend="triton")
        results.append((out,) + torch.autograd.grad(out, leaves, go))
        del leaves, out
    same = [torch.equal(a, b) for a, b in zip(*results)]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*results))
    ok = all(same) and (wide or env.smoke)
    rec.add(section="check", case="int64 offsets: k,v from (Lk,B,2,Hkv,D), span %.2fG" % (span / 2**30),
            impl="effattn-triton", mode="fwd+bwd", dtype="bfloat16", B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D,
            status="PASS" if ok else "FAIL",
            metric=f"idx64={wide} bitwise(out,dq,dk,dv)={same} max|diff|={diff:.3g}")


def check_determinism(rec, env):
    dev = env.dev
    L, H, Hkv, D = env.L(4096), 8 if not env.smoke else 2, 2 if not env.smoke else 1, 128 if not env.smoke else 32
    g = torch.Generator(device=dev).manual_seed(2)
    q = rand((2, H, L, D), torch.bfloat16, dev, g)
    k, v = rand((2, Hkv, L, D), torch.bfloat16, dev, g), rand((2, Hkv, L, D), torch.bfloat16, dev, g)
    go = rand((2, H, L, D), torch.bfloat16, dev, g)
    layout = sliding_and_summary(L, 16 if env.smoke else 128, 4, 8).to(dev)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(1)
        out = effattn.attention(*leaves, causal=True, layout=layout, dropout_p=0.1, backend="triton")
        runs.append((out,) + torch.autograd.grad(out, leaves, go))
    same = [torch.equal(a, b) for a, b in zip(*runs)]
    rec.add(section="check", case="bitwise-deterministic bwd (dropout, layout, GQA)", impl="effattn-triton",
            mode="fwd+bwd", dtype="bfloat16", B=2, H=H, Hkv=Hkv, Lq=L, Lk=L, D=D,
            status="PASS" if all(same) else "FAIL", metric=f"equal(out,dq,dk,dv)={same}")


def check_cuda_graph(rec, env):
    """Capture forward+backward in a CUDA graph after a warm-up call (tuned config), replay, and
    compare bitwise with eager; then a call whose kind was never tuned, made during capture (takes
    the first config, untimed; compiles while capturing)."""
    if env.smoke:
        raise Skip("needs CUDA")
    dev = env.dev
    q, go = (torch.randn(1, 8, 2048, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, 2048, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step():
        out = effattn.attention(*leaves, causal=True, backend="triton")
        return (out,) + torch.autograd.grad(out, leaves, go)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                   # warm-up on the side stream, as torch's docs ask
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    same = [torch.equal(a, b) for a, b in zip(eager, captured)]
    rec.add(section="check", case="CUDA graph capture/replay", impl="effattn-triton", mode="fwd+bwd",
            dtype="bfloat16", B=1, H=8, Hkv=2, Lq=2048, Lk=2048, D=128, status="PASS" if all(same) else "FAIL",
            metric=f"bitwise vs eager={same}")


def check_untuned_in_capture(rec, env):
    """A call whose kind was never tuned, made while a CUDA graph is being captured: it must take
    the first config untimed (compiling the kernel during capture) and give the right result. Run
    last: a capture that fails can leave CUDA in an error state."""
    if env.smoke:
        raise Skip("needs CUDA")
    q2 = torch.randn(1, 4, 640, 80, device=env.dev, dtype=torch.float16)
    ref2 = effattn.attention(q2, q2, q2, window=(33, 7), backend="torch")
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        out2 = effattn.attention(q2, q2, q2, window=(33, 7), backend="triton")
    g2.replay()
    torch.cuda.synchronize()
    err2 = (out2.float() - ref2.float()).abs().max().item()
    rec.add(section="check", case="untuned kind met during CUDA-graph capture", impl="effattn-triton", mode="fwd",
            dtype="float16", B=1, H=4, Lq=640, Lk=640, D=80, status="PASS" if err2 < 2e-2 else "FAIL",
            metric=f"max|err| vs torch backend {err2:.3g}")


def check_compile(rec, env):
    """torch.compile(fullgraph=True) with the default (inductor) backend around the custom ops:
    forward and gradients bitwise equal to eager."""
    dev = env.dev
    L, D = env.L(1024), 128 if not env.smoke else 16
    q, k, v = (torch.randn(2, 4, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    layout = sliding_and_summary(L, 16 if env.smoke else 128, 2, 4).to(dev)

    def f(q, k, v):
        return effattn.attention(q, k, v, causal=True, layout=layout, backend="triton") * 2

    t0 = time.time()
    out = torch.compile(f, fullgraph=True, backend="aot_eager" if env.smoke else "inductor")(q, k, v)
    gc_ = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    env.sync()
    first = time.time() - t0
    ref = f(q, k, v)
    gr = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    same = [torch.equal(a, b) for a, b in zip((out,) + gc_, (ref,) + gr)]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip((out,) + gc_, (ref,) + gr))
    rec.add(section="check", case="torch.compile(fullgraph) vs eager", impl="effattn-triton", mode="fwd+bwd",
            dtype="bfloat16", B=2, H=4, Lq=L, Lk=L, D=D, status="PASS" if diff < 1e-2 else "FAIL",
            first_call_s=round(first, 1), metric=f"bitwise={same} max|diff|={diff:.3g}")


def section_check(rec, env):
    """Runs with the first config of each kernel (EFFATTN_TRITON_AUTOTUNE=0): each kind of call
    compiles 3 kernels instead of timing ~10 candidates, which keeps the section to a few minutes;
    the tuned configs are checked against the baselines in the perf section. The pinned choices are
    forgotten afterwards."""
    log("\n## 1. correctness (first config of each kernel, untimed)\n")
    prev = os.environ.get("EFFATTN_TRITON_AUTOTUNE")
    os.environ["EFFATTN_TRITON_AUTOTUNE"] = "0"
    try:
        for name, cfg in check_cases(env).items():
            run_case(rec, "check", name, lambda name=name, cfg=cfg: check_one(rec, env, name, cfg),
                     impl="effattn-triton")
        run_case(rec, "check", "bitwise-deterministic bwd", lambda: check_determinism(rec, env))
        run_case(rec, "check", "int64 offsets", lambda: check_idx64(rec, env))
        run_case(rec, "check", "CUDA graph capture/replay", lambda: check_cuda_graph(rec, env))
        run_case(rec, "check", "torch.compile(fullgraph) vs eager", lambda: check_compile(rec, env))
    finally:
        if prev is None:
            os.environ.pop("EFFATTN_TRITON_AUTOTUNE", None)
        else:
            os.environ["EFFATTN_TRITON_AUTOTUNE"] = prev
        from effattn.backends.triton import attention as ta
        ta._TUNED.clear()


# ===================================================================================== 2. perf

def sdpa_fn(which, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[which]

    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def flex_fn(env, L, causal, left, layout):
    """torch.compile(flex_attention) with a BlockMask built from the same rule (bottom-right
    alignment is the identity here: Lq == Lk)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    lay = layout.mask[0].to(env.dev) if layout is not None else None
    bs = layout.block_size if layout is not None else 1

    def mask_mod(b, h, qi, kj):
        ok = qi >= 0
        if causal:
            ok = ok & (kj <= qi)
        if left is not None:
            ok = ok & (kj >= qi - left)
        if lay is not None:
            ok = ok & lay[qi // bs, kj // bs]
        return ok

    bm = create_block_mask(mask_mod, None, None, L, L, device=env.dev)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=bm)


def perf_rows(env, full, use_flex):
    """Two lists of (case, B, H, D, L, causal, left, layout builder or None, implementations), in
    priority order: the core rows (run before the memory section) and the rest (after it)."""
    core, rest = [], []
    T = 16384                                     # tokens per batch (ANCHORS.md): B = T / L, H * D = 2048
    ours = "effattn-triton"

    def anchor(D, L, causal, impls):
        return (f"{'causal' if causal else 'dense'} D{D} L{L // 1024}k", T // L, 2048 // D, D, L, causal, None, None,
                impls)
    flex = ["flex"] if use_flex else []
    # the core, most telling first: ANCHORS' L=4k, then the masks SDPA cannot fuse (flex is the only
    # fused baseline there) next to dense causal SDPA, then L = 1k and 16k
    Ls = [4096, 16384, 1024, 2048, 8192] if full else [4096]
    for D in ([128, 64] if full else [128]):
        for L in Ls:
            for causal in (True, False):
                core.append(anchor(D, L, causal, [ours, "flash", "cudnn"] + (flex if full else [])))
    for L in (16384, 65536):
        core.append((f"window1024 causal D128 L{L // 1024}k", 1, 16, 128, L, True, 1024, None, [ours] + flex))
        core.append((f"fixed bs128 4+16th causal D128 L{L // 1024}k", 1, 16, 128, L, True, None,
                     lambda L: sliding_and_summary(L, 128, 4, 16), [ours] + flex))
        core.append((f"causal D128 L{L // 1024}k B1 H16 (dense reference)", 1, 16, 128, L, True, None, None,
                     [ours, "flash"]))
    if not full:
        for L in (1024, 16384):
            for causal in (True, False):
                core.append(anchor(128, L, causal, [ours, "flash", "cudnn"]))
    if not full:
        for L in (4096, 16384):                   # flex on the ANCHORS rows (compiles per shape: later)
            for causal in (False, True):
                if flex:
                    rest.append(anchor(128, L, causal, flex))
        for D in (128, 64):
            for L in ([2048, 8192] if D == 128 else [1024, 2048, 4096, 8192, 16384]):
                for causal in (False, True):
                    rest.append(anchor(D, L, causal, [ours, "flash", "cudnn"]))
    if env.smoke:                                 # toy sizes: one dense, one window, one layout row
        def toy(r):
            name, B, H, D, L, causal, left, lay, impls = r
            return (name, 1, 2, 16, env.L(L), causal, 16 if left else None,
                    (lambda L: sliding_and_summary(L, 16, 2, 4)) if lay else None, impls + ["effattn-torch"])
        core = [toy(core[0]), toy(core[2]), toy(core[3])]
        rest = [toy(r) for r in rest[:1] + rest[-1:]]
    return core, rest


def _impl_fn(env, impl, L, causal, left, layout, kw):
    """The callable (q, k, v) -> out for one implementation; baselines are built once here (flex
    compiles its block mask)."""
    if impl in ("effattn-triton", "effattn-torch"):
        return lambda q, k, v: effattn.attention(q, k, v, backend=impl.split("-")[1], **kw)
    if impl in ("flash", "cudnn"):
        if env.dev.type != "cuda":
            raise Skip("SDPA flash/cuDNN need CUDA")
        if left is not None or layout is not None:
            raise Skip("SDPA has no fused kernel for this mask")
        return sdpa_fn(impl, causal)
    if env.smoke:
        raise Skip("flex is not run in the smoke test")
    return flex_fn(env, L, causal, left, layout)


def _max_rel_diff(a, b):
    """max |a - b| / max |b| (b: the baseline)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def perf_one(rec, env, row):
    """Times each implementation (forward under no_grad, forward+backward) and compares its output
    and gradients with effattn's (same inputs, same mask): a tuned config the correctness section
    did not run is still checked against a baseline here."""
    name, B, H, D, L, causal, left, make_layout, impls = row
    dev, dt = env.dev, torch.bfloat16
    layout = make_layout(L).to(dev) if make_layout else None
    pairs = visible_pairs(L, L, causal=causal, left=left, layout=layout, heads=H)
    flops_fwd = 4 * B * D * pairs
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, go = (rand((B, H, L, D), dt, dev, g) for _ in range(4))
    kw = dict(causal=causal, layout=layout)
    if left is not None:
        kw["window"] = (left, 0)
    fields = dict(section="perf", case=name, dtype="bfloat16", B=B, H=H, Hkv=H, Lq=L, Lk=L, D=D)
    ours = None                                    # effattn's out, dq, dk, dv: what baselines are compared with
    try:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        t0 = time.time()
        o = effattn.attention(*leaves, backend="triton", **kw)
        ours = (o.detach(),) + torch.autograd.grad(o, leaves, go)
        env.sync()
        first_ours = time.time() - t0
        del o, leaves
    except Exception as e:  # noqa: BLE001
        rec.add(impl="effattn-triton", **error_row(e), **fields)
        impls = [i for i in impls if i != "effattn-triton"]
    for impl in impls:
        if rec.over_budget():
            rec.add(impl=impl, status="skipped: budget", **fields)
            continue
        try:
            fn = _impl_fn(env, impl, L, causal, left, layout, kw)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            t0 = time.time()
            o = fn(*leaves)
            grads = torch.autograd.grad(o, leaves, go)
            env.sync()
            first = first_ours if impl == "effattn-triton" else time.time() - t0
            vs, mismatch = "", False
            if ours is not None and impl != "effattn-triton":
                diffs = [_max_rel_diff(a, b) for a, b in zip(ours, (o,) + grads)]
                mismatch = diffs[0] > 0.03 or max(diffs[1:]) > 0.08         # bf16 rounding: ~0.4% per op
                vs = "max|effattn-%s|/max|%s| out,dq,dk,dv = %s%s" % (impl, impl, ",".join(f"{d:.2g}" for d in diffs),
                                                                      " MISMATCH" if mismatch else "")
            del o, grads
            with torch.no_grad():
                ms = env.bench(lambda: fn(q, k, v))
            rec.add(impl=impl, mode="fwd", status="ok", ms=ms, tflops=flops_fwd / (ms * 1e-3) / 1e12,
                    first_call_s=round(first, 2), metric=vs, **fields)

            def step():
                for t in leaves:
                    t.grad = None
                fn(*leaves).backward(go)
            ms = env.bench(step)
            rec.add(impl=impl, mode="fwd+bwd", status="ok", ms=ms, tflops=3.5 * flops_fwd / (ms * 1e-3) / 1e12,
                    **fields)
        except Exception as e:  # noqa: BLE001
            rec.add(impl=impl, **error_row(e), **fields)
        _free()


def section_perf(rec, env, rows, title):
    log(f"\n## 2. timing, {title} (bf16; ms = median of do_bench)\n")
    for row in rows:
        run_case(rec, "perf", row[0], lambda row=row: perf_one(rec, env, row), impl="*")


# =================================================================================== 3. memory

def memory_one(rec, env, name, L, kw, impl):
    dev = env.dev
    B, H, D = 1, 16 if not env.smoke else 2, 128 if not env.smoke else 16
    q, k, v, go = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if impl == "effattn-triton":
        fn = lambda *a: effattn.attention(*a, backend="triton", **kw)  # noqa: E731
    elif dev.type != "cuda":
        raise Skip("SDPA flash needs CUDA")
    else:
        fn = sdpa_fn("flash", True)
    out = fn(*leaves)                                   # warm-up: compile, autotune
    torch.autograd.grad(out, leaves, go)
    del out
    peak = float("nan")
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*leaves)
        held = [out, torch.autograd.grad(out, leaves, go)]     # alive until the peak is read
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        held.clear()
    inputs = 4 * B * H * L * D * 2 / 2**20
    rec.add(section="memory", case=name, impl=impl, mode="fwd+bwd", dtype="bfloat16", B=B, H=H, Lq=L, Lk=L, D=D,
            status="ok", peak_mib=peak, metric=f"beyond q,k,v,dout ({inputs:.0f} MiB); includes out+lse+grads")


def section_memory(rec, env):
    log("\n## 3. peak memory, fwd+bwd, L=64k\n")
    L = env.L(65536) if env.smoke else 65536
    cases = [("causal L64k", dict(causal=True), "effattn-triton"),
             ("causal L64k", dict(causal=True), "sdpa-flash"),
             ("window1024 causal L64k", dict(causal=True, window=(1024, 0)), "effattn-triton"),
             ("fixed bs128 causal L64k", dict(causal=True, layout=sliding_and_summary(L, 16 if env.smoke else 128, 4, 16)
                                              .to(env.dev)), "effattn-triton")]
    for name, kw, impl in cases:
        run_case(rec, "memory", name, lambda name=name, kw=kw, impl=impl: memory_one(rec, env, name, L, kw, impl),
                 impl=impl)


# ===================================================================================== dry run

def dry_run(full, use_flex):
    """The plan, from shapes alone: no GPU, no kernels (tensors on the meta device)."""
    env = Env(smoke=False)
    log("plan (dry run): cases in order; FLOPs count visible pairs exactly\n")
    n = 0
    for name, cfg in check_cases(env).items():
        B, H, Hkv, Lq, Lk, D, Dv = (cfg[k] for k in ("B", "H", "Hkv", "Lq", "Lk", "D", "Dv"))
        q = torch.empty(B, H, Lq, D, device="meta", dtype=cfg["dtype"])
        gib = 2 * q.element_size() * (B * H * Lq * (D + Dv) + 2 * B * Hkv * Lk * (D + Dv)) / 2**30
        lay = cfg["layout"](Lq) if cfg["layout"] else None
        pairs = visible_pairs(Lq, Lk, causal=cfg["causal"], left=cfg["left"], right=cfg["right"], layout=lay, heads=H)
        log(f"check  {name:44s} B={B} H={H}/{Hkv} Lq={Lq} Lk={Lk} D={D}/{Dv} {str(cfg['dtype'])[6:]:8s} "
            f"tensors+grads {gib:6.2f} GiB, visible {pairs / (H * Lq * Lk):.3f}")
        n += 1
    for extra in ("bitwise-deterministic bwd", "int64 offsets (k,v views of a 4 GiB tensor; ~24 GiB in all)",
                  "CUDA graph capture/replay", "torch.compile(fullgraph) vs eager",
                  "(after perf and memory) untuned kind met during CUDA-graph capture"):
        log(f"check  {extra}")
        n += 1
    core, rest = perf_rows(env, full, use_flex)
    for name, B, H, D, L, causal, left, make_layout, impls in core + rest:
        lay = make_layout(L) if make_layout else None
        pairs = visible_pairs(L, L, causal=causal, left=left, layout=lay, heads=H)
        gf = 4 * B * D * pairs / 1e9
        log(f"perf   {name:44s} B={B:2d} H={H:2d} D={D:3d} L={L:6d} fwd {gf:9.1f} GFLOP "
            f"(visible {pairs / (H * L * L):.3f})  {', '.join(impls)}")
        n += 1
    log("memory causal / window1024 / fixed at L=64k (effattn) and SDPA flash causal")
    log(f"\n{n + 4} cases; budget --budget-s {ARGS.budget_s:.0f} s")


# ======================================================================================== main

def meta_info(env):
    import triton
    info = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(),
                python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                argv=" ".join(sys.argv[1:]), smoke=env.smoke,
                autotune=os.environ.get("EFFATTN_TRITON_AUTOTUNE", "1"))
    if env.dev.type == "cuda":
        p = torch.cuda.get_device_properties(env.dev)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
    else:
        info.update(device="cpu (smoke run, Triton interpreter)")
    return info


def main():
    args = ARGS
    use_flex = not args.no_flex
    if args.dry_run:
        dry_run(args.full, use_flex)
        return 0
    env = Env(args.smoke)
    if not args.smoke and not torch.cuda.is_available():
        log("no CUDA device: use --dry-run or --smoke")
        return 2
    out_dir = args.out or os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results",
                                                                "gpu-check-smoke" if args.smoke else "gpu-check")
    rec = Recorder(out_dir, meta_info(env), args.budget_s)
    log(" | ".join(f"{k}={v}" for k, v in rec.meta.items()))
    try:
        log(str(effattn.explain(*(torch.randn(1, 2, 64, 64, device=env.dev, dtype=torch.bfloat16) for _ in range(3)),
                                causal=True)))
    except Exception as e:  # noqa: BLE001
        log(f"(explain failed: {e})")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    try:
        if "check" in sections:
            section_check(rec, env)
        core, rest = perf_rows(env, args.full, use_flex)
        if "perf" in sections:
            section_perf(rec, env, core, "ANCHORS core rows and long sequences")
        if "memory" in sections:
            section_memory(rec, env)
        if "perf" in sections and rest:
            section_perf(rec, env, rest, "the rest of ANCHORS.md")
        if "check" in sections:
            run_case(rec, "check", "untuned kind met during CUDA-graph capture",
                     lambda: check_untuned_in_capture(rec, env))
    finally:
        rec.meta["total_s"] = round(rec.elapsed(), 1)
        rec.write()
        log(summary(rec.rows))
        log(f"\nresults in {out_dir}; total {rec.elapsed():.0f} s")
    failed = any(r["section"] == "check" and str(r["status"]).startswith(("FAIL", "ERROR", "OOM")) for r in rec.rows)
    failed = failed or any("MISMATCH" in str(r["metric"]) for r in rec.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
