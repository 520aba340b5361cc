"""What a benchmark suite (``python -m benchmarks.run --suite gpu``) adds to the ordinary sweep.

The sections of benchmarks/suites.py run through run.sweep with the registry's variants and
implementations; this module adds:

- per-section time budgets (``--budget name=seconds``; ``--time-limit`` minutes for the whole suite):
  a section stops starting new lengths when its budget is spent; what it did not start is recorded
  as ``skipped: section budget``;
- the ``max_diff`` column: the largest difference of each baseline's output and gradients from
  effattn's on the same inputs (relative to the baseline's largest value; ``out,dq,dk,dv``), a check
  of effattn's autotuned configs, which the tests (pinned configs) do not run; ``MISMATCH`` past
  bf16 rounding;
- the ``decode`` section (one query row against a KV cache, timed beside the memory-bound time) and
  the ``checks`` rows: CUDA-graph replay and torch.compile equal eager with tuned configs;
- ``--dry-run`` prints the plan (suites.plan: shapes, visible pairs, FLOPs, estimated time per
  section) on any machine; ``--smoke`` runs every section at toy sizes on this machine.

Results go to ``--out``, else ``$OUT``, else ``benchmarks/results/<device>-suite-<name>/``
(results.csv / .json / .md, rewritten after every case), and a short table is printed last. The
exit status is 1 when a check failed, a baseline mismatched or effattn raised.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from . import measure, registry, report, run, suites
from .flops import attention_flops, tflops
from .registry import Case, Variant

MISMATCH_OUT, MISMATCH_GRAD = 0.03, 0.08          # bf16 rounds ~0.4% per operation
CHECKS_BUDGET_S = 60.0                            # the capture / compile checks after the sections (CUDA)


# ------------------------------------------------------------------------------ checks (tests use them too)

class tf32:
    """Context: torch's fp32 matmul precision set to TF32 (``on``) or IEEE, whichever API exists."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.attr = "fp32_precision" if hasattr(m, "fp32_precision") else "allow_tf32"
        self.prev = getattr(m, self.attr)
        setattr(m, self.attr, ("tf32" if self.on else "ieee") if self.attr == "fp32_precision" else self.on)

    def __exit__(self, *exc):
        setattr(torch.backends.cuda.matmul, self.attr, self.prev)


def graph_replay_matches_eager(step) -> List[bool]:
    """``step()`` -> tuple of tensors, eagerly, then captured in a CUDA graph (after a warm-up on a
    side stream, as torch asks) and replayed: bitwise equality per tensor."""
    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return [torch.equal(a, b) for a, b in zip(eager, captured)]


def compile_matches_eager(f, inputs, backend: str = "inductor"):
    """``torch.compile(f, fullgraph=True)`` against eager, forward and the gradients of a squared
    sum: (bitwise equal per tensor, largest absolute difference)."""
    got = torch.compile(f, fullgraph=True, backend=backend)(*inputs)
    got = (got,) + torch.autograd.grad(got.float().square().sum(), inputs)
    ref = f(*inputs)
    ref = (ref,) + torch.autograd.grad(ref.float().square().sum(), inputs)
    same = [torch.equal(a, b) for a, b in zip(got, ref)]
    return same, max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))


# ------------------------------------------------------------------------------ the max_diff column

