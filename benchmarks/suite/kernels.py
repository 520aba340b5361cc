"""Every Triton kernel a suite will launch, planned without a GPU and compiled before any timing, in
a pool of processes.

Triton compiles each (kernel, config, constexprs) variant on its first launch, one at a time, in the
middle of the timed sections (the autotuner alone compiles every candidate config of every kind of
call). This module moves that work to the start, in parallel:

- `plan_variants(calls)` runs the launchers on ``meta`` tensors (no device, no memory) with every
  kernel launch recorded instead of run and every autotuner "timing" each of its candidates by one
  recorded launch. What comes out is the list of distinct compile variants (kernel, argument types
  and the properties Triton specializes integers on, constexprs, warps, stages). It needs no GPU:
  ``--dry-run`` prints it.
- `compile_all(variants)` compiles them in a ``ProcessPoolExecutor`` with the 'spawn' start method:
  each worker calls the kernel's ``warmup`` (Triton compiles for the current GPU without
  launching; tensors are passed as their dtypes), which fills Triton's on-disk cache; the suite's
  own launches then load the binaries instead of compiling. With ``arch`` (e.g. 90) the workers
  compile for that target without a GPU (a stand-in driver answers Triton's device queries), the
  same binaries under the same cache keys as on such a GPU with the same triton and effattn
  source: ``python -m benchmarks.suite.precompile --arch 90`` on a CPU checks that every variant
  compiles, and can fill a cache (``TRITON_CACHE_DIR``) to carry to a GPU machine.

The calls are the softmax-attention launchers (forward, and the backward's kernels) and the causal
linear-attention passes, called as their torch ops call them; a call that cannot be planned this way
is reported (with why), not hidden: its kernels then compile on first launch as before.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

EST_COMPILE_S = 6.0       # one variant on one free core (sm_90, D=128 forward: 4.4 s with triton 3.6 here)


@dataclass(frozen=True)
class Call:
    """One effattn call of a suite: op "attention" or "linear_attention", shapes, and its options
    (attention: causal, window (left, right) or None, layout (BlockLayout) or None; linear:
    feature map name, F features, normalize); ``backward`` adds the backward's kernels."""
    op: str
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    dtype: torch.dtype
    backward: bool
    causal: bool = True
    window: Optional[Tuple[int, int]] = None
    layout: object = None
    feature_map: str = "elu"
    features: int = 0                  # linear: F of FAVOR+ features (the kernels see them as inputs)
    normalize: bool = True


@dataclass(frozen=True)
class Variant:
    """One compile of one kernel: ``args`` as the kernel receives them with tensors replaced by their
    dtype; ``key`` what Triton specializes on (integers by divisibility by 16, equality to 1 and
    width), so that two launches with the same key share a binary."""
    module: str
    name: str
    args: tuple
    kwargs: tuple                      # sorted (name, value) pairs: constexprs, num_warps, num_stages
    key: tuple

    def describe(self) -> str:
        kw = dict(self.kwargs)
        cfg = "x".join(str(kw.get(k, "-")) for k in ("BLOCK_M", "BLOCK_N")) if "BLOCK_M" in kw else \
            "x".join(str(kw.get(k, "-")) for k in ("BK", "BV", "CHUNK") if k in kw)
        on = [k for k, val in kw.items() if val is True]
        return (f"{self.name:22s} {cfg or '-':12s} warps={kw.get('num_warps', '-')} stages={kw.get('num_stages', '-')}"
                f"  {' '.join(on)}")


def _spec(x):
    """The part of an argument Triton specializes on."""
    if isinstance(x, torch.Tensor):
        return ("*", str(x.dtype))
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return ("i", x == 1, x % 16 == 0, -2**31 <= x < 2**31)
    if isinstance(x, float):
        return "f"
    if isinstance(x, tuple):                  # strides travel as tuples: specialized element by element
        return tuple(_spec(e) for e in x)
    return repr(x)


def _plain(x):
    """A picklable argument for a worker: tensors become their dtype (Triton's MockTensor)."""
    return x.dtype if isinstance(x, torch.Tensor) else x


