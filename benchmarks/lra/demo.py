"""The CPU demo: short ListOps (16 < tokens < 128, LRA's generator otherwise unchanged), the small
model, every attention variant of `variants.VARIANTS`, three seeds each, in under 10 minutes on two
CPU cores.

    python -m benchmarks.lra demo --out benchmarks/results/cpu/lra-demo

Each run (recipe ``demo``: 300 steps of batch 32, lr 3e-3, batches of similar length; sparse blocks
of 16 tokens, a local window of 16 keys a side, so that no sparse pattern covers a whole tree) trains
on the same 20K trees, is scored on 1K dev trees every 100 steps and tested on 2K test trees with its
best dev checkpoint. Runs go two at a time (``--jobs``) on worker processes with one torch thread
each, started and given the data before the first run; each run's peak memory is its own (the peak
RSS is reset between runs). ``minutes`` bounds the whole demo from the start of its process: each
run gets a share of what is left in proportion to its variant's cost (`Shares`), and a run that must
stop early says so ("stopped early").
The report gives mean +- std over the seeds per variant, the
majority-class and chance rows, and the learning curves; the checkpoints are deleted afterwards.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .recipes import DEMO
from .report import plots, seeds_markdown, write_rows
from .tasks import load_task
from .train import TrainConfig, reset_peak_rss, resolve, task_data, train
from .variants import VARIANTS

DATA = {"sizes": [20000, 1000, 2000]}
#: blocks of 16 tokens and a window of 16 keys a side: at the default 64 / 128 every sparse pattern
#: covers a whole tree of at most 128 tokens and all of them compute dense softmax attention
BLOCK, WINDOW = 16, 16
#: seconds of the budget kept for the end (the last runs' test, the report and plots), and what a
#: worker takes to build a run's model before the trainer's clock starts
RESERVE, BUILD = 30.0, 2.0


#: a demo run's cost relative to softmax (CPU time of its 300 steps and evaluations, batches by
#: length; `demo --cpu-cost`, 2026-11-27): the prior of the time shares, replaced by each variant's
#: measured run time once one of its runs has finished; a variant not listed counts as 2
COST = {"softmax": 1.0, "local": 1.11, "fixed": 1.42, "strided": 1.30, "bigbird": 1.16, "longformer": 1.18,
        "linear": 0.96, "favor": 1.89, "reformer": 2.83, "transformer-xl": 1.92, "adaptive-span": 1.41}

_DATA: Dict = {}        # a worker's data, loaded once and shared by its runs


def _data(cfg: TrainConfig):
    """The worker's copy of ``cfg``'s data (read from the cache the first time)."""
    cfg = resolve(cfg)
    key = json.dumps([cfg.cache_dir, cfg.preset, cfg.data_seed, cfg.overrides], sort_keys=True)
    if key not in _DATA:
        _DATA[key] = task_data(cfg)
    return _DATA[key]


def _run(cfg: TrainConfig) -> Dict:
    """One demo run in a pool worker: the data is read once per worker, the peak memory is the run's own."""
    data = _data(cfg)
    reset_peak_rss()
    return train(cfg, data=data, quiet=True)


def _ready(seconds: float) -> None:
    """Holds a fresh worker a moment, so that each of the first ``jobs`` tasks starts its own worker."""
    time.sleep(seconds)


def demo_configs(out: Path, minutes_each: float, cache_dir: Optional[str] = None, threads: int = 1,
                 variants: Sequence[str] = tuple(VARIANTS), seeds: Sequence[int] = (0, 1, 2),
                 data: Dict = DATA) -> List[TrainConfig]:
    """The demo's runs: every variant with every seed, each within ``minutes_each``; seed by seed,
    the dearest variants first (so that the last runs to start are the short ones)."""
    order = sorted(variants, key=lambda v: -COST.get(v, 2.0))
    return [TrainConfig(recipe="demo", variant=v, seed=seed, out=str(Path(out) / f"{v}-seed{seed}"),
                        block_size=BLOCK, window=WINDOW, max_minutes=minutes_each, cache_dir=cache_dir, threads=threads,
                        overrides=data, log_every=1000)
            for seed in seeds for v in order]