def _outputs(bench: registry.Bench, dout: torch.Tensor):
    measure.reset_grads(bench.leaves)
    out = bench.fn()
    return [out.detach()] + list(torch.autograd.grad(out, list(bench.leaves), dout))


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; b in (B, T, H, D) (fla's layout) is compared transposed."""
    if a.shape != b.shape and a.shape == b.transpose(1, 2).shape:
        b = b.transpose(1, 2)
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def output_diffs(case: Case, impls: Sequence[registry.Impl]) -> Dict[str, dict]:
    """run.sweep's ``on_case``: {baseline name: {"max_diff": "out,dq,dk,dv[ MISMATCH]"}} against the
    first effattn implementation that serves the case (nothing when none does)."""
    ours = None
    for impl in impls:
        if impl.kind == "effattn" and ours is None:
            try:
                ours = _outputs(impl.build(case), case.dout)
            except Exception:                             # noqa: BLE001 - its row says why
                ours = None
    if ours is None:
        return {}
    res = {}
    for impl in impls:
        if impl.kind != "baseline":
            continue
        try:
            theirs = _outputs(impl.build(case), case.dout)
        except Exception:                                 # noqa: BLE001 - its row says why
            continue
        d = [_rel_diff(a, b) for a, b in zip(ours, theirs)]
        bad = d[0] > MISMATCH_OUT or max(d[1:]) > MISMATCH_GRAD
        res[impl.name] = {"max_diff": ",".join(f"{x:.2g}" for x in d) + (" MISMATCH" if bad else "")}
    measure.free_memory(case.device)
    return res


# ------------------------------------------------------------------------------ running a suite

def _budgets(a, sections) -> Dict[str, float]:
    budgets = {s.name: s.budget_s for s in sections}
    budgets["checks"] = CHECKS_BUDGET_S
    for item in run._csv_list(a.budget or ""):
        key, _, val = item.partition("=")
        if key not in budgets:
            raise SystemExit(f"--budget: unknown section {key!r} ({', '.join(budgets)})")
        budgets[key] = float(val)
    return budgets


def _sections(a) -> List[suites.Section]:
    if a.suite not in suites.SUITES:
        raise SystemExit(f"--suite: unknown suite {a.suite!r} ({', '.join(suites.SUITES)})")
    secs = list(suites.SUITES[a.suite])
    if a.sections:
        names = run._csv_list(a.sections)
        unknown = set(names) - {s.name for s in secs}
        if unknown:
            raise SystemExit(f"--sections: unknown {sorted(unknown)} ({', '.join(s.name for s in secs)})")
        secs = [s for s in secs if s.name in names]
    return secs


def kernel_backends() -> List[str]:
    """effattn's backends that have a kernel registered, less the float64 reference (torch)."""
    from effattn.backends import base
    names = [b.name for op in base.FEATURES for b in base.backends_for(op) if torch.float64 not in b.caps.dtypes]
    return list(dict.fromkeys(names))


def main(a) -> int:
    if not a.suite:
        raise SystemExit("--dry-run plans a suite: add --suite NAME (" + ", ".join(suites.SUITES) + ")")
    sections = _sections(a)
    budgets = _budgets(a, sections)
    default_backends = a.backends == ",".join(registry.EFFATTN_BACKENDS)
    backends = (["torch"] + kernel_backends() if a.smoke else kernel_backends()) if default_backends \
        else run._csv_list(a.backends)
    if a.dry_run:
        suites.print_plan(a.suite, suites.plan(sections, backends, smoke=a.smoke), budgets)
        return 0
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not a.smoke:
        print("no CUDA device: use --dry-run, or --smoke for toy sizes on this machine", file=sys.stderr)
        return 2
    return _run_suite(a, sections, budgets, backends, device)


def _impls(sec: suites.Section, backends, smoke: bool, notes: dict) -> List[registry.Impl]:
    wanted = [f"effattn-{b}" for b in backends] + list(sec.baselines) + (["naive"] if smoke else [])
    out = []
    for impl in registry.IMPLS:
        if impl.name not in wanted:
            continue
        if smoke and impl.kind == "baseline" and not impl.cpu_default:
            notes[impl.name] = "not run in --smoke (CUDA or a compile)"
            continue
        missing = impl.installed()
        if missing:
            notes[impl.name] = missing
            continue
        out.append(impl)
    return out


def _run_suite(a, sections, budgets, backends, device) -> int:
    if device.type == "cpu":
        torch.set_num_threads(a.threads or 1)          # as the sweep: steadier timings on a shared CPU
    slug = run.device_slug(device)
    out = Path(a.out or os.environ.get("OUT") or run.RESULTS_DIR / f"{slug}-suite-{a.suite}{'-smoke' if a.smoke else ''}")
    out.mkdir(parents=True, exist_ok=True)
    notes: dict = {}
    s0 = suites.settings(suites.smoke_section(sections[0]) if a.smoke else sections[0], device, a.smoke)
    meta = run.metadata(a, s0, notes)
    meta.update(suite=a.suite, budgets=budgets, backends=backends, driver=_driver(device),
                sections={s.name: s.__dict__ for s in (suites.smoke_section(x) if a.smoke else x for x in sections)})
    rows: List[dict] = []
    t0 = time.monotonic()
    end = t0 + 60 * a.time_limit if a.time_limit else float("inf")     # --time-limit: the whole suite

    def save(more=()):
        report.write_all(rows + list(more), meta, out)

    for sec in sections:
        sec = suites.smoke_section(sec) if a.smoke else sec
        deadline = min(time.monotonic() + budgets[sec.name], end)
        print(f"\n== {sec.name} (budget {budgets[sec.name]:.0f} s, {time.monotonic() - t0:.0f} s so far)",
              file=sys.stderr)
        if sec.variants == ("decode",):
            new = decode_rows(sec, backends, device, deadline)
        else:
            s = suites.settings(sec, device, a.smoke)
            variants = [registry.variant(n) for n in sec.variants]
            impls = _impls(sec, backends, a.smoke, notes)
            new = run.sweep(variants, impls, s, deadline=deadline, on_case=output_diffs,
                            on_rows=lambda part, name=sec.name: save([{**r, "section": name} for r in part]))
            new += _not_started(variants, impls, s, new)
        for r in new:
            r["section"] = sec.name
        rows += new
        save()
    if device.type == "cuda":
        rows += check_rows(backends, device, min(time.monotonic() + budgets["checks"], end))
    meta["total_s"] = round(time.monotonic() - t0, 1)
    save()
    print(report.summary_text(rows, meta))
    if not a.no_plots:
        try:
            from . import plots
            plots.make_plots(rows, meta, out)
        except Exception as e:                           # noqa: BLE001 - plots must not lose results
            print(f"plots failed: {measure.one_line(e)}", file=sys.stderr)
    print(short_table(rows))
    print(f"\nresults in {out}; {meta['total_s']:.0f} s")
    bad = [r for r in rows if r["status"].startswith(("error", "FAIL")) or "MISMATCH" in str(r.get("max_diff"))]
    return 1 if bad else 0


def _driver(device) -> str:
    """The NVIDIA driver version (nvidia-smi), for the results' header."""
    if device.type != "cuda":
        return "-"
    import subprocess
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return res.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"


def _not_started(variants: Sequence[Variant], impls, s: run.Settings, done: List[dict]) -> List[dict]:
    """Rows ``skipped: section budget`` for the (variant, L) the budget left out."""
    seen = {(r["variant"], r["L"]) for r in done}
    return [{**run.base_row(v, i, m, s, L), "status": "skipped: section budget"}
            for v in variants for L in s.lengths_for(v) if (v.name, L) not in seen
            for i in impls if i.op == v.op for m in s.modes]


# ------------------------------------------------------------------------------ decode and checks

def decode_rows(sec: suites.Section, backends, device, deadline: float) -> List[dict]:
    """One query row (causal) against Lk keys, H=32 query heads on Hkv=8 KV heads: time per effattn
    backend, next to the memory-bound time = bytes of K and V / measured copy bandwidth (in the
    ``max_diff`` column: ``bound <ms>``)."""
    from types import SimpleNamespace
    Lk, H, Hkv, D = sec.lengths[0], sec.heads, max(1, sec.heads // 4), sec.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    buf = torch.empty(1 << (28 if device.type == "cuda" else 22), dtype=torch.uint8, device=device)
    copy = torch.empty_like(buf)
    ms_copy = measure.time_ms(lambda: copy.copy_(buf), device, budget_s=0.2)
    bandwidth = 2 * buf.numel() / (ms_copy * 1e-3)                 # bytes read + written per second
    buf = copy = None                                             # free before the KV tensors
    rows = []
    for B in (1, 4):
        kv_bytes = 2 * B * Hkv * Lk * D * torch.finfo(dtype).bits // 8
        q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
        k, v = (torch.randn(B, Hkv, Lk, D, device=device, dtype=dtype) for _ in range(2))
        for b in backends:
            row = dict(variant="decode", op="attention", impl=f"effattn-{b}", kind="effattn", mode="fwd",
                       dtype=str(dtype).replace("torch.", ""), B=B, H=H, L=Lk, D=D, time_ms=None, tflops=None,
                       peak_mem_mib=None, flops=attention_flops(B, H, D, 1, Lk, causal=True), visible_frac=None,
                       max_diff=f"bound {kv_bytes / bandwidth * 1e3:.4f}")
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            try:                                  # the registry's builder: explain() says what cannot run
                call = SimpleNamespace(q=q, k=k, v=v, device=device, attention_kwargs=lambda: dict(causal=True))
                fn = registry._effattn(b, "attention")(call).fn
                with torch.no_grad():
                    fn()
                    ms = measure.time_ms(fn, device, budget_s=0.2)
                rows.append({**row, "status": "ok", "time_ms": ms, "tflops": tflops(row["flops"], ms)})
            except registry.Unsupported as e:
                rows.append({**row, "status": f"unsupported: {e}"})
            except Exception as e:                                 # noqa: BLE001 - recorded
                rows.append({**row, "status": f"error: {measure.one_line(e)}"})
    return rows


def check_rows(backends, device, deadline: float) -> List[dict]:
    """CUDA-graph replay and torch.compile against eager, with the configs the suite tuned (a
    check not started by ``deadline`` is recorded as skipped)."""
    import effattn
    rows = []
    for b in backends:
        q, k, v, go = (torch.randn(1, 16, 4096, 128, device=device, dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            out = effattn.attention(*leaves, causal=True, backend=b)
            return (out,) + torch.autograd.grad(out, leaves, go)

        def f(q, k, v):
            return effattn.attention(q, k, v, causal=True, backend=b)

        for name, check in (("graph replay == eager", lambda: (graph_replay_matches_eager(step), 0.0)),
                            ("torch.compile == eager", lambda: compile_matches_eager(f, leaves))):
            row = dict(section="checks", variant=name, op="attention", impl=f"effattn-{b}", kind="effattn",
                       mode="fwdbwd", dtype="bfloat16", B=1, H=16, L=4096, D=128)
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            try:
                same, diff = check()
                ok = all(same) if name.startswith("graph") else diff < 1e-2
                rows.append({**row, "status": "ok" if ok else "FAIL", "max_diff": f"bitwise {same} |diff| {diff:.2g}"})
            except Exception as e:                                 # noqa: BLE001 - recorded
                rows.append({**row, "status": f"error: {measure.one_line(e)}"})
    return rows


def short_table(rows: List[dict]) -> str:
    """The last thing printed: per timed effattn row, its TFLOP/s and its time over each baseline's."""
    lines = ["", "SUMMARY (effattn ms / baseline ms; < 1: effattn faster)",
             f"{'section':13s} {'variant':16s} {'mode':6s} {'B':>3s} {'L':>6s} {'D':>4s} {'effattn':>16s} "
             f"{'ms':>9s} {'TFLOP/s':>8s}  ratios"]
    ok = [r for r in rows if r["status"] == "ok" and r.get("time_ms") is not None]
    for r in ok:
        if r["kind"] != "effattn":
            continue
        same = [b for b in ok if b["kind"] == "baseline" and all(b.get(k) == r.get(k) for k in
                                                                   ("section", "variant", "mode", "B", "L", "D"))]
        ratios = ", ".join(f"{b['impl']} {r['time_ms'] / b['time_ms']:.2f}" for b in same)
        if r["variant"] == "decode":
            ratios = f"{r['max_diff']} ms: {r['time_ms'] / float(r['max_diff'].split()[1]):.2f}x the bound"
        lines.append(f"{r['section']:13s} {r['variant']:16s} {r['mode']:6s} {r['B']:3d} {r['L']:6d} {r['D']:4d} "
                     f"{r['impl']:>16s} {r['time_ms']:9.3f} {r['tflops'] or 0:8.1f}  {ratios}")
    mem = [r for r in ok if r["section"] == "causal-64k" and r["mode"] == "fwdbwd"]
    for r in mem:
        lines.append(f"peak memory fwd+bwd L={r['L']} {r['impl']}: {report.fmt_mib(r['peak_mem_mib'])}")
    for r in rows:
        if r["status"].startswith(("error", "FAIL")) or "MISMATCH" in str(r.get("max_diff")):
            lines.append(f"PROBLEM {r.get('section')} {r['variant']} {r['impl']} {r['mode']} L={r['L']}: "
                         f"{r['status']} {r.get('max_diff') or ''}")
    return "\n".join(lines)

