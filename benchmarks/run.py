"""The benchmark runner: ``python -m benchmarks.run [--quick | --full | --curated] [--out DIR] ...``.

Sweeps sequence length for every variant x implementation of registry.py, forward and
forward+backward; records median time, TFLOP/s (flops.py) and peak memory (measure.py) per
configuration, or why there is none (status). Writes CSV, JSON, a markdown summary and plots to
``benchmarks/runs/<device>[-quick|-full]/`` (ignored by git) or ``--out``, and prints the summary.
``--curated`` refreshes the results the README quotes, under ``benchmarks/results/<device>/``.
A configuration that fails never stops the sweep. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import measure, registry
from .flops import attention_flops, linear_attention_flops, tflops, visible_pairs
from .progress import progress_bar
from .registry import Case, Impl, Unsupported, Variant

DEFAULT_THREADS = torch.get_num_threads()    # torch's own count, before --threads changes it
RESULTS_DIR = Path(__file__).resolve().parent / "results"     # curated results (in git), --curated
RUNS_DIR = Path(__file__).resolve().parent / "runs"           # default output, ignored by git
MODES = ("fwd", "fwdbwd")
QUICK_VARIANTS = ("causal", "fixed", "linear-elu")          # one per family
CPU_DEFAULT_VARIANTS = ("dense", "causal", "window", "fixed", "linear-elu")

# defaults per device: (lengths, head dim, dtype, window)
CPU_LENGTHS = (1024, 2048)                  # the default CPU job: a few minutes on 2 cores
CPU_FULL_LENGTHS = (256, 512, 1024, 2048, 4096)
CUDA_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    lengths: Sequence[int]
    modes: Sequence[str] = MODES
    batch: Optional[int] = None          # None: 1 on CPU; 16k tokens / L on CUDA (docs/benchmarks.md)
    heads: Optional[int] = None          # None: 4 on CPU; 2048 / D on CUDA
    window: int = 256
    dense_max_len: Optional[int] = None  # quadratic variants stop here (None: no cap)
    mem_budget_gib: float = 4.0          # skip an L x L materializing impl that would need more
    time_budget_s: float = 0.25
    min_runs: int = 3
    extra: Dict[str, object] = field(default_factory=dict)

    def shape(self, L: int):
        """(B, H) for length L."""
        cuda = self.device.type == "cuda"
        B = self.batch if self.batch is not None else (max(1, 16384 // L) if cuda else 1)
        H = self.heads if self.heads is not None else (max(1, 2048 // self.head_dim) if cuda else 4)
        return B, H

    def lengths_for(self, variant: Variant) -> List[int]:
        if variant.quadratic and self.dense_max_len:
            return [L for L in self.lengths if L <= self.dense_max_len]
        return list(self.lengths)


# ------------------------------------------------------------------------------------ one config

def config_flops(case: Case, mode: str) -> int:
    v = case.variant
    if v.op == "attention":
        return attention_flops(case.B, case.H, case.D, case.L, case.L, mode=mode, **case.mask_kwargs())
    return linear_attention_flops(case.B, case.H, case.D, case.L, num_features=case.num_features,
                                  normalize=v.normalize, favor=v.feature_map == "favor", mode=mode)


def visible_fraction(case: Case) -> Optional[float]:
    if case.variant.op != "attention":
        return None
    pairs = visible_pairs(case.L, case.L, heads=1, **case.mask_kwargs())
    return pairs / (case.L * case.L)


def base_row(variant: Variant, impl: Impl, mode: str, s: Settings, L: int) -> dict:
    B, H = s.shape(L)
    return dict(variant=variant.name, op=variant.op, impl=impl.name, kind=impl.kind, mode=mode,
                dtype=str(s.dtype).replace("torch.", ""), B=B, H=H, L=L, D=s.head_dim, status="",
                time_ms=None, tflops=None, peak_mem_mib=None, flops=None, visible_frac=None)


def _step(bench: registry.Bench, mode: str, dout: torch.Tensor):
    if mode == "fwd":
        def step():
            with torch.no_grad(), registry.environment(bench.env):
                return bench.fn()
    else:
        def step():
            with registry.environment(bench.env):             # the backward too reads it
                bench.fn().backward(dout)
    return step


def _warning_hint(caught) -> str:
    """The most specific warning a failing baseline printed (SDPA says there why it had no kernel)."""
    msgs = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    msgs = [m for m in dict.fromkeys(msgs) if "not used because" not in m] or msgs
    return f" ({msgs[0][:150]})" if msgs else ""


_warmed = set()      # (impl, mode) pairs that have run once in this process (lazy init done)


def run_config(case: Case, impl: Impl, mode: str, s: Settings) -> dict:
    """Measures one configuration; never raises (except KeyboardInterrupt): failures become a status."""
    row = base_row(case.variant, impl, mode, s, case.L)
    row["flops"] = config_flops(case, mode)
    row["visible_frac"] = visible_fraction(case)
    if impl.score_bytes is not None:
        need = impl.score_bytes(case, mode) / 2**30
        if need > s.mem_budget_gib:
            row["status"] = f"skipped: would need {need:.1f} GiB (budget {s.mem_budget_gib:g} GiB)"
            return row
    bench = step = None
    dev = case.device
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            bench = impl.build(case)
            step = _step(bench, mode, case.dout)
            if dev.type == "cuda" or impl.compiled or (impl.name, mode) not in _warmed:
                step()                                         # compile / autotune / one-time init
                measure.reset_grads(bench.leaves)
                _warmed.add((impl.name, mode))
            mem = measure.peak_memory_mib(step, dev)           # on CPU also the warm-up run
            ms = measure.time_ms(step, dev, warmup=0, min_runs=s.min_runs, budget_s=s.time_budget_s,
                                 grad_to_none=bench.leaves)
            row.update(status="ok", time_ms=ms, tflops=tflops(row["flops"], ms), peak_mem_mib=mem)
        except Unsupported as e:
            row["status"] = f"unsupported: {e}"
        except Exception as e:                                 # noqa: BLE001 - recorded, sweep goes on
            if measure.is_oom(e):
                row["status"] = "oom"
            elif impl.kind == "baseline":
                row["status"] = f"unsupported: {measure.one_line(e)}{_warning_hint(caught)}"
            else:
                row["status"] = f"error: {measure.one_line(e)}"
        finally:
            if bench is not None:
                measure.reset_grads(bench.leaves)
            bench = step = None
            measure.free_memory(dev, collect=row["status"] != "ok")
    return row


def make_case(variant: Variant, L: int, s: Settings) -> Case:
    B, H = s.shape(L)
    return Case.make(variant, B, H, L, s.head_dim, s.dtype, s.device, s.window)


def sweep(variants: Sequence[Variant], impls: Sequence[Impl], s: Settings, bar=None,
          on_rows: Optional[Callable[[List[dict]], None]] = None, deadline: Optional[float] = None,
          on_case: Optional[Callable[[Case, List[Impl]], Dict[str, dict]]] = None) -> List[dict]:
    """Runs every (variant, L, impl serving the variant's op, mode); returns one row each.
    ``on_rows(rows)`` is called after each (variant, L) (to save partial results); the sweep stops
    early on Ctrl-C or once ``time.monotonic()`` passes ``deadline`` (the rows so far are returned).
    ``on_case(case, impls)`` -> {impl name: extra columns} runs once per (variant, L) before timing."""
    plan = [(v, L, [i for i in impls if i.op == v.op]) for v in variants for L in s.lengths_for(v)]
    rows: List[dict] = []
    try:
        for v, L, serving in plan:
            if deadline is not None and time.monotonic() > deadline:
                print(f"\ntime limit reached: stopped before {v.name} L={L}", file=sys.stderr)
                break
            if on_rows is not None and rows:
                on_rows(rows)
            try:
                case = make_case(v, L, s)
            except Exception as e:                             # noqa: BLE001 - inputs did not fit
                status = "oom" if measure.is_oom(e) else f"error: building inputs: {measure.one_line(e)}"
                for impl in serving:
                    for mode in s.modes:
                        rows.append({**base_row(v, impl, mode, s, L), "status": status})
                        bar and bar.set_postfix_str(f"{v.name} L={L} {impl.name} {mode}: {status}")
                        bar and bar.update()
                measure.free_memory(s.device)
                continue
            extra = on_case(case, serving) if on_case is not None else {}
            for impl in serving:
                for mode in s.modes:
                    what = f"{v.name} L={L} {impl.name} {mode}"
                    bar and bar.set_postfix_str(what)
                    rows.append({**run_config(case, impl, mode, s), **extra.get(impl.name, {})})
                    bar and bar.set_postfix_str(f"{what}: {_outcome(rows[-1])}")
                    bar and bar.update()
            case = None
            measure.free_memory(s.device)
    except KeyboardInterrupt:
        print("\ninterrupted: writing the rows measured so far", file=sys.stderr)
    return rows


def _outcome(row: dict) -> str:
    """A finished configuration in a few words, for the progress line."""
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    mem = f", {row['peak_mem_mib']:.0f} MiB" if row.get("peak_mem_mib") is not None else ""
    return f"{row['time_ms']:.1f} ms{mem}"


def _row_key(r: dict):
    return r["variant"], r["impl"], r["mode"], r["L"], r["dtype"], r["D"]


def merge_rows_list(old: List[dict], rows: List[dict]) -> List[dict]:
    """The rows of ``old`` that ``rows`` did not redo, followed by ``rows``."""
    redone = {_row_key(r) for r in rows}
    return [r for r in old if _row_key(r) not in redone] + rows


def merge_rows(previous_json: Path, rows: List[dict]) -> List[dict]:
    """`merge_rows_list` with the rows of an earlier run's results.json (if there is one)."""
    if not previous_json.exists():
        return rows
    import json
    return merge_rows_list(json.loads(previous_json.read_text()).get("rows", []), rows)


def count_configs(variants, impls, s: Settings) -> int:
    return sum(len(s.lengths_for(v)) * len([i for i in impls if i.op == v.op]) * len(s.modes) for v in variants)


# ------------------------------------------------------------------------------------ CLI

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine())


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def _csv_list(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variants", default=None,
                   help="comma list or 'all' (known: " + ", ".join(v.name for v in registry.VARIANTS) +
                   "); default: all on CUDA, a smaller set on CPU")
    p.add_argument("--backends", default=",".join(registry.EFFATTN_BACKENDS), help="effattn backends")
    p.add_argument("--baselines", default=None,
                   help="comma list, 'all' or 'none' (known: " + ", ".join(registry.BASELINES) +
                   "); default: all installed on CUDA, naive,sdpa-math,sdpa-flash on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--head-dim", type=int, default=None, help="D; default 128 on CUDA, 64 on CPU (32 with --quick)")
    p.add_argument("--lengths", default=None, help="comma list of sequence lengths")
    p.add_argument("--batch", type=int, default=None, help="B; default 16384 // L on CUDA, 1 on CPU")
    p.add_argument("--heads", type=int, default=None, help="H; default 2048 // D on CUDA, 4 on CPU")
    p.add_argument("--window", type=int, default=None, help="window variant's left reach; default 1024 CUDA, 256 CPU")
    p.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both")
    p.add_argument("--dense-max-len", type=int, default=None,
                   help="longest L for the quadratic variants (dense, causal, strided) when --lengths is "
                        "not given; default 16384 on CUDA, no cap on CPU")
    p.add_argument("--mem-budget-gib", type=float, default=None,
                   help="skip naive / sdpa-math where their L x L tensors would exceed this; default 4 on "
                        "CPU, the GPU's memory on CUDA")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of timed calls per config (CPU; scales do_bench's 100 ms on CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads; default 1 on CPU (other processes then disturb the timings "
                        "least), torch's own on CUDA")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 short lengths, one variant per family")
    p.add_argument("--full", action="store_true",
                   help="CPU: the full sweep (L = 256..4096, every CPU variant; 14 minutes on a shared 2-core VM) "
                        "instead of the default few-minute job (L = 1024, 2048; dense, causal, window, fixed, "
                        "linear-elu). On CUDA the default is already the full sweep")
    p.add_argument("--curated", action="store_true",
                   help="refresh the results the README quotes: --full into benchmarks/results/<device>/ "
                        "(tracked by git), plus on CPU the effattn/SDPA thread table (benchmarks.cpu_vs_sdpa)")
    p.add_argument("--out", default=None,
                   help="output dir; default benchmarks/runs/<device>[-quick|-full]/ (ignored by git)")
    p.add_argument("--append", action="store_true",
                   help="merge into the results already in --out (rows of the same variant, impl, mode, "
                        "L, dtype and D are replaced): split a long sweep over several commands")
    p.add_argument("--time-limit", type=float, default=None,
                   help="minutes: start no new (variant, L) after this; the results so far are written")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def settings_from_args(a: argparse.Namespace):
    """(Settings, variants, impls, notes) from the command line."""
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = a.threads or (1 if device.type == "cpu" else None)
    if threads:                                # CPU default 1: stable timings on a shared machine
        torch.set_num_threads(threads)
    cuda = device.type == "cuda"
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    dtype = DTYPES[a.dtype] if a.dtype else (torch.bfloat16 if cuda else torch.float32)
    D = a.head_dim or (128 if cuda else (32 if a.quick else 64))
    if a.lengths:
        lengths = [int(x) for x in _csv_list(a.lengths)]
    elif a.quick:
        lengths = [1024, 2048] if cuda else [256, 512]
    else:
        lengths = list(CUDA_LENGTHS if cuda else (CPU_FULL_LENGTHS if a.full else CPU_LENGTHS))
    s = Settings(device=device, dtype=dtype, head_dim=D, lengths=lengths, modes=_csv_list(a.modes),
                 batch=a.batch, heads=a.heads if a.heads else (2 if a.quick and not cuda else None),
                 window=a.window or (1024 if cuda else 256),
                 dense_max_len=None if a.lengths else (a.dense_max_len or (16384 if cuda else None)),
                 mem_budget_gib=a.mem_budget_gib or (
                     torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else 4.0),
                 time_budget_s=a.time_budget or ((0.2 if cuda else 0.02) if a.quick else (1.0 if cuda else 0.25)),
                 min_runs=3)
    for m in s.modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (fwd, fwdbwd)")

    if a.variants in (None, ""):
        if a.quick:
            names = list(QUICK_VARIANTS)
        elif cuda or a.full:
            names = [v.name for v in registry.VARIANTS if cuda or v.cpu_default]
        else:
            names = list(CPU_DEFAULT_VARIANTS)
    elif a.variants == "all":
        names = [v.name for v in registry.VARIANTS]
    else:
        names = _csv_list(a.variants)
    try:
        variants = [registry.variant(n) for n in names]
    except KeyError as e:
        raise SystemExit(f"--variants: {e.args[0]}")

    backends = _csv_list(a.backends)
    for b in backends:
        if b not in registry.EFFATTN_BACKENDS:
            raise SystemExit(f"--backends: unknown effattn backend {b!r} ({', '.join(registry.EFFATTN_BACKENDS)})")
    if a.baselines in (None, ""):
        baselines = [n for n in registry.BASELINES if cuda or any(i.cpu_default for i in registry.IMPLS if i.name == n)]
    elif a.baselines == "all":
        baselines = list(registry.BASELINES)
    elif a.baselines == "none":
        baselines = []
    else:
        baselines = _csv_list(a.baselines)
        for b in baselines:
            if b not in registry.BASELINES:
                raise SystemExit(f"--baselines: unknown baseline {b!r} ({', '.join(registry.BASELINES)})")

    notes = {}
    impls = []
    for impl in registry.IMPLS:
        wanted = (impl.kind == "effattn" and impl.name.split("-", 1)[1] in backends) or \
                 (impl.kind == "baseline" and impl.name in baselines)
        if not wanted:
            continue
        missing = impl.installed()
        if missing:
            notes[impl.name] = missing                     # not installed: not swept, said in the report
            continue
        impls.append(impl)
    return s, variants, impls, notes