class Shares:
    """The time budget of each run: when a run starts, the core-seconds left (``jobs`` cores until
    the deadline, less what the runs in flight were promised) are split over it and the runs still
    waiting in proportion to their cost: the measured seconds of a finished run of the same variant
    (scaled to the whole run where it stopped early), else `COST` scaled by the finished runs."""

    def __init__(self, jobs: int, deadline: float):
        self.jobs, self.deadline = jobs, deadline
        self.measured: Dict[str, float] = {}
        self.promised: Dict[int, float] = {}      # run id -> when its budget ends
        self.overheads: List[float] = []          # seconds a finished run took beyond its trainer's budget

    def overhead(self) -> float:
        """What a run takes outside its trainer's clock (building the model, the last evaluations
        beyond the trainer's estimate, writing results): the mean over the finished runs, else `BUILD`."""
        return sum(self.overheads) / len(self.overheads) if self.overheads else BUILD

    def weight(self, variant: str) -> float:
        if variant in self.measured:
            return self.measured[variant]
        scale = [t / COST.get(v, 2.0) for v, t in self.measured.items()]
        return COST.get(variant, 2.0) * (sum(scale) / len(scale) if scale else 1.0)

    def start(self, run: int, variant: str, waiting: Sequence[str], now: float) -> float:
        """Seconds for ``run`` (of ``variant``), with ``waiting`` the variants of the runs not yet started."""
        left = self.jobs * (self.deadline - now) - sum(max(0.0, end - now) for end in self.promised.values())
        share = left * self.weight(variant) / (self.weight(variant) + sum(self.weight(v) for v in waiting))
        share = max(share, 6.0)           # a few steps and the evaluations, however late
        self.promised[run] = now + share
        return share

    def finish(self, run: int, variant: str, seconds: float, budget: float, train_seconds: float, steps: int,
               target: int) -> None:
        """Run ``run`` took ``seconds`` for a trainer's ``budget``, of which ``train_seconds`` in
        ``steps`` training steps of ``target``."""
        self.promised.pop(run, None)
        self.overheads.append(max(0.0, seconds - budget))
        whole = seconds - train_seconds + train_seconds * target / max(steps, 1)
        self.measured[variant] = max(self.measured.get(variant, 0.0), whole)


