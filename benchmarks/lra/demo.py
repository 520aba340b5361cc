"""The CPU demo: short ListOps (16 < tokens < 128, LRA's generator otherwise unchanged), the small
model, every attention variant of `variants.VARIANTS`, three seeds each, in under 10 minutes on two
CPU cores.

    python -m benchmarks.lra demo --out benchmarks/results/cpu/lra-demo

Each run (recipe ``demo``: 300 steps of batch 32, lr 3e-3; sparse blocks of 16 tokens, a local
window of 16 keys a side, so that no sparse pattern covers a whole tree) trains on the same 20K trees, is scored
on 1K dev trees every 100 steps and tested on 2K test trees with its best dev checkpoint. Runs go two
at a time (``--jobs``), each in a fresh process with one torch thread, so the peak memory reported
(the process's peak RSS) is its own. ``minutes`` bounds the whole demo: each run gets its share of
what is left after the data is made, and a run that must stop early says so ("stopped early").
The report gives mean +- std over the seeds per variant, the
majority-class and chance rows, and the learning curves; the checkpoints are deleted afterwards.
"""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .recipes import DEMO
from .report import plots, seeds_markdown, write_rows
from .tasks import load_task
from .train import TrainConfig, train
from .variants import VARIANTS

DATA = {"sizes": [20000, 1000, 2000]}
#: blocks of 16 tokens and a window of 16 keys a side: at the default 64 / 128 every sparse pattern
#: covers a whole tree of at most 128 tokens and all of them compute dense softmax attention
BLOCK, WINDOW = 16, 16


def _run(cfg: TrainConfig) -> Dict:
    return train(cfg, quiet=True)


def demo_configs(out: Path, minutes_each: float, cache_dir: Optional[str] = None, threads: int = 1,
                 variants: Sequence[str] = tuple(VARIANTS), seeds: Sequence[int] = (0, 1, 2),
                 data: Dict = DATA) -> List[TrainConfig]:
    """The demo's runs: every variant with every seed, each within ``minutes_each``."""
    return [TrainConfig(recipe="demo", variant=v, seed=seed, out=str(Path(out) / f"{v}-seed{seed}"),
                        block_size=BLOCK, window=WINDOW, max_minutes=minutes_each, cache_dir=cache_dir, threads=threads,
                        overrides=data, log_every=1000)
            for seed in seeds for v in variants]


