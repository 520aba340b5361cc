"""Table 2: training speed and memory of each variant at 1K-4K tokens (LRA measured byte-level
Text). Random byte documents of exactly ``L`` tokens; a few warm-up steps, then the mean over
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

from .model import Classifier, model_config
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


def measure(variant: str, length: int, batch: int, config: str = "small", steps: int = 5, warmup: int = 2,
            device: str = "auto", backend: str = "auto", block_size: int = 64, window: int = 128) -> Dict:
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    row = dict(task="text (speed)", variant=variant, length=length, batch_size=batch, config=config, backend=backend,
               test_accuracy=None, **environment(dev))
    amp = dev.type == "cuda"
    try:
        with _RssPeak() as rss:
            torch.manual_seed(0)
            model = Classifier(258, length, 2, model_config(config, "text"), variant, block_size=block_size,
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
                    loss = F.cross_entropy(model(x).float(), y)
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
