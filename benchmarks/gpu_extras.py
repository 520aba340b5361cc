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
- the ``gqa`` (H=32 on Hkv=8 against SDPA with ``enable_gqa``), ``decode`` (one query row against a
  KV cache, timed beside the memory-bound time) and ``host`` (per-call host overhead) sections, and
  the ``checks`` rows: CUDA-graph replay and torch.compile equal eager with tuned configs;
- on CUDA, before the sections, ``precompile`` (benchmarks/precompile.py: every Triton kernel
  variant the suite launches, compiled in a process pool) and ``explore`` (explore.py: autotuning
  with every candidate's timing saved to explore.json), and after them ``recheck`` (the tuned
  configs against the float64 oracle);
- ``--dry-run`` prints the plan (the precompile list, and suites.plan: shapes, visible pairs,
  FLOPs, estimated time per section and in total) on any machine; ``--smoke`` runs every section
  at toy sizes on this machine.

Results go to ``--out``, else ``$OUT``, else ``benchmarks/results/<device>-suite-<name>/``
(results.csv / .json / .md, rewritten after every case), and a short table is printed last. The
exit status is 1 when a check failed, a baseline mismatched or effattn raised.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from . import explore, measure, registry, report, run, suites
from .flops import attention_flops, tflops
from .registry import Case, Variant

MISMATCH_OUT, MISMATCH_GRAD = 0.03, 0.08          # bf16 rounds ~0.4% per operation
# seconds of the parts around the sections (CUDA only): compiles first, autotune timings, the
# tuned configs against the oracle, the capture / compile checks
EXTRA_BUDGETS_S = dict(precompile=150.0, explore=120.0, recheck=90.0, checks=60.0)
HOST_SHAPE = (1, 8, 256, 64)                      # B, H, L, D of the host-overhead rows
_UNTIMED = ("precompile", "explore", "recheck", "checks")   # sections whose rows are no timings


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
    budgets.update(EXTRA_BUDGETS_S)
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
        entries = suites.plan(sections, backends, smoke=a.smoke)
        variants, failed = precompile_plan(entries, backends, a.smoke, not a.no_trials)
        suites.print_plan(a.suite, entries, budgets, variants, failed, processes=min(16, os.cpu_count() or 1)
                          if torch.cuda.is_available() else 16)
        return 0
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not a.smoke:
        print("no CUDA device: use --dry-run, or --smoke for toy sizes on this machine", file=sys.stderr)
        return 2
    return _run_suite(a, sections, budgets, backends, device)