def _variant(jit, args, kwargs) -> Variant:
    # a launch by keyword (the forward's): its non-constexpr parameters go back to their place in the
    # signature, so that they are specialized (and shipped to a worker) as positional ones are
    params = [p for p in jit.params if not p.is_constexpr]
    args, kwargs = list(args), dict(kwargs)
    for p in params[len(args):]:
        if p.name not in kwargs:
            break
        args.append(kwargs.pop(p.name))
    kw = tuple(sorted(kwargs.items()))
    return Variant(jit.fn.__module__, jit.fn.__name__, tuple(_plain(a) for a in args), kw,
                   (jit.fn.__module__, jit.fn.__name__, tuple(_spec(a) for a in args),
                    tuple((k, repr(v)) for k, v in kw)))       # constexprs and options: as given


@contextlib.contextmanager
def spy(launch: bool):
    """Within: every Triton kernel launch appends its `Variant` to the yielded list; it runs too
    when `launch`, else nothing runs."""
    from triton.runtime.jit import JITFunction
    seen: List[Variant] = []
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append(_variant(self, args, kwargs))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs) if launch or warmup else None

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = orig


def triton_modules():
    """effattn's imported Triton modules (the launchers among them hold `do_bench` and `_TUNED`)."""
    return [m for n, m in list(sys.modules.items()) if n.startswith("effattn.backends.triton") and m is not None]


@contextlib.contextmanager
def recording():
    """Within: Triton launches append a `Variant` to the yielded list instead of running; effattn's
    autotuners "time" each candidate by calling it once (every candidate is recorded); their
    caches of chosen configs are emptied on entry and restored on exit. The attention launchers
    plan for this GPU's capability, or sm_90 without a GPU (their TMA default, `launch.tma_default`)."""
    def once(fn, *a, **k):
        fn()
        return 0.0

    mods = triton_modules()
    from effattn.backends.triton.attention import launch as attn_launch
    saved_cap = attn_launch.META_CAPABILITY       # the launchers' TMA default on meta tensors: this GPU's,
    attn_launch.META_CAPABILITY = (torch.cuda.get_device_capability() if torch.cuda.is_available()
                                   else (9, 0))   # or the suite's H100 / H200 target
    saved_bench = [(m, m.do_bench) for m in mods if hasattr(m, "do_bench")]
    saved_tuned = [(m._TUNED, dict(m._TUNED)) for m in mods if isinstance(getattr(m, "_TUNED", None), dict)]
    orig_capturing = torch.cuda.is_current_stream_capturing
    env = os.environ.get("EFFATTN_TRITON_AUTOTUNE")
    torch.cuda.is_current_stream_capturing = lambda: False       # meta tensors are never captured
    os.environ["EFFATTN_TRITON_AUTOTUNE"] = "1"
    for m, _ in saved_bench:
        m.do_bench = once
    for d, _ in saved_tuned:
        d.clear()
    try:
        with spy(launch=False) as seen:
            yield seen
    finally:
        attn_launch.META_CAPABILITY = saved_cap
        torch.cuda.is_current_stream_capturing = orig_capturing
        for m, f in saved_bench:
            m.do_bench = f
        for d, old in saved_tuned:
            d.clear()
            d.update(old)
        if env is None:
            os.environ.pop("EFFATTN_TRITON_AUTOTUNE", None)
        else:
            os.environ["EFFATTN_TRITON_AUTOTUNE"] = env


def _launch_call(c: Call):
    """Runs the Triton launchers of `c` on meta tensors, as the backends' torch ops call them."""
    meta = torch.device("meta")
    if c.op == "attention":
        from effattn.backends.triton.attention import launch
        q = torch.empty(c.B, c.H, c.Lq, c.D, dtype=c.dtype, device=meta)
        k, v = (torch.empty(c.B, c.Hkv, c.Lk, c.D, dtype=c.dtype, device=meta) for _ in range(2))
        left, right = c.window if c.window is not None else (-1, 0 if c.causal else -1)
        lay = c.layout
        args = (lay.mask if lay is not None else None, lay.block_size if lay is not None else 0, None, None,
                c.D ** -0.5, 0.0, left, right, False)
        from effattn.backends.triton.attention import decode
        lo, hi = decode.key_range(c.Lq, c.Lk, left)
        if not c.backward and c.Lq <= decode.MAX_QUERIES and hi - lo >= decode.splits.DECODE_MIN_KEYS:
            # the backend's split-KV decode path (its fits() check is made inside the launcher's plan)
            decode.fwd(q, k, v, *args[:3], c.D ** -0.5, left, right, False)
            return
        out, lse = launch.fwd(q, k, v, *args)
        if c.backward:
            launch.bwd(torch.empty_like(out), None, q, k, v, out, lse, *args)
        return
    from effattn.backends.triton.linear import ops
    from effattn.feature_maps import KERNEL_MAPS
    fmap = KERNEL_MAPS.get(c.feature_map, 0)
    F = c.features or c.D
    q = torch.empty(c.B, c.H, c.Lq, F, dtype=c.dtype, device=meta)
    k = torch.empty(c.B, c.Hkv, c.Lk, F, dtype=c.dtype, device=meta)
    v = torch.empty(c.B, c.Hkv, c.Lk, c.D, dtype=c.dtype, device=meta)
    out, den, _, _ = ops.causal_fwd(q, k, v, None, None, 0, fmap, c.normalize, 1e-6, False)
    if c.backward:
        ops.causal_bwd(torch.empty_like(out), None, None, q, k, v, out, den, None, None, 0, fmap, c.normalize,
                       1e-6, False)


