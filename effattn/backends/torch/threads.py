"""Slice-parallel execution for the torch backend's CPU paths.

A call made of many tensor ops scales badly with torch's intra-op threads: every op ends in a
barrier, and on a busy or small machine one descheduled thread stalls every barrier (measured: a
sliding-window call 10x slower with 2 threads than with 1 while SDPA, one parallel region per call,
was not). So the CPU paths cut a call into independent slices (batch entries or key/value heads),
and run the slices on torch.get_num_threads() Python threads, each doing its ops with one intra-op
thread; torch releases the GIL inside ops. Each slice writes its own part of the outputs, so the
result does not depend on scheduling: bitwise the same at any thread count.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Sequence, Tuple

import torch

_POOL = {"n": 0, "pool": None, "pid": None}
_PREFIX = "effattn-cpu"
_LOCK = threading.Lock()


def ranges(n: int, parts: int) -> List[Tuple[int, int]]:
    """[0, n) cut into at most `parts` contiguous ranges of near-equal size."""
    parts = max(1, min(parts, n))
    step, extra = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + step + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def _pool(n: int) -> ThreadPoolExecutor:
    with _LOCK:
        # a new pool when the thread count changed, or in a forked child (e.g. a DataLoader worker),
        # where the parent's pool threads do not exist
        if _POOL["n"] != n or _POOL["pid"] != os.getpid():
            if _POOL["pool"] is not None and _POOL["pid"] == os.getpid():
                _POOL["pool"].shutdown(wait=False)
            _POOL.update(pool=ThreadPoolExecutor(max_workers=n, thread_name_prefix=_PREFIX), n=n, pid=os.getpid())
        return _POOL["pool"]


def run_slices(fn: Callable[[int, int], object], slices: Sequence[Tuple[int, int]], grad: bool = False) -> list:
    """[fn(a, b) for (a, b) in slices], in parallel when torch has more than one thread. Workers run
    with one intra-op thread and the given grad mode (grad mode and dispatch state are per thread)."""
    n = torch.get_num_threads()
    nested = threading.current_thread().name.startswith(_PREFIX)     # a worker's own call: no new tasks
    if n <= 1 or len(slices) <= 1 or nested:
        with torch.set_grad_enabled(grad):
            return [fn(a, b) for a, b in slices]

    def work(a, b):
        torch.set_num_threads(1)          # this thread's OpenMP/MKL count; restored for the pool below
        try:
            with torch.set_grad_enabled(grad):
                return fn(a, b)
        finally:
            torch.set_num_threads(n)

    futures = [_pool(n).submit(work, a, b) for a, b in slices]
    return [f.result() for f in futures]
