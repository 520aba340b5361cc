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
                 variants: Sequence[str] = tuple(VARIANTS), seeds: Sequence[int] = (0, 1, 2)) -> List[TrainConfig]:
    """The demo's runs: every variant with every seed, each within ``minutes_each``."""
    return [TrainConfig(recipe="demo", variant=v, seed=seed, out=str(Path(out) / f"{v}-seed{seed}"),
                        block_size=BLOCK, window=WINDOW, max_minutes=minutes_each, cache_dir=cache_dir, threads=threads,
                        overrides=DATA, log_every=1000)
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
