"""Command line: ``python -m benchmarks.lra {train,demo,speed,report,generate,variants} ...``.

    python -m benchmarks.lra train --task listops --variant bigbird          # one task x variant
    torchrun --nproc_per_node 2 -m benchmarks.lra train --task image ...     # data parallel
    python -m benchmarks.lra demo [--out DIR]                                # the CPU demo (< 10 min)
    python -m benchmarks.lra speed --lengths 1024 2048 3072 4096             # Table 2 rows
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
    from .train import TrainConfig
    d = TrainConfig()
    p.add_argument("--task", choices=TASKS, default=d.task)
    p.add_argument("--variant", choices=list(VARIANTS), default=d.variant)
    p.add_argument("--config", choices=("small", "lra"), default=d.config,
                   help="model: 'small' (2 layers, d=64, 2 heads, mean pooling) or LRA's own per task")
    p.add_argument("--out", help="run folder (default lra-runs/<task>-<variant>)")
    p.add_argument("--data-dir", help="folder with the official files (see README); without it ListOps and "
                                      "Pathfinder are generated and Text/Retrieval/Image are stand-ins")
    p.add_argument("--preset", choices=("full", "short"), default=d.preset, help="size of generated sets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="generated-set parameter, e.g. --set 'sizes=[2000,200,200]' --set max_length=256")
    for name in ("seed", "steps", "batch_size", "warmup", "eval_every", "eval_batch_size", "block_size", "window",
                 "workers", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "weight_decay", "clip"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-length", type=int, help="truncate sequences (default: the task's)")
    p.add_argument("--max-minutes", type=float, help="stop training in time to evaluate and test within this")
    p.add_argument("--dropout", type=float, help="override the model config's dropout")
    p.add_argument("--backend", default=d.backend, choices=("auto", "torch", "triton", "cuda"))
    p.add_argument("--device", default=d.device)
    p.add_argument("--amp", default=d.amp, choices=("auto", "bf16", "off"))
    p.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    p.add_argument("--cache-dir", help="generated-data cache (default ~/.cache/effattn-lra, or $EFFATTN_LRA_CACHE)")
    p.add_argument("--save-first-grads", help=argparse.SUPPRESS)


def _config(a):
    from .train import TrainConfig
    overrides = {}
    for item in a.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    names = TrainConfig.__dataclass_fields__
    kw = {k: getattr(a, k) for k in names if hasattr(a, k) and k not in ("out", "overrides")}
    kw["out"] = a.out or f"lra-runs/{a.task}-{a.variant}"
    return TrainConfig(**kw, overrides=overrides)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lra", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _train_args(sub.add_parser("train", help="train one task with one attention variant"))
    demo = sub.add_parser("demo", help="short ListOps, softmax and linear elu+1, on the CPU in < 10 minutes")
    demo.add_argument("--out", default="lra-runs/demo")
    demo.add_argument("--minutes", type=float, default=4.0, help="time budget per variant")
    demo.add_argument("--cache-dir")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch CPU threads (default 1: on a shared 2-core machine two threads lose badly "
                           "whenever another process competes)")
    sp = sub.add_parser("speed", help="Table 2: training steps/s and memory per variant and length")
    sp.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    sp.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 3072, 4096])
    sp.add_argument("--batch-size", type=int, default=8)
    sp.add_argument("--config", choices=("small", "lra"), default="small")
    sp.add_argument("--steps", type=int, default=5)
    sp.add_argument("--backend", default="auto")
    sp.add_argument("--device", default="auto")
    sp.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sp.add_argument("--out", default="lra-runs/speed")
    rp = sub.add_parser("report", help="Tables 1 and 2 from every results.json under --runs")
    rp.add_argument("--runs", default="lra-runs")
    rp.add_argument("--out", default="lra-report")
    vp = sub.add_parser("variants", help="the attention variants and the backends that can serve them here")
    vp.add_argument("--device", default="auto")
    gp = sub.add_parser("generate", help="generate (and cache) a task's data")
    gp.add_argument("--task", choices=("listops", "pathfinder", "text", "retrieval"), required=True)
    gp.add_argument("--preset", choices=("full", "short"), default="full")
    gp.add_argument("--seed", type=int, default=0)
    gp.add_argument("--workers", type=int, default=1)
    gp.add_argument("--cache-dir")
    a = ap.parse_args(argv)

    if a.cmd == "train":
        from .train import train
        row = train(_config(a))
        return 0 if row is not None else 1
    if a.cmd == "demo":
        from .demo import run_demo
        run_demo(Path(a.out), minutes=a.minutes, cache_dir=a.cache_dir, threads=a.threads)
        return 0
    if a.cmd == "speed":
        from .report import speed_markdown, write_rows
        from .speed import sweep
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        rows = sweep(a.variants, a.lengths, a.batch_size, config=a.config, steps=a.steps, backend=a.backend,
                     device=a.device)
        note = f"Mean of {a.steps} timed training steps after 2 warm-up steps" + (
            f", {a.threads} CPU thread(s)" if a.threads else "") + "."
        write_rows(rows, Path(a.out), speed_markdown(rows, note))
        print(speed_markdown(rows, note))
        return 0
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
        t0 = time.perf_counter()
        d = load_task(a.task, None, preset=a.preset, seed=a.seed, workers=a.workers, cache_dir=a.cache_dir)
        print(f"{d.label}: {len(d.train)} / {len(d.dev)} / {len(d.test)} examples in {time.perf_counter() - t0:.1f} s"
              f" ({d.source})")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
