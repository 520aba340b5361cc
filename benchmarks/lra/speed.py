"""Table 2: training speed and memory of each variant at 1K-4K tokens (LRA measured byte-level
Text with its Text model; ``--task pathx --lengths 16384`` measures Path-X's model at 16K). Random
byte documents of exactly ``L`` tokens; a few warm-up steps, then the mean over
``steps`` timed training steps (forward, backward, AdamW). Peak memory: on CUDA the allocator's
peak during the timed steps; on the CPU the resident-set peak above the level before the model was
built, each measurement in a fresh process (freed memory stays with a process, so a second
measurement in the same one would read too low).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F

from .model import Classifier
from .recipes import recipe
from .train import environment


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


class _RssPeak:
    def __init__(self):
        self.base = _rss_mib()
        self.peak = self.base
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, _rss_mib())
            time.sleep(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def measure(variant: str, length: int, batch: int, recipe_name: str = "small", steps: int = 5, warmup: int = 2,
            device: str = "auto", backend: str = "auto", block_size: int = 64, window: int = 128,
            task: str = "text") -> Dict:
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    mcfg = recipe(recipe_name, task).model
    row = dict(task=f"{task} (speed)", variant=variant, length=length, batch_size=batch, recipe=recipe_name,
               model_about=f"{mcfg.layers}L d={mcfg.d_model} {mcfg.heads}h", backend=backend, test_accuracy=None,
               **environment(dev))
    amp = dev.type == "cuda"
    try:
        with _RssPeak() as rss:
            torch.manual_seed(0)
            pair = task == "retrieval"          # two documents of ``length`` tokens each
            model = Classifier(258, length, 2, mcfg, variant, block_size=block_size, pair=pair,
                               window=window, backend=backend).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x = torch.randint(2, 258, (batch, length), device=dev)
            y = torch.randint(0, 2, (batch,), device=dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
            for i in range(warmup + steps):
                if i == warmup:
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                    loss = F.cross_entropy(model(x, x if pair else None).float(), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        if dev.type == "cpu":
            import resource
            rss.peak = max(rss.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else rss.peak - rss.base
        row.update(steps_per_s=steps / elapsed, status="ok", peak_mib=peak,
                   memory="peak CUDA memory allocated" if dev.type == "cuda" else "peak RSS above the pre-model level")
    except torch.cuda.OutOfMemoryError:
        row.update(steps_per_s=None, peak_mib=None, status="OOM")
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _measure_fresh(args) -> Dict:
    threads, a, kw = args
    if threads:
        torch.set_num_threads(threads)
    return measure(*a, **kw)


def sweep(variants: Sequence[str], lengths: Sequence[int], batch: int, **kw) -> List[Dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    cpu = kw.get("device", "auto") == "cpu" or (kw.get("device", "auto") == "auto" and not torch.cuda.is_available())
    rows = []
    for L in lengths:
        for v in variants:
            if cpu:
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    r = pool.submit(_measure_fresh, (torch.get_num_threads(), (v, L, batch), kw)).result()
            else:
                r = measure(v, L, batch, **kw)
            print(f"L={L:5d} {v:10s} {r['status']:4s} "
                  + (f"{r['steps_per_s']:.3f} steps/s {r['peak_mib']:.0f} MiB" if r["status"] == "ok" else ""),
                  flush=True)
            rows.append(r)
    return rows


def budget(task: str, recipe_name: str = "lra", variant: str = "softmax", steps: int = 3,
           device: str = "auto") -> str:
    """Times the recipe's training step at the task's full length on this machine and projects the
    whole run (evaluations not counted). On a CPU the batch is cut to 4 and the time scaled up by
    the batch ratio (a CPU step's time grows about linearly with the batch)."""
    from .tasks import MAX_LENGTH
    r = recipe(recipe_name, task)
    dev = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    batch = r.batch_size if dev.startswith("cuda") else min(4, r.batch_size)
    row = measure(variant, MAX_LENGTH[task], batch, recipe_name, steps=steps, warmup=1, device=dev, task=task)
    if row["status"] != "ok":
        return f"{task}: {row['status']} at batch {batch} on {row['device']}"
    per_step = batch and r.batch_size / batch / row["steps_per_s"]
    hours = per_step * r.steps / 3600
    return (f"{task}, recipe {recipe_name} ({r.summary()}), {variant}: {per_step:.3g} s per step of batch "
            f"{r.batch_size} at {MAX_LENGTH[task]} tokens"
            + (f" (timed at batch {batch}, scaled)" if batch != r.batch_size else "")
            + f" on {row['device']} -> {hours:.3g} hours for {r.steps} steps ({hours / 24:.3g} days), evaluations "
              "not counted")