def run_demo(out: Path, minutes: float = 9.5, cache_dir: Optional[str] = None, threads: int = 1, jobs: int = 2,
             variants: Sequence[str] = tuple(VARIANTS), seeds: Sequence[int] = (0, 1, 2)) -> List[Dict]:
    t0 = time.perf_counter()
    load_task("listops", preset="short", cache_dir=cache_dir, workers=jobs, overrides=DATA)    # fills the cache
    data_minutes = (time.perf_counter() - t0) / 60
    rounds = -(-len(variants) * len(seeds) // jobs)
    # each run's share of the time left, less about 10 s a run of process start-up
    share = max(0.1, (minutes - data_minutes) / rounds - 10 / 60)
    cfgs = demo_configs(out, share, cache_dir, threads, variants, seeds)
    # a fresh process per run (its own peak memory), ``jobs`` at a time
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        rows = list(pool.map(_run, cfgs))
    total = (time.perf_counter() - t0) / 60
    for r in rows:
        r["demo_minutes"], r["demo_data_minutes"] = total, data_minutes
    md = ["# Long Range Arena CPU demo: short ListOps", "",
          f"`python -m benchmarks.lra demo`: ListOps trees of 16-128 tokens (LRA's generator), recipe `demo` "
          f"({DEMO.summary()}), at most {minutes:g} minutes in all ({share:.2f} a run), {jobs} runs at a time "
          f"with {threads} torch thread(s) each; blocks of {BLOCK} tokens, local window {WINDOW} keys a side "
          f"(at 64 / 128 every sparse pattern covers a whole tree); test accuracy on the best dev checkpoint; "
          f"seeds {', '.join(map(str, seeds))} (the "
          "model's initialization, batch order and dropout; the data is the same).", "",
          seeds_markdown(rows),
          f"Whole demo: {total:.1f} minutes wall clock, of which {data_minutes:.1f} making or reading the data.", ""]
    write_rows(rows, Path(out), "\n".join(md))
    plots(rows, Path(out))
    for cfg in cfgs:            # the checkpoints are of no use once the demo is scored
        for ck in Path(cfg.out).glob("*.pt"):
            ck.unlink()
    print("\n".join(md))
    return rows


def cpu_cost(cache_dir: Optional[str] = None, variants: Sequence[str] = tuple(VARIANTS), seeds: int = 3,
             jobs: int = 2, steps: int = 20, data: Dict = DATA, startup: Optional[float] = None) -> Dict:
    """What the demo costs in CPU seconds (process time, one thread), measured piece by piece: the
    start-up of a run's process (importing the harness and effattn, timed in a fresh interpreter),
    building a trainer, a training step (mean of ``steps`` after 3 warm-up steps) and a dev
    evaluation, per variant. A run costs start-up + build + 300 steps + 5 dev-sized evaluations (3
    of dev, the test at twice dev's size); the estimate of the demo's wall clock on ``jobs`` idle
    cores is the sum over variants and seeds divided by ``jobs`` (making the data, 0.7 minutes, comes
    on top). CPU time measured on a loaded machine overstates an idle one's (shared caches and cores)."""
    import numpy as np
    import torch

    from .train import Trainer, batch_of, epoch_order
    torch.set_num_threads(1)
    if startup is None:     # given: the tests skip the fresh interpreter
        code = "import time; t = time.process_time(); import benchmarks.lra.train, effattn; print(time.process_time() - t)"
        startup = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    load_task("listops", preset="short", cache_dir=cache_dir, overrides=data)
    per = {}
    for cfg in demo_configs(Path("lra-runs/demo-cost"), 60.0, cache_dir, 1, variants, (0,), data):
        t = time.process_time()
        tr = Trainer(cfg, quiet=True)
        build = time.process_time() - t
        order, G = epoch_order(0, 0, len(tr.data.train)), tr.cfg.batch_size
        times = []
        for b in range(steps + 3):
            idx = order[np.arange(b * G, (b + 1) * G) % len(order)]       # wraps on a small set (tests)
            x, x2, y = batch_of(tr.data.train, idx, tr.max_length, tr.device)
            t = time.process_time()
            tr.train_step(x, x2, y)
            times.append(time.process_time() - t)
        t = time.process_time()
        tr.evaluate(tr.data.dev)
        ev = time.process_time() - t
        step = sum(times[3:]) / steps
        per[cfg.variant] = {"build": build, "step": step, "dev_eval": ev,
                            "run": startup + build + tr.cfg.steps * step + 5 * ev}
    total = seeds * sum(v["run"] for v in per.values())
    return {"startup": startup, "variants": per, "seeds": seeds, "jobs": jobs, "cpu_seconds": total,
            "idle_minutes_estimate": total / jobs / 60}


def cpu_cost_markdown(res: Dict) -> str:
    lines = ["| variant | train step (CPU s) | dev evaluation (CPU s) | run (CPU s) |", "|---|---|---|---|"]
    for v, d in res["variants"].items():
        lines.append(f"| {v} | {d['step']:.3f} | {d['dev_eval']:.2f} | {d['run']:.0f} |")
    return "\n".join(lines) + (
        f"\n\nStart-up of a run's process: {res['startup']:.1f} CPU s. {res['seeds']} seeds x {len(res['variants'])} "
        f"variants: {res['cpu_seconds'] / 60:.1f} CPU minutes, about {res['idle_minutes_estimate']:.1f} minutes on "
        f"{res['jobs']} idle cores (an estimate from CPU time, not a measured wall clock).\n")
