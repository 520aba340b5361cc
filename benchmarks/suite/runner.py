"""Runs a suite: its sections in order, each within its time budget, with what a suite adds to a sweep.

The sweep sections of sections.py run through benchmarks.run.sweep with the registry's variants and
implementations; this module adds:

- per-section time budgets (``--budget name=seconds``; ``--time-limit`` minutes for the whole suite):
  a section stops starting new lengths when its budget is spent; what it did not start is recorded
  as ``skipped: section budget``;
- the ``max_diff`` column: the largest difference of each baseline's output and gradients from
  effattn's on the same inputs (relative to the baseline's largest value; ``out,dq,dk,dv``), a check
  of effattn's autotuned configs, which the tests (pinned configs) do not run; ``MISMATCH`` past
  bf16 rounding;
- the sections that are not a sweep (extra_sections.py: ``gqa``, ``decode``, ``paged``, ``host``, ``checks``);
- on CUDA, before the sections, ``precompile`` (kernels.py: every Triton kernel variant the suite
  launches, compiled in a process pool) and ``explore`` (explore.py: autotuning with every
  candidate's timing saved to explore.json), and after them ``recheck`` (the tuned configs against
  the float64 oracle);
- ``--dry-run`` prints the plan (the precompile list, and sections.plan: shapes, visible pairs,
  FLOPs, estimated time per section and in total) on any machine; ``--smoke`` runs every section
  at toy sizes on this machine.

Results go to ``--out``, else ``$OUT``, else ``benchmarks/runs/<device>-suite-<name>/`` (ignored by
git; results.csv / .json / .md, rewritten after every case), and a short table is printed last.
The exit status is 1 when a check failed, a baseline mismatched or effattn raised.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from .. import measure, plots, registry, report, run
from ..registry import Case, Variant
from . import explore, extra_sections, kernels, sections

MISMATCH_OUT, MISMATCH_GRAD = 0.03, 0.08          # bf16 rounds ~0.4% per operation
# seconds of the parts around the sections (CUDA only): compiles first, autotune timings, the
# tuned configs against the oracle, the capture / compile checks
EXTRA_BUDGETS_S = dict(precompile=150.0, explore=120.0, recheck=90.0, checks=60.0)
_UNTIMED = ("precompile", "explore", "recheck", "checks")   # sections whose rows are no timings


# ------------------------------------------------------------------------------ the max_diff column

def _outputs(bench: registry.Bench, dout: torch.Tensor):
    measure.reset_grads(bench.leaves)
    with registry.environment(bench.env):
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

def _budgets(a, chosen) -> Dict[str, float]:
    budgets = {s.name: s.budget_s for s in chosen}
    budgets.update(EXTRA_BUDGETS_S)
    for item in run._csv_list(a.budget or ""):
        key, _, val = item.partition("=")
        if key not in budgets:
            raise SystemExit(f"--budget: unknown section {key!r} ({', '.join(budgets)})")
        budgets[key] = float(val)
    return budgets


def _chosen_sections(a) -> List[sections.Section]:
    if a.suite not in sections.SUITES:
        raise SystemExit(f"--suite: unknown suite {a.suite!r} ({', '.join(sections.SUITES)})")
    secs = list(sections.SUITES[a.suite])
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
    """Runs (or with ``a.dry_run`` plans) the suite the parsed command line `a` names (see __main__.py)."""
    chosen = _chosen_sections(a)
    budgets = _budgets(a, chosen)
    backends = run._csv_list(a.backends) if a.backends else \
        (["torch"] + kernel_backends() if a.smoke else kernel_backends())
    if a.dry_run:
        entries = sections.plan(chosen, backends, smoke=a.smoke)
        variants, failed = sections.precompile_plan(entries, backends, a.smoke, not a.no_trials)
        sections.print_plan(a.suite, entries, budgets, variants, failed, processes=min(16, os.cpu_count() or 1)
                          if torch.cuda.is_available() else 16)
        return 0
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not a.smoke:
        print("no CUDA device: use --dry-run, or --smoke for toy sizes on this machine", file=sys.stderr)
        return 2
    return _run_suite(a, chosen, budgets, backends, device)


def _impls(sec: sections.Section, backends, smoke: bool, notes: dict) -> List[registry.Impl]:
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


def _run_suite(a, chosen, budgets, backends, device) -> int:
    if device.type == "cpu":
        torch.set_num_threads(a.threads or 1)          # as the sweep: steadier timings on a shared CPU
    slug = run.device_slug(device)
    out = Path(a.out or os.environ.get("OUT") or run.RUNS_DIR / f"{slug}-suite-{a.suite}{'-smoke' if a.smoke else ''}")
    out.mkdir(parents=True, exist_ok=True)
    notes: dict = {}
    s0 = sections.settings(sections.smoke_section(chosen[0]) if a.smoke else chosen[0], device, a.smoke)
    meta = run.metadata(a, s0, notes)
    meta.update(suite=a.suite, budgets=budgets, backends=backends, driver=_driver(device),
                sections={s.name: s.__dict__ for s in (sections.smoke_section(x) if a.smoke else x for x in chosen)})
    rows: List[dict] = []
    t0 = time.monotonic()
    end = t0 + 60 * a.time_limit if a.time_limit else float("inf")     # --time-limit: the whole suite

    def save(more=()):
        report.write_all(rows + list(more), meta, out)

    def start(name):
        print(f"\n== {name} (budget {budgets[name]:.0f} s, {time.monotonic() - t0:.0f} s so far)", file=sys.stderr)
        return min(time.monotonic() + budgets[name], end)

    entries = sections.plan(chosen, backends, smoke=a.smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    calls = sections.calls(entries, dtype)
    tuned_backends = [b for b in backends if _runs_on(b, device)]
    if device.type == "cuda":
        rows += precompile_rows(entries, backends, a.smoke, start("precompile"), out, not a.no_trials)
        save()
    with explore.trial_candidates(not a.no_trials):          # --smoke: two kinds show the path
        rows += explore.explore(explore.distinct_calls(calls)[:2] if a.smoke else calls, tuned_backends, device,
                                start("explore"), out)
    save()
    for sec in chosen:
        sec = sections.smoke_section(sec) if a.smoke else sec
        deadline = start(sec.name)
        if sec.variants == ("decode",):
            new = extra_sections.decode_rows(sec, backends, device, deadline)
        elif sec.variants == ("paged",):
            new = extra_sections.paged_rows(sec, backends, device, deadline)
        elif sec.variants == ("host",):
            new = extra_sections.host_rows(sec, backends, device, deadline)
        elif sec.variants == ("packed",):
            new = extra_sections.packed_rows(sec, backends, device, deadline)
        elif sec.kv_heads:
            new = extra_sections.gqa_rows(sec, backends, device, deadline, a.smoke)
        else:
            s = sections.settings(sec, device, a.smoke)
            variants = [registry.variant(n) for n in sec.variants]
            impls = _impls(sec, backends, a.smoke, notes)
            new = run.sweep(variants, impls, s, deadline=deadline, on_case=output_diffs,
                            on_rows=lambda part, name=sec.name: save([{**r, "section": name} for r in part]))
            new += _not_started(variants, impls, s, new)
        for r in new:
            r["section"] = sec.name
        rows += new
        save()
    rows += explore.recheck(calls, tuned_backends, device, start("recheck"))
    save()
    if device.type == "cuda":
        rows += extra_sections.check_rows(backends, device, start("checks"))
    (out / "tuned.json").write_text(json.dumps(explore.tuned_configs(), indent=1))
    meta["total_s"] = round(time.monotonic() - t0, 1)
    save()
    print(report.summary_text(rows, meta))
    if not a.no_plots:
        try:
            plots.make_plots([r for r in rows if r.get("section") not in _UNTIMED       # a section skipped
                              and r["status"] != "skipped: section budget"], meta, out)  # whole: nothing to plot
        except Exception as e:                           # noqa: BLE001 - plots must not lose results
            print(f"plots failed: {measure.one_line(e)}", file=sys.stderr)
    print(short_table(rows))
    print(f"\nresults in {out}; {meta['total_s']:.0f} s")
    bad = [r for r in rows if r["status"].startswith(("error", "FAIL")) or "MISMATCH" in str(r.get("max_diff"))]
    return 1 if bad else 0


def _runs_on(backend: str, device) -> bool:
    """Whether `backend` is timed on `device` (not Triton's interpreter on a CPU)."""
    from effattn.backends import base
    b = base._REGISTRY["attention"].get(backend)
    return b is None or device.type not in b.explicit_only_devices


def precompile_rows(entries, backends, smoke: bool, deadline: float, out: Path, trials: bool) -> List[dict]:
    """Plans and compiles the suite's Triton kernel variants (kernels.py); writes ``precompile.json``
    (one row per variant); returns one summary row."""
    t0 = time.monotonic()
    variants, failed = sections.precompile_plan(entries, backends, smoke, trials)
    compiled = kernels.compile_all(variants, deadline=deadline,
                                      log=lambda m: print(m, file=sys.stderr)) if variants else []
    (out / "precompile.json").write_text(json.dumps(dict(variants=compiled, not_planned={
        str(c): why for c, why in failed.items()}), indent=1))
    ok = sum(r["status"] == "ok" for r in compiled)
    bad = [r for r in compiled if r["status"].startswith("error")]
    return [dict(section="precompile", variant="triton-kernels", op="-", impl="effattn-triton", kind="effattn",
                 mode="-", dtype="-", B=0, H=0, L=0, D=0, time_ms=None, tflops=None, peak_mem_mib=None,
                 flops=None, visible_frac=None,
                 status="ok" if not failed else f"ok; not planned: {len(failed)} calls",
                 max_diff=f"{ok}/{len(variants)} compiled in {time.monotonic() - t0:.0f} s"
                          + (f"; {len(bad)} rejected by the compiler" if bad else ""))]


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
        if r["variant"] in ("decode", "paged"):        # max_diff starts "bound <ms>"
            bound = float(r["max_diff"].split()[1])
            ratios = ", ".join(x for x in (ratios, f"bound {bound:.4f} ms: {r['time_ms'] / bound:.2f}x the bound") if x)
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

