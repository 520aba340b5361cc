"""Command line: ``python -m benchmarks.lra {tasks,train,demo,speed,budget,baselines,learnability,report,generate,variants}``.

    python -m benchmarks.lra tasks                                           # the six tasks, recipes, commands
    python -m benchmarks.lra train --task listops --recipe lra --variant bigbird   # one task x variant
    torchrun --nproc_per_node 2 -m benchmarks.lra train --task image ...     # data parallel
    python -m benchmarks.lra demo [--out DIR]                                # the CPU demo (< 10 min)
    python -m benchmarks.lra speed --lengths 1024 2048 3072 4096             # Table 2 rows
    python -m benchmarks.lra budget --task pathx                             # hours a recipe takes here
    python -m benchmarks.lra baselines                                       # stand-in shortcut baselines
    python -m benchmarks.lra learnability --task pathfinder --set contour_length=6   # a small CNN vs chance
    python -m benchmarks.lra gpu-plan [--run]                                # the runs planned for a GPU
    python -m benchmarks.lra report --runs lra-runs --out lra-report         # Tables 1 and 2
    python -m benchmarks.lra generate --task pathfinder --workers 16         # fill the data cache
    python -m benchmarks.lra variants                                        # variants x backends
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .tasks import TASKS
from .variants import VARIANTS


def _train_args(p: argparse.ArgumentParser) -> None:
    from .recipes import RECIPE_NAMES, SCHEDULES
    from .train import TrainConfig
    d = TrainConfig()
    p.add_argument("--task", choices=TASKS, default=d.task)
    p.add_argument("--variant", choices=list(VARIANTS), default=d.variant)
    p.add_argument("--recipe", choices=RECIPE_NAMES, default=d.recipe,
                   help="model and schedule: 'lra' (LRA's published Transformer per task), 'small' (2 layers, "
                        "d=64, 2 heads: the efficient-attention papers' re-runs) or 'demo' (short ListOps on a CPU); "
                        "the options below override single settings")
    p.add_argument("--out", help="run folder (default lra-runs/<task>-<variant>)")
    p.add_argument("--data-dir", help="folder with the official files (see README); without it ListOps is generated, "
                                      "Pathfinder and Path-X regenerated, Text/Retrieval/Image stand-ins")
    p.add_argument("--preset", choices=("full", "short"), help="size of generated sets (default: the recipe's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="generated-set parameter, e.g. --set 'sizes=[2000,200,200]' --set max_length=256")
    for name in ("seed", "data_seed", "eval_batch_size", "block_size", "window", "workers", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("steps", "batch_size", "warmup", "eval_every", "buckets"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help="default: the recipe's")
    for name in ("lr", "weight_decay", "clip", "dropout"):
        p.add_argument("--" + name.replace("_", "-"), type=float, help="default: the recipe's")
    p.add_argument("--schedule", choices=SCHEDULES, help="learning-rate schedule (default: the recipe's)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-length", type=int, help="truncate sequences (default: the task's)")
    p.add_argument("--max-minutes", type=float, help="stop training in time to evaluate and test within this")
    p.add_argument("--backend", default=d.backend, choices=("auto", "torch", "triton", "cuda"))
    p.add_argument("--device", default=d.device)
    p.add_argument("--amp", default=d.amp, choices=("auto", "bf16", "off"))
    p.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint (refused when "
                                                         "its settings differ)")
    p.add_argument("--cache-dir", help="generated-data cache (default ~/.cache/effattn-lra, or $EFFATTN_LRA_CACHE)")
    p.add_argument("--save-first-grads", help=argparse.SUPPRESS)
    p.add_argument("--kill-at-step", type=int, help=argparse.SUPPRESS)


def _sets(items) -> dict:
    """``--set KEY=JSON`` options as a dict of generator parameters."""
    overrides = {}
    for item in items:
        key, eq, value = item.partition("=")
        try:
            if not eq:
                raise ValueError
            overrides[key] = json.loads(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: expected KEY=JSON, e.g. --set 'sizes=[2000,200,200]'") from None
    return overrides


def _config(a):
    from .train import TrainConfig, resolve
    overrides = _sets(a.set)
    names = TrainConfig.__dataclass_fields__
    kw = {k: getattr(a, k) for k in names if hasattr(a, k) and k not in ("out", "overrides")}
    kw["out"] = a.out or f"lra-runs/{a.task}-{a.variant}"
    return resolve(TrainConfig(**kw, overrides=overrides))


def tasks_markdown() -> str:
    """The six tasks: length, classes, what data runs without --data-dir, the recipes, the command."""
    from .recipes import LRA, SMALL
    from .tasks import DEFAULT_KIND, LAYOUTS, MAX_LENGTH, NUM_CLASSES
    lines = ["| task | tokens | classes | data without --data-dir | with --data-dir | recipe lra | recipe small | "
             "command |", "|---" * 8 + "|"]
    for t in TASKS:
        kind = DEFAULT_KIND[t] + ("" if DEFAULT_KIND[t] == "generated" else "*")
        lines.append(f"| {t} | {MAX_LENGTH[t]}{' x 2' if t == 'retrieval' else ''} | {NUM_CLASSES[t]} | {kind} | "
                     f"real: {LAYOUTS[t]} | {LRA[t].summary()} | {SMALL[t].summary()} | "
                     f"`python -m benchmarks.lra train --task {t} --recipe lra --variant softmax` |")
    return "\n".join(lines) + "\n\n* marks data that is not LRA's: a stand-in, or a regeneration not yet validated.\n"


def build_parser() -> argparse.ArgumentParser:
    from .recipes import RECIPE_NAMES
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lra", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _train_args(sub.add_parser("train", help="train one task with one attention variant"))
    sub.add_parser("tasks", help="the six tasks: data source, recipes and the command for each")
    demo = sub.add_parser("demo", help="short ListOps, every variant, 3 seeds, on 2 CPU cores in < 10 minutes")
    demo.add_argument("--out", default="lra-runs/demo")
    demo.add_argument("--minutes", type=float, default=9.5, help="time budget of the whole demo")
    demo.add_argument("--cache-dir")
    demo.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    demo.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    demo.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    demo.add_argument("--cpu-cost", action="store_true",
                      help="measure the CPU seconds of the demo's pieces per variant and estimate its idle wall clock "
                           "(runs no demo)")
    sp = sub.add_parser("speed", help="Table 2: training steps/s and memory per variant and length")
    sp.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    sp.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 3072, 4096])
    sp.add_argument("--batch-size", type=int, default=8)
    sp.add_argument("--task", choices=TASKS, default="text", help="whose model to time (LRA: text; pathx at 16K)")
    sp.add_argument("--recipe", choices=[r for r in RECIPE_NAMES if r != "demo"], default="small")
    sp.add_argument("--steps", type=int, default=5)
    sp.add_argument("--backend", default="auto")
    sp.add_argument("--device", default="auto")
    sp.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sp.add_argument("--out", default="lra-runs/speed")
    bp = sub.add_parser("budget", help="time a task's recipe here and project the whole run's hours")
    bp.add_argument("--task", choices=TASKS, required=True)
    bp.add_argument("--recipe", choices=[r for r in RECIPE_NAMES if r != "demo"], default="lra")
    bp.add_argument("--variant", choices=list(VARIANTS), default="softmax")
    bp.add_argument("--steps", type=int, default=3, help="timed steps")
    bp.add_argument("--device", default="auto")
    bl = sub.add_parser("baselines", help="the stand-ins' and Pathfinder*'s shortcut baselines, measured")
    bl.add_argument("--out", default="lra-runs/baselines")
    bl.add_argument("--cache-dir")
    bl.add_argument("--workers", type=int, default=2)
    bl.add_argument("--skip-learnability", action="store_true", help="skip the Pathfinder* CNN (minutes)")
    lp = sub.add_parser("learnability", help="a small CNN on a generated image task: does it beat chance")
    lp.add_argument("--task", choices=("pathfinder", "image"), default="pathfinder")
    lp.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="generator parameter over the short preset, e.g. --set contour_length=6")
    lp.add_argument("--epochs", type=int, default=12)
    lp.add_argument("--minutes", type=float, default=15.0, help="stop after the epoch that passes this")
    lp.add_argument("--width", type=int, default=32, help="channels of the CNN's first layers")
    lp.add_argument("--batch-norm", action="store_true", help="a BatchNorm after each convolution")
    lp.add_argument("--lr", type=float, default=2e-3)
    lp.add_argument("--seed", type=int, default=0)
    lp.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    lp.add_argument("--workers", type=int, default=2, help="processes generating the data")
    lp.add_argument("--device", default="auto", help="where the CNN trains (auto: a CUDA GPU when there is one)")
    lp.add_argument("--cache-dir")
    lp.add_argument("--out", default="lra-runs/learnability")
    gpu = sub.add_parser("gpu-plan", help="the runs planned for a GPU: full ListOps per variant, Table 2")
    gpu.add_argument("--out", default="lra-runs/gpu")
    gpu.add_argument("--minutes", type=float, default=8.0, help="time budget of each training command")
    gpu.add_argument("--run", action="store_true", help="run the unfinished steps (else only list them)")
    gpu.add_argument("--total-minutes", type=float, help="bound the whole run (steps that do not fit wait for the "
                                                         "next call)")
    rp = sub.add_parser("report", help="Tables 1 and 2 from every results.json under --runs")
    rp.add_argument("--runs", default="lra-runs")
    rp.add_argument("--out", default="lra-report")
    vp = sub.add_parser("variants", help="the attention variants and the backends that can serve them here")
    vp.add_argument("--device", default="auto")
    gp = sub.add_parser("generate", help="generate (and cache) a task's data")
    gp.add_argument("--task", choices=[t for t in TASKS], required=True)
    gp.add_argument("--preset", choices=("full", "short"), default="full")
    gp.add_argument("--seed", type=int, default=0)
    gp.add_argument("--workers", type=int, default=1)
    gp.add_argument("--cache-dir")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return _run(a)
    except ValueError as e:           # a bad argument: one line naming it, no traceback
        print(f"python -m benchmarks.lra {a.cmd}: error: {e}", file=sys.stderr)
        return 2


def _device(name: str) -> str:
    """``--device``: auto is a CUDA GPU when one is visible; cuda without one is an error."""
    import torch

    from .train import check_device
    check_device(name)
    return name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")


def _run(a) -> int:
    if a.cmd == "train":
        from .train import train
        row = train(_config(a))
        return 0 if row is not None else 1
    if a.cmd == "tasks":
        print(tasks_markdown())
        return 0
    if a.cmd == "demo":
        from .demo import cpu_cost, cpu_cost_markdown, run_demo
        _positive(minutes=a.minutes, jobs=a.jobs, threads=a.threads)
        if a.cpu_cost:
            print(cpu_cost_markdown(cpu_cost(a.cache_dir, a.variants, len(a.seeds), a.jobs)))
            return 0
        run_demo(Path(a.out), minutes=a.minutes, cache_dir=a.cache_dir, threads=a.threads, jobs=a.jobs,
                 variants=a.variants, seeds=a.seeds)
        return 0
    if a.cmd == "speed":
        from .report import speed_markdown, write_rows
        from .speed import sweep
        _positive(batch_size=a.batch_size, steps=a.steps, threads=a.threads, lengths=min(a.lengths))
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        rows = sweep(a.variants, a.lengths, a.batch_size, recipe_name=a.recipe, steps=a.steps, backend=a.backend,
                     device=a.device, task=a.task)
        note = f"Mean of {a.steps} timed training steps after 2 warm-up steps" + (
            f", {a.threads} CPU thread(s)" if a.threads else "") + "."
        write_rows(rows, Path(a.out), speed_markdown(rows, note))
        print(speed_markdown(rows, note))
        return 0
    if a.cmd == "budget":
        from .speed import budget
        _positive(steps=a.steps)
        print(budget(a.task, a.recipe, a.variant, steps=a.steps, device=a.device))
        return 0
    if a.cmd == "baselines":
        from .baselines import run_baselines
        run_baselines(Path(a.out), cache_dir=a.cache_dir, workers=a.workers, learnability=not a.skip_learnability)
        return 0
    if a.cmd == "learnability":
        from .baselines import run_learnability
        from .tasks import check_overrides
        _positive(epochs=a.epochs, minutes=a.minutes, width=a.width, lr=a.lr, threads=a.threads, workers=a.workers)
        overrides = _sets(a.set)
        check_overrides(a.task, overrides)
        run_learnability(Path(a.out), a.task, overrides, cache_dir=a.cache_dir, workers=a.workers,
                         threads=a.threads, epochs=a.epochs, minutes=a.minutes, width=a.width, lr=a.lr, seed=a.seed,
                         batch_norm=a.batch_norm, device=_device(a.device))
        return 0
    if a.cmd == "gpu-plan":
        from .gpu import plan, plan_markdown, run_plan
        _positive(minutes=a.minutes, total_minutes=a.total_minutes)
        steps = plan(a.out, a.minutes)
        print(plan_markdown(steps))
        return run_plan(steps, a.total_minutes) if a.run else 0
    if a.cmd == "report":
        from .report import full_report, gather
        rows = gather(Path(a.runs))
        if not rows:
            print(f"report: no results.json under {a.runs}", file=sys.stderr)
            return 1
        for p in full_report(rows, Path(a.out)):
            print(p)
        print((Path(a.out) / "results.md").read_text())
        return 0
    if a.cmd == "variants":
        import torch

        from .variants import variants_markdown
        print(variants_markdown(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")))
        return 0
    if a.cmd == "generate":
        import time

        from .tasks import load_task
        _positive(workers=a.workers)
        t0 = time.perf_counter()
        d = load_task(a.task, None, preset=a.preset, seed=a.seed, workers=a.workers, cache_dir=a.cache_dir,
                      progress=True)
        print(f"{d.label}: {len(d.train)} / {len(d.dev)} / {len(d.test)} examples in {time.perf_counter() - t0:.1f} s"
              f" ({d.source})")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
