"""Timing, peak memory, and what a failed configuration is called.

Time (median, milliseconds):
    CUDA  ``triton.testing.do_bench(fn, return_mode="median")`` (it warms up, flushes L2 between runs
          and resets grads); without triton, CUDA events around each call.
    CPU   ``time.perf_counter`` around each call after warm-up, at least ``min_runs`` calls and more
          while the time budget lasts.

Peak memory (MiB, beyond what was allocated before the call: inputs are not counted):
    CUDA  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: the tensors the call
          allocates at its peak (the caching allocator's reserve is not counted).
    CPU   growth of the process's peak resident set during the call: the high-water mark ``VmHWM``
          is reset before the call (``/proc/self/clear_refs``, Linux >= 4.0) and read after it, minus
          the resident set before. glibc is told to serve blocks >= 1 MiB with mmap and to trim its
          heap above 1 MiB, so a freed tensor goes back to the OS and does not hide the next
          config's allocations; the error is a few MiB at most. Where that is not possible
          (not Linux, not glibc) the memory column says n/a.
"""
from __future__ import annotations

import ctypes
import gc
import statistics
import time
from typing import Callable, Optional

import torch

CPU_MEM_METHOD = "peak RSS growth (VmHWM reset)"
CUDA_MEM_METHOD = "torch.cuda.max_memory_allocated growth"


# --------------------------------------------------------------------------------------- time

def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 1, min_runs: int = 3,
            max_runs: int = 50, budget_s: float = 1.0, grad_to_none=None) -> float:
    """Median milliseconds of ``fn()``. ``warmup``/``min_runs``/``max_runs``/``budget_s`` drive the CPU
    loop (and the CUDA-events fallback); on CUDA with triton, do_bench runs ~25 ms of warm-up and
    ~100 ms of timed calls (``budget_s`` scales both)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, warmup=max(1, int(25 * budget_s)), rep=max(1, int(100 * budget_s)),
                                  grad_to_none=grad_to_none, return_mode="median"))
        return _cuda_events_ms(fn, device, warmup, min_runs, max_runs, budget_s, grad_to_none)
    for _ in range(warmup):
        reset_grads(grad_to_none)
        fn()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() < deadline):
        reset_grads(grad_to_none)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _cuda_events_ms(fn, device, warmup, min_runs, max_runs, budget_s, grad_to_none) -> float:
    for _ in range(max(warmup, 3)):
        reset_grads(grad_to_none)
        fn()
    torch.cuda.synchronize(device)
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() < deadline):
        reset_grads(grad_to_none)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def reset_grads(tensors):
    for t in tensors or ():
        t.grad = None


# --------------------------------------------------------------------------------------- memory

_cpu_rss_ready: Optional[bool] = None


def enable_cpu_peak_rss() -> bool:
    """Prepares the process for CPU peak-memory measurement (see the module docstring); True when it
    works here. Call once, before the tensors of the sweep are allocated."""
    global _cpu_rss_ready
    if _cpu_rss_ready is None:
        _cpu_rss_ready = False
        try:
            libc = ctypes.CDLL(None)
            M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3            # glibc malloc.h
            ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 1 << 20) == 1
            if ok:
                _reset_peak_rss()
                _status_kib("VmHWM")
                _cpu_rss_ready = True
        except (OSError, AttributeError, ValueError):
            pass
    return _cpu_rss_ready


def _reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                             # 5: reset the peak RSS to the current RSS


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}")


def peak_memory_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """MiB that one call of ``fn`` adds at its peak (see the module docstring), or None (n/a)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del out
        return (peak - base) / 2**20
    if not enable_cpu_peak_rss():
        fn()
        return None
    _reset_peak_rss()
    base = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    del out
    return max(0, peak - base) / 1024


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return CUDA_MEM_METHOD
    return CPU_MEM_METHOD if enable_cpu_peak_rss() else "n/a (needs Linux + glibc)"


def free_memory(device: torch.device, collect: bool = True):
    """Returns what a finished (or failed) configuration held to the allocator / the OS. Tensors
    die by reference counting; ``collect`` also breaks reference cycles (a failure's traceback)."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- failures

def is_oom(exc: BaseException) -> bool:
    """True for out-of-memory on any device: torch.cuda.OutOfMemoryError, MemoryError, and the
    RuntimeErrors torch raises when an allocation fails."""
    if isinstance(exc, MemoryError):
        return True
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if oom_types and isinstance(exc, oom_types):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def one_line(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")
    return text if len(text) <= limit else text[:limit - 3] + "..."
