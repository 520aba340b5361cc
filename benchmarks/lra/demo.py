"""The CPU demo: short ListOps (16 < tokens < 128, LRA's generator otherwise unchanged), the
published small model, dense softmax and linear elu+1 attention, a few minutes each.

    python -m benchmarks.lra demo --out benchmarks/results/cpu/lra-demo

Each variant trains at most ``minutes`` (evaluation and test included) on 20K trees, is scored on
1K dev trees every 100 steps, and tested on 2K test trees with its best dev checkpoint; the
checkpoints are deleted afterwards, the results kept. Each variant trains in a fresh process, so
the peak memory reported (the process's peak RSS) is its own. The majority
class of ListOps scores about 17%; a model that learned nothing ends there.
"""
from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from .report import plots, runs_markdown, write_rows
from .tasks import load_task
from .train import TrainConfig, train

VARIANTS = ("softmax", "linear")
DATA = {"sizes": [20000, 1000, 2000]}
SETTINGS = dict(task="listops", preset="short", steps=400, batch_size=32, warmup=40, lr=3e-3, dropout=0.0,
                eval_every=100, log_every=50, overrides=DATA)


def run_demo(out: Path, minutes: float = 4.0, cache_dir: Optional[str] = None,
             threads: Optional[int] = 1) -> List[Dict]:
    t0 = time.perf_counter()
    load_task("listops", preset="short", cache_dir=cache_dir, workers=2, overrides=DATA)    # fills the cache
    data_minutes = (time.perf_counter() - t0) / 60
    rows = []
    for variant in VARIANTS:
        cfg = TrainConfig(variant=variant, out=str(Path(out) / variant), max_minutes=minutes, cache_dir=cache_dir,
                          threads=threads, **SETTINGS)
        # each variant in a fresh process, so its peak memory is its own
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(train, cfg).result())
    total = (time.perf_counter() - t0) / 60
    for r in rows:
        r["demo_minutes"], r["demo_data_minutes"] = total, data_minutes
    md = ["# Long Range Arena CPU demo: short ListOps", "",
          "`python -m benchmarks.lra demo`: ListOps trees of 16-128 tokens (LRA's generator), the published small "
          "model (2 layers, d=64, 2 heads, mean pooling), "
          f"{SETTINGS['steps']} steps of batch {SETTINGS['batch_size']} at most, at most {minutes:g} minutes a "
          "variant; test accuracy on the best dev checkpoint. Majority class: about 17%.", "",
          runs_markdown(rows), f"Whole demo: {total:.1f} minutes, of which {data_minutes:.1f} making or reading the data "
          "(the set is generated once, then read from the cache).", ""]
    write_rows(rows, Path(out), "\n".join(md))
    plots(rows, Path(out))
    for variant in VARIANTS:            # the checkpoints are of no use once the demo is scored
        for ck in (Path(out) / variant).glob("*.pt"):
            ck.unlink()
    print("\n".join(md))
    return rows