def precompile_plan(entries, backends, smoke: bool, trials: bool = True):
    """(the Triton kernel variants the suite's calls launch, the explore section's trial candidates
    included unless not `trials`, {call: why not planned}); nothing when the Triton backend is not
    run, in a --smoke run (the interpreter compiles nothing) or under TRITON_INTERPRET=1."""
    from effattn.backends.triton.runtime import _INTERPRET
    if "triton" not in backends or smoke or _INTERPRET:
        return [], {}
    from . import precompile
    with explore.trial_candidates(trials):
        return precompile.plan_variants(suites.calls(entries))


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

    def start(name):
        print(f"\n== {name} (budget {budgets[name]:.0f} s, {time.monotonic() - t0:.0f} s so far)", file=sys.stderr)
        return min(time.monotonic() + budgets[name], end)

    entries = suites.plan(sections, backends, smoke=a.smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    calls = suites.calls(entries, dtype)
    tuned_backends = [b for b in backends if _runs_on(b, device)]
    if device.type == "cuda":
        rows += precompile_rows(entries, backends, a.smoke, start("precompile"), out, not a.no_trials)
        save()
    with explore.trial_candidates(not a.no_trials):          # --smoke: two kinds show the path
        rows += explore.explore(explore.distinct_calls(calls)[:2] if a.smoke else calls, tuned_backends, device,
                                start("explore"), out)
    save()
    for sec in sections:
        sec = suites.smoke_section(sec) if a.smoke else sec
        deadline = start(sec.name)
        if sec.variants == ("decode",):
            new = decode_rows(sec, backends, device, deadline)
        elif sec.variants == ("host",):
            new = host_rows(sec, backends, device, deadline)
        elif sec.kv_heads:
            new = gqa_rows(sec, backends, device, deadline, a.smoke)
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
    rows += explore.recheck(calls, tuned_backends, device, start("recheck"))
    save()
    if device.type == "cuda":
        rows += check_rows(backends, device, start("checks"))
    (out / "tuned.json").write_text(json.dumps(explore.tuned_configs(), indent=1))
    meta["total_s"] = round(time.monotonic() - t0, 1)
    save()
    print(report.summary_text(rows, meta))
    if not a.no_plots:
        try:
            from . import plots
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
    """Plans and compiles the suite's Triton kernel variants (benchmarks/precompile.py); writes
    ``precompile.json`` (one row per variant); returns one summary row."""
    from . import precompile
    t0 = time.monotonic()
    variants, failed = precompile_plan(entries, backends, smoke, trials)
    compiled = precompile.compile_all(variants, deadline=deadline,
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


# ------------------------------------------------------------------------------ decode and checks

def _sdpa_gqa(which: str, q, k, v):
    """SDPA pinned to backend `which` (FLASH_ATTENTION, CUDNN_ATTENTION) with ``enable_gqa``, causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn():
        with sdpa_kernel([getattr(SDPBackend, which)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn


def _time_row(row: dict, fn, leaves, dout, mode: str, device) -> dict:
    """`row` with the median time of `fn` (under no_grad) or of `fn` plus its backward, or why not."""
    try:
        if mode == "fwd":
            def step():
                with torch.no_grad():
                    return fn()
        else:
            def step():
                return torch.autograd.grad(fn(), leaves, dout)
        step()                                              # compile / autotune / one-time init
        ms = measure.time_ms(step, device, budget_s=0.2 if device.type == "cuda" else 0.01,
                             min_runs=1 if device.type != "cuda" else 3)
        flops = row["flops"] * (3.5 if mode == "fwdbwd" else 1)
        return {**row, "status": "ok", "time_ms": ms, "tflops": tflops(flops, ms), "flops": flops}
    except registry.Unsupported as e:
        return {**row, "status": f"unsupported: {e}"}
    except Exception as e:                                  # noqa: BLE001 - recorded
        if measure.is_oom(e):
            return {**row, "status": "oom"}
        kind = "unsupported" if row["kind"] == "baseline" else "error"
        return {**row, "status": f"{kind}: {measure.one_line(e)}"}


def _effattn_fn(b: str, q, k, v, **kw):
    """effattn.attention on backend `b` (the registry's builder: Unsupported with explain's reasons)."""
    from types import SimpleNamespace
    case = SimpleNamespace(q=q, k=k, v=v, device=q.device, attention_kwargs=lambda: kw)
    return registry._effattn(b, "attention")(case).fn


def _unsupported(b):
    def fn():
        raise b
    return fn


def gqa_rows(sec: suites.Section, backends, device, deadline: float, smoke: bool) -> List[dict]:
    """Grouped-query causal attention (H query heads on ``sec.kv_heads`` KV heads) per length:
    effattn's backends and SDPA (flash, cuDNN) with ``enable_gqa``, forward and forward+backward."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for L in sec.lengths:
        B, H = sec.shape(L)
        Hkv, D = sec.kv_heads, sec.head_dim
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype).requires_grad_()
        k, v = (torch.randn(B, Hkv, L, D, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(2))
        dout = torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype)
        impls = [(f"effattn-{b}", "effattn", b) for b in backends] + \
                [(n, "baseline", n) for n in sec.baselines if device.type == "cuda" or n == "sdpa-flash"]
        for name, kind, what in impls:
            try:
                fn = _effattn_fn(what, q, k, v, causal=True) if kind == "effattn" else \
                    _sdpa_gqa({"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}[what], q, k, v)
            except registry.Unsupported as e:
                fn = _unsupported(e)
            for mode in sec.modes:
                row = dict(variant=f"causal-gqa{H // Hkv}", op="attention", impl=name, kind=kind, mode=mode,
                           dtype=str(dtype).replace("torch.", ""), B=B, H=H, L=L, D=D, time_ms=None, tflops=None,
                           peak_mem_mib=None, flops=attention_flops(B, H, D, L, L, causal=True),
                           visible_frac=(L + 1) / (2 * L), max_diff=f"Hkv={Hkv}")
                if time.monotonic() > deadline:
                    rows.append({**row, "status": "skipped: section budget"})
                    continue
                rows.append(_time_row(row, fn, (q, k, v), dout, mode, device))
        q = k = v = dout = None
        measure.free_memory(device)
    return rows


def host_rows(sec: suites.Section, backends, device, deadline: float) -> List[dict]:
    """Host overhead per call: a tiny causal call (B, H, L, D = HOST_SHAPE) issued back to back, wall
    time per call over a batch of calls then one synchronize (the GPU is idle most of that time, so
    this is the host's cost of a call), for forward and forward+backward; SDPA flash beside. The
    GPU time of the same call (do_bench) is in ``max_diff``."""
    B, H, L, D = HOST_SHAPE if device.type == "cuda" else (1, 2, sec.lengths[0], sec.head_dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, dout = (torch.randn(B, H, L, D, device=device, dtype=dtype) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    impls = [(f"effattn-{b}", "effattn", b) for b in backends] + [(n, "baseline", n) for n in sec.baselines]
    rows = []
    for name, kind, what in impls:
        for mode in sec.modes:
            row = dict(variant="host-overhead", op="attention", impl=name, kind=kind, mode=mode,
                       dtype=str(dtype).replace("torch.", ""), B=B, H=H, L=L, D=D, time_ms=None, tflops=None,
                       peak_mem_mib=None, flops=None, visible_frac=None, max_diff="")
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            try:
                fn = _effattn_fn(what, *leaves, causal=True) if kind == "effattn" else \
                    _sdpa_gqa("FLASH_ATTENTION", *leaves)
                step = (lambda: fn().detach()) if mode == "fwd" else \
                    (lambda: torch.autograd.grad(fn(), leaves, dout))
                if mode == "fwd":
                    step = _no_grad(step)
                us = per_call_us(step, device, 200 if device.type == "cuda" else 5)
                gpu_ms = measure.time_ms(step, device, budget_s=0.1 if device.type == "cuda" else 0.01)
                rows.append({**row, "status": "ok", "time_ms": us / 1e3, "max_diff": f"device {gpu_ms:.4f} ms"})
            except registry.Unsupported as e:
                rows.append({**row, "status": f"unsupported: {e}"})
            except Exception as e:                          # noqa: BLE001 - recorded
                rows.append({**row, "status": f"error: {measure.one_line(e)}"})
    return rows


def _no_grad(fn):
    def wrapped():
        with torch.no_grad():
            return fn()
    return wrapped


def per_call_us(step, device, calls: int = 200) -> float:
    """Median over 5 rounds of the wall microseconds per call of `calls` back-to-back calls and one
    synchronize (after a warm-up round)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = []
    for i in range(6):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        if i:
            rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(rounds)[2]


def decode_rows(sec: suites.Section, backends, device, deadline: float) -> List[dict]:
    """One query row (causal) against Lk keys, H=32 query heads on Hkv=8 KV heads: time per effattn
    backend, next to the memory-bound time = bytes of K and V / measured copy bandwidth (in the
    ``max_diff`` column: ``bound <ms>``)."""
    Lk, H, D = sec.lengths[0], sec.heads, sec.head_dim
    Hkv = sec.kv_heads or max(1, H // 4)
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
            try:                                  # explain() says what cannot run
                fn = _effattn_fn(b, q, k, v, causal=True)
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

