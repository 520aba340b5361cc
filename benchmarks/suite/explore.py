"""The suite's explore and re-check sections: what the autotuners time and pick, and whether what
they pick is correct at the suite's shapes.

- ``explore``: once per kind of call of the suite (what the autotuners key on: mask mode, head dim,
  dtype, length buckets), one effattn call at the suite's shape with autotuning on. Every candidate
  config of every kernel role (forward, dK/dV, dQ, the linear passes, ...) is timed by the
  backend's own autotuner; `tuning_log` records each timing with the kernel variant it launched,
  and the configs the autotuners kept. Written to ``explore.json`` in the output folder; the later
  sections reuse the choices (the autotuners' caches) instead of tuning again.
  With ``trial_candidates`` (the suite's default; ``--no-trials`` leaves it out) the softmax
  forward's autotuner also times each 2-byte candidate with the K / V loads through TMA (the
  forward's ``KV_TMA`` trial, a 5th config element "tma"): compiled and correct offline and in the
  interpreter, its speed is the GPU's to say (benchmarks/results/offline-sm90/tma_ws_trials.md).
  When such a candidate wins, the later sections run with it and the re-check checks it.
- ``recheck``: each kind of call again, on fresh inputs at a smaller batch in the same length
  bucket (so with the same tuned configs), forward and backward against the float64 chunked
  reference of effattn.testing.oracle by the project's rule (error at most 2x the naive computation's in
  the same dtype for the output, 3x for gradients, plus a small floor; no NaN), with the kernel
  configs each call actually launched.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from effattn.testing import oracle

from .. import measure
from . import kernels

FLOOR = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}     # as the GPU tests'
RECHECK_MAX_TOKENS = 8192          # B * L of a re-check (B = 1 beyond it); H as planned, at most 8


def tuning_key(c: kernels.Call) -> tuple:
    """What effattn's autotuners key a call on, roughly: op, mask mode, head dim, dtype, direction and
    the length buckets (powers of two capped at 8192); calls with equal keys share tuned configs.
    Whether the call is GQA is added: the autotuners do not key on it, the re-check does."""
    mode = "layout" if c.layout is not None else ("window" if c.window else ("causal" if c.causal else "dense"))
    if c.op != "attention":
        mode = f"{c.feature_map}{c.features or ''}{'' if c.normalize else '-unnormalized'}"
    bucket = lambda n: min(1 << max(n - 1, 0).bit_length(), RECHECK_MAX_TOKENS)     # noqa: E731
    return c.op, mode, c.D, str(c.dtype), c.backward, bucket(c.Lq), bucket(c.Lk), c.H != c.Hkv


def distinct_calls(calls: Sequence[kernels.Call]) -> List[kernels.Call]:
    """The first call of each `tuning_key`; a backward call stands for its forward-only twin."""
    out: Dict[tuple, kernels.Call] = {}
    for c in sorted(calls, key=lambda c: not c.backward):
        k = tuning_key(c)
        if k[:4] + k[5:] in {key[:4] + key[5:] for key, o in out.items() if o.backward}:   # all but direction
            continue
        out.setdefault(k, c)
    return list(out.values())


@contextlib.contextmanager
def trial_candidates(on: bool = True):
    """Within (when `on`): the softmax forward's candidates for fp16 / bf16 are followed by the same
    configs with the ``KV_TMA`` trial switch (see the module docstring)."""
    from effattn.backends.triton.attention import launch
    real = launch.candidates

    def with_trials(kind, head_class, element_size, **kw):
        cands = list(real(kind, head_class, element_size, **kw))
        if kind == "fwd" and element_size == 2:
            cands += [c + ("tma",) for c in cands]
        return cands

    if on:
        launch.candidates = with_trials
    try:
        yield
    finally:
        launch.candidates = real


@contextlib.contextmanager
def tuning_log():
    """Within: every ``do_bench`` of effattn's autotuners appends {module, kernels (the variants the
    timed function launched), ms} to the yielded list."""
    log: List[dict] = []
    mods = [m for m in kernels.triton_modules() if hasattr(m, "do_bench")]
    saved = [(m, m.do_bench) for m in mods]

    def wrap(m, real):
        def timed(fn, *a, **k):
            with kernels.spy(launch=True) as seen:
                fn()                                       # one call to see what it launches
            entry = dict(module=m.__name__.rsplit(".", 2)[-2], kernels=[v.describe().strip() for v in seen])
            try:
                entry["ms"] = float(real(fn, *a, **k))
            except Exception as e:                         # noqa: BLE001 - the autotuner skips it too
                entry["error"] = measure.one_line(e)
                log.append(entry)
                raise
            log.append(entry)
            return entry["ms"]
        return timed

    for m, real in saved:
        m.do_bench = wrap(m, real)
    try:
        yield log
    finally:
        for m, real in saved:
            m.do_bench = real


def tuned_configs() -> Dict[str, list]:
    """The autotuners' caches: {module: [[key..., config], ...]} (JSON-ready)."""
    out = {}
    for m in kernels.triton_modules():
        tuned = getattr(m, "_TUNED", None)
        if isinstance(tuned, dict) and tuned:
            out[m.__name__] = [[repr(x) for x in k] + [list(v) if isinstance(v, tuple) else repr(v)]
                               for k, v in tuned.items()]
    return out