def plan_variants(calls: Sequence[Call]) -> Tuple[List[Variant], Dict[Call, str]]:
    """(the distinct compile variants of `calls`, in first-launch order; {call: why it could not be
    planned}). Runs no kernel and needs no GPU."""
    importlib.import_module("effattn.backends.triton.attention.launch")     # before `recording` patches them
    importlib.import_module("effattn.backends.triton.linear.ops")
    variants: Dict[tuple, Variant] = {}
    failed: Dict[Call, str] = {}
    for c in dict.fromkeys(calls):
        with recording() as seen:
            try:
                _launch_call(c)
            except Exception as e:                     # noqa: BLE001 - reported by the caller
                failed[c] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        for var in seen:
            variants.setdefault(var.key, var)
    return list(variants.values()), failed


class _OfflineDriver:
    """Answers the device queries of Triton's launch path for a GPU target without a GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _compile_one(var: Variant, arch: Optional[int] = None) -> Tuple[str, float, str]:
    """Worker: compiles `var` for the current GPU, or for ``sm_<arch>`` without one (Triton's
    ``warmup``: no launch). Returns (the variant's description, seconds, "" or the error)."""
    t0 = time.perf_counter()
    if arch is not None:
        from triton.runtime import driver
        driver.set_active(_OfflineDriver(arch))
    try:
        kernel = getattr(importlib.import_module(var.module), var.name)
        kernel.warmup(*var.args, grid=(1,), **dict(var.kwargs))
        err = ""
    except Exception as e:                              # noqa: BLE001 - a config that does not fit, say
        err = f"{type(e).__name__}: {str(e).strip()[:200]}"
    return var.describe(), time.perf_counter() - t0, err


def compile_all(variants: Sequence[Variant], processes: Optional[int] = None, deadline: float = float("inf"),
                log=print, arch: Optional[int] = None) -> List[dict]:
    """Compiles `variants` in a 'spawn' process pool (``processes``: default the CPU count, at most
    16), for the current GPU or, given ``arch``, for ``sm_<arch>`` without one; stops waiting at
    ``time.monotonic() > deadline`` (the rest then compile on first launch). Returns one row per
    variant: kernel, description, seconds, status."""
    n = max(1, min(processes or os.cpu_count() or 1, 16, len(variants) or 1))
    ctx = multiprocessing.get_context("spawn")
    rows, t0 = [], time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=ctx) as pool:
        futures = {pool.submit(_compile_one, v, arch): v for v in variants}
        try:
            wait = None if deadline == float("inf") else max(1.0, deadline - time.monotonic())
            for fut in concurrent.futures.as_completed(futures, timeout=wait):
                desc, s, err = fut.result()
                rows.append(dict(kernel=futures[fut].name, variant=desc, seconds=round(s, 2),
                                 status="error: " + err if err else "ok"))
        except concurrent.futures.TimeoutError:
            for fut, v in futures.items():
                if not fut.done():
                    fut.cancel()
                    rows.append(dict(kernel=v.name, variant=v.describe(), seconds=None,
                                     status="skipped: precompile budget"))
            pool.shutdown(wait=False, cancel_futures=True)
    ok = sum(r["status"] == "ok" for r in rows)
    log(f"precompiled {ok}/{len(variants)} kernel variants with {n} processes in {time.monotonic() - t0:.0f} s")
    return rows


def estimate_s(n_variants: int, processes: int = 16) -> float:
    """Rough wall seconds of `compile_all` for `n_variants` on `processes` workers."""
    return 10.0 + EST_COMPILE_S * -(-n_variants // max(1, processes))
