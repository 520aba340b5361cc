"""The suite's sections that are not a sweep of registry variants: ``gqa`` (grouped-query causal
attention against SDPA with ``enable_gqa``), ``packed`` (packed sequences with ``cu_seqlens`` against
the same documents padded, with a key padding mask), ``decode`` (one query row against a KV cache, beside
the memory-bound time), ``paged`` (the same decode over a paged KV cache: the in-place paged kernel, the
contiguous decode on the same keys, and a torch gather of the pages + SDPA), ``host`` (the host's cost
of a tiny call) and ``checks`` (CUDA-graph replay
and torch.compile against eager with the tuned configs). Each returns result rows in the sweep's
columns; a row not started before its section's deadline is ``skipped: section budget``.
"""
from __future__ import annotations

import time
from typing import List

import torch

from effattn.testing import checks

from .. import measure, registry
from ..flops import attention_flops, tflops
from .sections import PAGE_SIZE, Section, paged_impls

HOST_SHAPE = (1, 8, 256, 64)                      # B, H, L, D of the host-overhead rows


def _sdpa_gqa(which: str, q, k, v):
    """SDPA pinned to backend `which` (FLASH_ATTENTION, CUDNN_ATTENTION) with ``enable_gqa``, causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn():
        with sdpa_kernel([getattr(SDPBackend, which)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn


def _time_row(row: dict, fn, leaves, dout, mode: str, device) -> dict:
    """`row` with the median time of `fn` (under no_grad) or of `fn` plus its backward, or why not."""
    try:
        if mode == "fwd":
            def step():
                with torch.no_grad():
                    return fn()
        else:
            def step():
                return torch.autograd.grad(fn(), leaves, dout)
        step()                                              # compile / autotune / one-time init
        ms = measure.time_ms(step, device, budget_s=0.2 if device.type == "cuda" else 0.01,
                             min_runs=1 if device.type != "cuda" else 3)
        flops = row["flops"] * (3.5 if mode == "fwdbwd" else 1)
        return {**row, "status": "ok", "time_ms": ms, "tflops": tflops(flops, ms), "flops": flops}
    except registry.Unsupported as e:
        return {**row, "status": f"unsupported: {e}"}
    except Exception as e:                                  # noqa: BLE001 - recorded
        if measure.is_oom(e):
            return {**row, "status": "oom"}
        kind = "unsupported" if row["kind"] == "baseline" else "error"
        return {**row, "status": f"{kind}: {measure.one_line(e)}"}


def _effattn_fn(b: str, q, k, v, **kw):
    """effattn.attention on backend `b` (the registry's builder: Unsupported with explain's reasons)."""
    from types import SimpleNamespace
    case = SimpleNamespace(q=q, k=k, v=v, device=q.device, attention_kwargs=lambda: kw)
    return registry._effattn(b, "attention")(case).fn


def _unsupported(b):
    def fn():
        raise b
    return fn


def gqa_rows(sec: Section, backends, device, deadline: float, smoke: bool) -> List[dict]:
    """Grouped-query causal attention (H query heads on ``sec.kv_heads`` KV heads) per length:
    effattn's backends and SDPA (flash, cuDNN) with ``enable_gqa``, forward and forward+backward."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for L in sec.lengths:
        B, H = sec.shape(L)
        Hkv, D = sec.kv_heads, sec.head_dim
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype).requires_grad_()
        k, v = (torch.randn(B, Hkv, L, D, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(2))
        dout = torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype)
        impls = [(f"effattn-{b}", "effattn", b) for b in backends] + \
                [(n, "baseline", n) for n in sec.baselines if device.type == "cuda" or n == "sdpa-flash"]
        for name, kind, what in impls:
            try:
                fn = _effattn_fn(what, q, k, v, causal=True) if kind == "effattn" else \
                    _sdpa_gqa({"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}[what], q, k, v)
            except registry.Unsupported as e:
                fn = _unsupported(e)
            for mode in sec.modes:
                row = dict(variant=f"causal-gqa{H // Hkv}", op="attention", impl=name, kind=kind, mode=mode,
                           dtype=str(dtype).replace("torch.", ""), B=B, H=H, L=L, D=D, time_ms=None, tflops=None,
                           peak_mem_mib=None, flops=attention_flops(B, H, D, L, L, causal=True),
                           visible_frac=(L + 1) / (2 * L), max_diff=f"Hkv={Hkv}")
                if time.monotonic() > deadline:
                    rows.append({**row, "status": "skipped: section budget"})
                    continue
                rows.append(_time_row(row, fn, (q, k, v), dout, mode, device))
        q = k = v = dout = None
        measure.free_memory(device)
    return rows


def doc_lengths(B: int, L: int, seed: int = 0) -> List[int]:
    """B document lengths in [1, L] averaging about L / 2 (50% padding when padded to L), fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, L + 1, (B,), generator=g).tolist()


def packed_rows(sec: Section, backends, device, deadline: float) -> List[dict]:
    """Packed against padded causal attention at length L: B documents of random lengths (about 50%
    padding) as one packed row with ``cu_seqlens`` and ``max_seqlen`` (no host read for the CUDA kernels)
    against a (B, H, L, D) batch with a key padding mask, per effattn backend, forward and
    forward+backward; FLOPs count the documents' visible pairs in both, so TFLOP/s compare work done."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    L, (B, H), D = sec.lengths[0], sec.shape(sec.lengths[0]), sec.head_dim
    lengths = doc_lengths(B, L)
    T = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_()

    packed = (rnd(1, H, T, D), rnd(1, H, T, D), rnd(1, H, T, D))
    padded = (rnd(B, H, L, D), rnd(B, H, L, D), rnd(B, H, L, D))
    kpm = torch.arange(L, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    douts = {"packed": torch.randn(1, H, T, D, generator=g, device=device, dtype=dtype),
             "padded": torch.randn(B, H, L, D, generator=g, device=device, dtype=dtype)}
    flops = sum(attention_flops(1, H, D, n, n, causal=True) for n in lengths)
    rows = []
    for b in backends:
        for layout, leaves, kw in (("packed", packed, dict(cu_seqlens=cu, max_seqlen=max(lengths))),
                                   ("padded", padded, dict(key_padding_mask=kpm))):
            try:
                fn = _effattn_fn(b, *leaves, causal=True, **kw)
            except registry.Unsupported as e:
                fn = _unsupported(e)
            for mode in sec.modes:
                row = dict(variant=f"causal-{layout}", op="attention", impl=f"effattn-{b}", kind="effattn",
                           mode=mode, dtype=str(dtype).replace("torch.", ""), B=B, H=H, L=L, D=D, time_ms=None,
                           tflops=None, peak_mem_mib=None, flops=flops, visible_frac=None,
                           max_diff=f"{B} documents, {T} tokens of {B * L}")
                if time.monotonic() > deadline:
                    rows.append({**row, "status": "skipped: section budget"})
                    continue
                rows.append(_time_row(row, fn, leaves, douts[layout], mode, device))
    measure.free_memory(device)
    return rows


def host_rows(sec: Section, backends, device, deadline: float) -> List[dict]:
    """Host overhead per call: a tiny causal call (B, H, L, D = HOST_SHAPE) issued back to back, wall
    time per call over a batch of calls then one synchronize (the GPU is idle most of that time, so
    this is the host's cost of a call), for forward and forward+backward; SDPA flash beside. The
    GPU time of the same call (do_bench) is in ``max_diff``."""
    B, H, L, D = HOST_SHAPE if device.type == "cuda" else (1, 2, sec.lengths[0], sec.head_dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, dout = (torch.randn(B, H, L, D, device=device, dtype=dtype) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    impls = [(f"effattn-{b}", "effattn", b) for b in backends] + [(n, "baseline", n) for n in sec.baselines]
    rows = []
    for name, kind, what in impls:
        for mode in sec.modes:
            row = dict(variant="host-overhead", op="attention", impl=name, kind=kind, mode=mode,
                       dtype=str(dtype).replace("torch.", ""), B=B, H=H, L=L, D=D, time_ms=None, tflops=None,
                       peak_mem_mib=None, flops=None, visible_frac=None, max_diff="")
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            try:
                fn = _effattn_fn(what, *leaves, causal=True) if kind == "effattn" else \
                    _sdpa_gqa("FLASH_ATTENTION", *leaves)
                step = (lambda: fn().detach()) if mode == "fwd" else \
                    (lambda: torch.autograd.grad(fn(), leaves, dout))
                if mode == "fwd":
                    step = _no_grad(step)
                us = per_call_us(step, device, 200 if device.type == "cuda" else 5)
                gpu_ms = measure.time_ms(step, device, budget_s=0.1 if device.type == "cuda" else 0.01)
                rows.append({**row, "status": "ok", "time_ms": us / 1e3, "max_diff": f"device {gpu_ms:.4f} ms"})
            except registry.Unsupported as e:
                rows.append({**row, "status": f"unsupported: {e}"})
            except Exception as e:                          # noqa: BLE001 - recorded
                rows.append({**row, "status": f"error: {measure.one_line(e)}"})
    return rows


def _no_grad(fn):
    def wrapped():
        with torch.no_grad():
            return fn()
    return wrapped


def per_call_us(step, device, calls: int = 200) -> float:
    """Median over 5 rounds of the wall microseconds per call of `calls` back-to-back calls and one
    synchronize (after a warm-up round)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = []
    for i in range(6):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        if i:
            rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(rounds)[2]


def copy_bandwidth(device) -> float:
    """Bytes per second of a device copy (read + written), the decode rows' memory bound."""
    buf = torch.empty(1 << (28 if device.type == "cuda" else 22), dtype=torch.uint8, device=device)
    copy = torch.empty_like(buf)
    ms_copy = measure.time_ms(lambda: copy.copy_(buf), device, budget_s=0.2)
    return 2 * buf.numel() / (ms_copy * 1e-3)


def paged_inputs(B: int, H: int, Hkv: int, Lk: int, D: int, device, dtype, seed: int = 0):
    """``q (B, H, 1, D)``, pools of ``B * Lk / PAGE_SIZE`` pages shuffled over the pool, the block
    table, seqlens (every row full) and the contiguous ``k``, ``v (B, Hkv, Lk, D)`` holding the same keys."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = Lk // PAGE_SIZE
    kp, vp = (torch.randn(B * n, PAGE_SIZE, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    table = torch.randperm(B * n, device=device, generator=g).view(B, n).to(torch.int32)
    lens = torch.full((B,), Lk, dtype=torch.int32, device=device)
    q = torch.randn(B, H, 1, D, device=device, dtype=dtype, generator=g)
    k, v = (p[table.long()].reshape(B, Lk, Hkv, D).transpose(1, 2).contiguous() for p in (kp, vp))
    return q, kp, vp, table, lens, k, v


def _paged_fn(impl: str, q, kp, vp, table, lens, k, v):
    import effattn
    from effattn.paged import gather_pages
    if impl == "effattn-paged-triton":
        why = effattn.explain(q, kp, vp, block_table=table, seqlens=lens, causal=True).row("triton/paged").reasons
        if why:
            raise registry.Unsupported("; ".join(why))
        return lambda: effattn.attention(q, kp, vp, block_table=table, seqlens=lens, causal=True, backend="triton")
    if impl == "gather+sdpa":
        def fn():                                  # the pages gathered by torch, then SDPA (GQA)
            kc, vc = gather_pages(kp, table, lens), gather_pages(vp, table, lens)
            return torch.nn.functional.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        return fn
    return _effattn_fn(impl.rsplit("-", 1)[1], q, k, v, causal=True)


def _decode_shapes(sec: Section, device):
    """``(Lk, H, Hkv, D, dtype)`` of a decode-shaped section and, per batch size (1 and 4), ``(B, the
    memory-bound time in ms: K and V bytes over the measured copy bandwidth)``."""
    Lk, H, D = sec.lengths[0], sec.heads, sec.head_dim
    Hkv = sec.kv_heads or max(1, H // 4)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device)
    bounds = [(B, 2 * B * Hkv * Lk * D * torch.finfo(dtype).bits // 8 / bandwidth * 1e3) for B in (1, 4)]
    return (Lk, H, Hkv, D, dtype), bounds


def _decode_row(variant: str, op: str, impl: str, kind: str, dtype, B: int, H: int, Lk: int, D: int,
                bound_ms: float) -> dict:
    return dict(variant=variant, op=op, impl=impl, kind=kind, mode="fwd", dtype=str(dtype).replace("torch.", ""),
                B=B, H=H, L=Lk, D=D, time_ms=None, tflops=None, peak_mem_mib=None,
                flops=attention_flops(B, H, D, 1, Lk, causal=True), visible_frac=None, max_diff=f"bound {bound_ms:.4f}")


def _time_decode(row: dict, make_fn, device, deadline: float):
    """``(row, output)``: `row` timed on ``make_fn()`` (forward, no grad) with its output, or skipped /
    unsupported / error with ``None``."""
    if time.monotonic() > deadline:
        return {**row, "status": "skipped: section budget"}, None
    try:                                          # explain() says what cannot run
        with torch.no_grad():
            fn = make_fn()
            out = fn()
            ms = measure.time_ms(fn, device, budget_s=0.2)
        return {**row, "status": "ok", "time_ms": ms, "tflops": tflops(row["flops"], ms)}, out
    except registry.Unsupported as e:
        return {**row, "status": f"unsupported: {e}"}, None
    except Exception as e:                                 # noqa: BLE001 - recorded
        return {**row, "status": f"error: {measure.one_line(e)}"}, None


def paged_rows(sec: Section, backends, device, deadline: float) -> List[dict]:
    """A decode step (one query row, causal) over a paged cache of full sequences (pages of 16
    shuffled over the pool): each of `paged_impls`, with the memory-bound time in ``max_diff``
    (``bound <ms>``) as the decode rows have it, and the largest difference from the first output."""
    (Lk, H, Hkv, D, dtype), bounds = _decode_shapes(sec, device)
    rows = []
    for B, bound in bounds:
        inputs = paged_inputs(B, H, Hkv, Lk, D, device, dtype)
        ref = None
        for impl in paged_impls(backends):
            kind = "baseline" if impl == "gather+sdpa" else "effattn"
            row = _decode_row("paged", "paged_attention", impl, kind, dtype, B, H, Lk, D, bound)
            row, out = _time_decode(row, lambda impl=impl: _paged_fn(impl, *inputs), device, deadline)
            if out is not None:
                ref = out.float() if ref is None else ref
                row["max_diff"] += f" |diff| {(out.float() - ref).abs().max().item():.2g}"
            rows.append(row)
    return rows


def decode_rows(sec: Section, backends, device, deadline: float) -> List[dict]:
    """One query row (causal) against Lk keys, H=32 query heads on Hkv=8 KV heads: time per effattn
    backend, next to the memory-bound time = bytes of K and V / measured copy bandwidth (in the
    ``max_diff`` column: ``bound <ms>``)."""
    (Lk, H, Hkv, D, dtype), bounds = _decode_shapes(sec, device)
    cases = []
    for B, bound in bounds:
        q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
        k, v = (torch.randn(B, Hkv, Lk, D, device=device, dtype=dtype) for _ in range(2))
        for b in backends:
            row = _decode_row("decode", "attention", f"effattn-{b}", "effattn", dtype, B, H, Lk, D, bound)
            cases.append((row, lambda b=b, q=q, k=k, v=v: _effattn_fn(b, q, k, v, causal=True)))
    # every case run once before any is timed: the first timed row then follows no compile (an idle GPU
    # meanwhile) and no other row's first call. The H200 run of 2026-11-27 timed its first row (Triton,
    # B = 1: 0.232 ms) at twice the time of B = 4 (0.118), which reads 4x the bytes with the same grid size
    for _, make in cases:
        try:
            with torch.no_grad():
                make()()
        except Exception:                                    # noqa: BLE001 - the timed pass records it
            pass
    return [_time_decode(row, make, device, deadline)[0] for row, make in cases]


def check_rows(backends, device, deadline: float) -> List[dict]:
    """CUDA-graph replay and torch.compile against eager, with the configs the suite tuned (a
    check not started by ``deadline`` is recorded as skipped)."""
    import effattn
    rows = []
    for b in backends:
        q, k, v, go = (torch.randn(1, 16, 4096, 128, device=device, dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            out = effattn.attention(*leaves, causal=True, backend=b)
            return (out,) + torch.autograd.grad(out, leaves, go)

        def f(q, k, v):
            return effattn.attention(q, k, v, causal=True, backend=b)

        for name, check in (("graph replay == eager", lambda: (checks.graph_replay_matches_eager(step), 0.0)),
                            ("torch.compile == eager", lambda: checks.compile_matches_eager(f, leaves))):
            row = dict(section="checks", variant=name, op="attention", impl=f"effattn-{b}", kind="effattn",
                       mode="fwdbwd", dtype="bfloat16", B=1, H=16, L=4096, D=128)
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            try:
                same, diff = check()
                ok = all(same) if name.startswith("graph") else diff < 1e-2
                rows.append({**row, "status": "ok" if ok else "FAIL", "max_diff": f"bitwise {same} |diff| {diff:.2g}"})
            except Exception as e:                                 # noqa: BLE001 - recorded
                rows.append({**row, "status": f"error: {measure.one_line(e)}"})
    return rows