def tensors(c: kernels.Call, device, seed: int = 0):
    """q, k, v, dout for `c` on `device` (standard normal; q, k scaled down for linear identity /
    FAVOR+), and F (the features the kernels see)."""
    g = torch.Generator(device=device).manual_seed(seed)
    F = c.features or c.D
    # linear attention as tests/contract/test_gpu.py: smaller inputs where the features grow fast
    s = {"identity": 0.3, "favor": 0.5}.get(c.feature_map, 1.0) if c.op != "attention" else 1.0
    q = (s * torch.randn(c.B, c.H, c.Lq, c.D, generator=g, device=device)).to(c.dtype)
    k = (s * torch.randn(c.B, c.Hkv, c.Lk, c.D, generator=g, device=device)).to(c.dtype)
    v = torch.randn(c.B, c.Hkv, c.Lk, c.D, generator=g, device=device).to(c.dtype)
    dout = torch.randn(c.B, c.H, c.Lq, c.D, generator=g, device=device).to(c.dtype)
    return q, k, v, dout, F


class NotServed(Exception):
    """The backend cannot serve the call; the message is `effattn.explain`'s reasons."""


def run_call(c: kernels.Call, backend: str, q, k, v, dout):
    """effattn's output (and q, k, v gradients when ``c.backward``) for call `c`; NotServed when
    `effattn.explain` says the backend cannot serve it."""
    import effattn
    if c.op == "attention":
        kw, fn = dict(causal=c.causal, window=c.window, layout=c.layout), effattn.attention
    else:
        fm = effattn.FavorFeatures(c.D, c.features, seed=0).to(q.device) if c.feature_map == "favor" \
            else c.feature_map
        kw, fn = dict(causal=c.causal, feature_map=fm, normalize=c.normalize), effattn.linear_attention
    why = effattn.explain(q, k, v, op=c.op, **kw).reasons.get(backend, ["unknown backend"])
    if why:
        raise NotServed("; ".join(why))
    leaves = [t.detach().requires_grad_(c.backward) for t in (q, k, v)]
    with torch.set_grad_enabled(c.backward):
        out = fn(*leaves, backend=backend, **kw)
        grads = torch.autograd.grad(out, leaves, dout) if c.backward else ()
    return (out.detach(),) + tuple(grads)


def explore(calls: Sequence[kernels.Call], backends: Sequence[str], device, deadline: float,
            out_dir: Path) -> List[dict]:
    """Autotunes each distinct kind of call (see the module docstring) with every timing logged;
    writes ``explore.json``; returns one row per (backend, call)."""
    rows, record = [], dict(calls=[], tuned={})
    for c in distinct_calls(calls):
        for b in backends:
            row = _row("explore", c, b)
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            t0 = time.monotonic()
            try:
                q, k, v, dout, _ = tensors(c, device)
                with tuning_log() as log:
                    run_call(c, b, q, k, v, dout)
                torch.cuda.synchronize(device) if device.type == "cuda" else None
                row.update(status="ok", time_ms=None, max_diff=f"{len(log)} timings, {time.monotonic() - t0:.1f} s")
            except NotServed as e:
                log, row["status"] = [], f"unsupported: {e}"
            except Exception as e:                         # noqa: BLE001 - recorded
                log = locals().get("log", [])
                row["status"] = f"error: {measure.one_line(e)}"
            record["calls"].append(dict(call=_describe(c), backend=b, key=[repr(x) for x in tuning_key(c)],
                                        status=row["status"], timings=log))
            rows.append(row)
            q = k = v = dout = None
            measure.free_memory(device)
            record["tuned"] = tuned_configs()
            (out_dir / "explore.json").write_text(json.dumps(record, indent=1))
    return rows