def metadata(a: argparse.Namespace, s: Settings, notes: dict) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import effattn
    return dict(
        device=device_name(s.device), device_type=s.device.type, device_slug=device_slug(s.device),
        torch=torch.__version__, cuda=torch.version.cuda, triton=triton_version,
        effattn=getattr(effattn, "__version__", None), python=platform.python_version(),
        platform=platform.platform(), cpu_threads=torch.get_num_threads(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args=vars(a), dtype=str(s.dtype).replace("torch.", ""), head_dim=s.head_dim,
        batch="16384 // L" if (s.batch is None and s.device.type == "cuda") else s.shape(s.lengths[0])[0],
        heads=s.shape(s.lengths[0])[1], window=s.window, lengths=list(s.lengths),
        dense_max_len=s.dense_max_len, mem_budget_gib=s.mem_budget_gib,
        memory_method=measure.memory_method(s.device),
        timing="triton.testing.do_bench median" if s.device.type == "cuda" else
               f"time.perf_counter median of >= {s.min_runs} runs ({s.time_budget_s:g} s budget) after warm-up",
        flops="softmax: 4*B*D*visible_pairs fwd, x3.5 fwd+bwd; linear: 4*B*H*L*F*(Dv+normalize) "
              "(+4*B*H*L*D*F FAVOR+ projection) fwd, x3 fwd+bwd (benchmarks/flops.py)",
        not_installed=notes,
        variants={v.name: v.description.replace("--window", str(s.window)) for v in registry.VARIANTS},
    )


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.curated:
        if a.quick:
            raise SystemExit("--curated and --quick exclude each other")
        a.full = True
    s, variants, impls, notes = settings_from_args(a)
    if s.device.type == "cpu":
        measure.enable_cpu_peak_rss()          # before the sweep allocates anything big
    gc.collect()
    gc.freeze()                                # the imports' objects: later gc.collect() calls stay fast
    try:
        return _run(a, s, variants, impls, notes)
    finally:
        gc.unfreeze()                          # let interpreter shutdown see (and free) them again


def _run(a, s: Settings, variants, impls, notes) -> int:
    meta = metadata(a, s, notes)
    if a.out:
        out = Path(a.out)
    elif a.curated:
        out = RESULTS_DIR / meta["device_slug"]
    else:
        out = RUNS_DIR / (meta["device_slug"] + ("-quick" if a.quick else "-full" if a.full else ""))
    out.mkdir(parents=True, exist_ok=True)
    for name, why in notes.items():
        print(f"not swept: {name}: {why}", file=sys.stderr)
    print(f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | {meta['dtype']} | "
          f"D={s.head_dim} | lengths {','.join(map(str, s.lengths))} | -> {out}", file=sys.stderr)

    from . import report
    previous = merge_rows(out / "results.json", []) if a.append else []

    def save(rows):                            # after every (variant, L): a killed run keeps its rows
        report.write_all(merge_rows_list(previous, rows), meta, out)

    bar = progress_bar(count_configs(variants, impls, s), disable=a.no_progress)
    deadline = time.monotonic() + 60 * a.time_limit if a.time_limit else None
    try:
        rows = sweep(variants, impls, s, bar, on_rows=save, deadline=deadline)
    finally:
        bar.close()

    rows = merge_rows_list(previous, rows)
    paths = report.write_all(rows, meta, out)
    print(report.summary_text(rows, meta))
    if not a.no_plots:
        try:
            from . import plots
            paths += plots.make_plots(rows, meta, out)
        except Exception as e:                 # noqa: BLE001 - a plotting problem must not lose the results
            print(f"plots failed: {measure.one_line(e)}", file=sys.stderr)
    if a.curated:
        (out / "headline.md").write_text(report.headline_markdown(rows, meta))
        paths.append(out / "headline.md")
    if a.curated and s.device.type == "cpu":
        from . import cpu_vs_sdpa
        cpu_vs_sdpa.main(["--lengths", "2048", "4096", "--default-threads", str(DEFAULT_THREADS),
                          "--out", str(out / "cpu_vs_sdpa.md")])
        paths.append(out / "cpu_vs_sdpa.md")
    print(f"\nwrote {len(paths)} files to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