def process_age() -> float:
    """Seconds since this process started (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def run_demo(out: Path, minutes: float = 9.5, cache_dir: Optional[str] = None, threads: int = 1, jobs: int = 2,
             variants: Sequence[str] = tuple(VARIANTS), seeds: Sequence[int] = (0, 1, 2)) -> List[Dict]:
    load = os.getloadavg()
    t0 = time.perf_counter() - process_age()       # the interpreter's start and imports count
    load_task("listops", preset="short", cache_dir=cache_dir, workers=jobs, overrides=DATA)    # fills the cache
    data_minutes = (time.perf_counter() - t0) / 60
    cfgs = demo_configs(out, minutes, cache_dir, threads, variants, seeds)
    shares = Shares(jobs, t0 + minutes * 60 - RESERVE)
    rows: List[Dict] = []
    # ``jobs`` worker processes, each running one run at a time and keeping its data between runs;
    # all of them started (torch and effattn imported, the data read) before the first run's share
    # is set: under load a start takes tens of seconds, which no run's share could foresee
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_data,
                             initargs=(cfgs[0],)) as pool:
        for f in [pool.submit(_ready, 0.5) for _ in range(jobs)]:
            f.result()
        ready_minutes = (time.perf_counter() - t0) / 60 - data_minutes
        running, nxt = {}, 0
        while nxt < len(cfgs) or running:
            while nxt < len(cfgs) and len(running) < jobs:
                now = time.perf_counter()
                seconds = shares.start(nxt, cfgs[nxt].variant, [c.variant for c in cfgs[nxt + 1:]], now)
                # the trainer's clock covers neither the model's building nor writing the results
                cfg = replace(cfgs[nxt], max_minutes=max(0.05, (seconds - shares.overhead()) / 60))
                running[pool.submit(_run, cfg)] = (nxt, cfg, now)
                nxt += 1
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                i, cfg, began = running.pop(fut)
                row = fut.result()
                row["demo_run_seconds"], row["demo_budget_minutes"] = time.perf_counter() - began, cfg.max_minutes
                shares.finish(i, cfg.variant, row["demo_run_seconds"], cfg.max_minutes * 60, row["train_minutes"] * 60,
                              row["steps"], row["target_steps"])
                rows.append(row)
    rows.sort(key=lambda r: (list(variants).index(r["variant"]), r["seed"]))
    total = (time.perf_counter() - t0) / 60
    for r in rows:
        r["demo_minutes"], r["demo_data_minutes"], r["demo_start_minutes"] = total, data_minutes, ready_minutes
    budgets = [r["demo_budget_minutes"] for r in rows]
    md = ["# Long Range Arena CPU demo: short ListOps", "",
          f"`python -m benchmarks.lra demo`: ListOps trees of 16-128 tokens (LRA's generator), recipe `demo` "
          f"({DEMO.summary()}), at most {minutes:g} minutes in all, {jobs} worker processes with {threads} torch "
          f"thread(s) each (a worker reads the data once and runs one run after another); each run's time "
          f"({min(budgets):.2f}-{max(budgets):.2f} minutes) is its share of what is left when it starts, in "
          f"proportion to its variant's cost; blocks of {BLOCK} tokens, local window {WINDOW} keys a side "
          f"(at 64 / 128 every sparse pattern covers a whole tree); test accuracy on the best dev checkpoint; "
          f"seeds {', '.join(map(str, seeds))} (the "
          "model's initialization, batch order and dropout; the data is the same).", "",
          seeds_markdown(rows),
          f"Whole demo: {total:.1f} minutes wall clock from the start of its process, of which {data_minutes:.1f} "
          f"starting and making or reading the data and {ready_minutes:.1f} starting the workers; 1-minute load "
          f"average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 runs at a time fill 2 idle "
          "cores: a higher load means other jobs took CPU time from the demo).", ""]
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
    start-up of a worker process (importing the harness and effattn, timed in a fresh interpreter),
    building a trainer, a training step (mean of ``steps`` after 3 warm-up steps, the same batches
    for every variant, drawn as the demo draws them: by length) and a dev evaluation, per variant. A
    run costs build + 300 steps + 5 dev-sized evaluations (3 of dev, the test at twice dev's size);
    the estimate of the demo's wall clock on ``jobs`` idle cores is the sum over variants and seeds,
    plus a start-up per worker, divided by ``jobs`` (making the data, 0.7 minutes, comes on top).
    ``relative``: a run's cost over softmax's (the demo's `COST`)."""
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
        G = tr.cfg.batch_size
        order = epoch_order(0, 0, len(tr.data.train), G, tr.train_lengths, tr.cfg.buckets)
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
                            "run": build + tr.cfg.steps * step + 5 * ev}
    for v in per.values():
        v["relative"] = v["run"] / per.get("softmax", next(iter(per.values())))["run"]
    total = seeds * sum(v["run"] for v in per.values()) + jobs * startup
    return {"startup": startup, "variants": per, "seeds": seeds, "jobs": jobs, "cpu_seconds": total,
            "idle_minutes_estimate": total / jobs / 60}


def cpu_cost_markdown(res: Dict) -> str:
    lines = ["| variant | train step (CPU s) | dev evaluation (CPU s) | run (CPU s) | relative |", "|---|---|---|---|---|"]
    for v, d in res["variants"].items():
        lines.append(f"| {v} | {d['step']:.3f} | {d['dev_eval']:.2f} | {d['run']:.0f} | {d['relative']:.2f} |")
    return "\n".join(lines) + (
        f"\n\nStart-up of a worker process: {res['startup']:.1f} CPU s. {res['seeds']} seeds x {len(res['variants'])} "
        f"variants: {res['cpu_seconds'] / 60:.1f} CPU minutes, about {res['idle_minutes_estimate']:.1f} minutes on "
        f"{res['jobs']} idle cores (an estimate from CPU time, not a measured wall clock).\n")