def recheck_call(c: kernels.Call) -> kernels.Call:
    """`c` smaller with the same `tuning_key`: lengths past the last bucket (8192) cut to it (a
    layout to its top-left blocks: for sliding_and_summary the same pattern at that length), B * L
    <= RECHECK_MAX_TOKENS (B >= 1), H <= 8 (the GQA group kept)."""
    Lq, Lk = (min(n, RECHECK_MAX_TOKENS) for n in (c.Lq, c.Lk))
    layout = c.layout
    if layout is not None:
        from effattn.layouts import BlockLayout
        bs = layout.block_size
        layout = BlockLayout(layout.mask[:, :-(-Lq // bs), :-(-Lk // bs)], bs)
    G = c.H // c.Hkv
    H = min(c.H, max(8, G))
    return dataclasses.replace(c, B=max(1, min(c.B, RECHECK_MAX_TOKENS // max(Lq, 1))), H=H, Hkv=max(1, H // G),
                               Lq=Lq, Lk=Lk, layout=layout)


def recheck(calls: Sequence[kernels.Call], backends: Sequence[str], device, deadline: float) -> List[dict]:
    """Each distinct kind of call at `recheck_call`'s size against the float64 chunked oracle, with
    the configs the autotuners picked (a kind not tuned yet is tuned here); one row per (backend,
    call): status ok / FAIL, the errors and the kernel configs launched."""
    rows = []
    for c in [recheck_call(x) for x in distinct_calls(calls)]:
        c = c if c.backward else dataclasses.replace(c, backward=True)
        for b in backends:
            row = _row("recheck", c, b)
            if time.monotonic() > deadline:
                rows.append({**row, "status": "skipped: section budget"})
                continue
            try:
                q, k, v, dout, F = tensors(c, device, seed=1)
                with kernels.spy(launch=True) as seen:
                    got = run_call(c, b, q, k, v, dout)
                ref, low = _oracle(c, q, k, v, dout)
                problems, errs = judge(got, ref, low, c.dtype)
                cfgs = sorted({v.describe().split("  ")[0] for v in seen})
                row.update(status="FAIL: " + "; ".join(problems) if problems else "ok",
                           max_diff=" ".join(f"{n}={e:.2g}/{ne:.2g}" for n, e, ne in errs)
                           + "".join(" | " + x for x in cfgs))
            except NotServed as e:
                row["status"] = f"unsupported: {e}"
            except Exception as e:                         # noqa: BLE001 - recorded
                row["status"] = f"error: {measure.one_line(e)}"
            rows.append(row)
            measure.free_memory(device)
    return rows


def _oracle(c, q, k, v, dout):
    """(float64 reference, the naive computation in the input dtype): out, dq, dk, dv each."""
    if c.op == "attention":
        kw = dict(causal=c.causal, window=c.window, layout=c.layout)
        return (oracle.chunked_attention(q, k, v, dout.double(), dtype=torch.float64, **kw),
                oracle.chunked_attention(q, k, v, dout, dtype=c.dtype, **kw))
    import effattn
    favor = effattn.FavorFeatures(c.D, c.features, seed=0).to(q.device) if c.feature_map == "favor" else None
    phi = oracle.feature_map(c.feature_map, favor=favor)
    kw = dict(causal=c.causal, normalize=c.normalize)
    return (oracle.chunked_linear_attention(q, k, v, dout.double(), phi, dtype=torch.float64, **kw),
            oracle.chunked_linear_attention(q, k, v, dout, phi, dtype=c.dtype, **kw))


def judge(got, ref, low, dtype, names=("out", "dq", "dk", "dv")):
    """The low-precision rule: |got - ref| <= m |naive - ref| + floor (m = 2 out, 3 gradients), no
    NaN. Returns (problems, [(name, error, naive error)])."""
    problems, errs = [], []
    for name, x, r, lo, mult in zip(names, got, ref, low, (2, 3, 3, 3)):
        if torch.isnan(x).any():
            problems.append(f"{name}: NaN")
            continue
        err = (x.double() - r.double()).abs().max().item() if x.numel() else 0.0
        nerr = (lo.double() - r.double()).abs().max().item() if x.numel() else 0.0
        errs.append((name, err, nerr))
        if err > mult * nerr + FLOOR[dtype]:
            problems.append(f"{name}: error {err:.3g} > {mult} x naive {nerr:.3g} + floor")
    return problems, errs


def _describe(c: kernels.Call) -> str:
    what = ("window" if c.window else "causal" if c.causal else "dense") if c.op == "attention" else c.feature_map
    if c.layout is not None:
        what = f"layout{c.layout.block_size}"
    if c.H != c.Hkv:
        what += f"-gqa{c.H // c.Hkv}"
    if c.Lq == 1:
        what = "decode-" + what
    return (f"{c.op} {what} B={c.B} H={c.H} Hkv={c.Hkv} Lq={c.Lq} Lk={c.Lk} D={c.D} {str(c.dtype)[6:]}"
            f"{' fwd+bwd' if c.backward else ' fwd'}")


def _row(section: str, c: kernels.Call, backend: str) -> dict:
    what = _describe(c).split(" B=")[0].split(" ", 1)[1]
    return dict(section=section, variant=what, op=c.op, impl=f"effattn-{backend}", kind="effattn",
                mode="fwdbwd" if c.backward else "fwd", dtype=str(c.dtype).replace("torch.", ""), B=c.B, H=c.H,
                L=c.Lk, D=c.D, status="", time_ms=None, tflops=None, peak_mem_mib=None, flops=None,
                visible_frac=None, max_diff="")
