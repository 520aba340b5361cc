"""One-call GPU check of the Triton backend: correctness at real sizes in bf16, then timing against
SDPA (FlashAttention-2 and cuDNN kernels) and torch.compile(flex_attention), printed as tables.

    python3 benchmarks/triton_gpu_check.py --quick    # from the repo root; check + L = 4096 timings, no flex
    python3 benchmarks/triton_gpu_check.py            # + L = 16384 and flex (compiles a lot: allow ~10 min)

The first call of each kind of call autotunes (compiles and times a handful of configs), so the
first table rows take longest; results are printed as they come, so a run cut short keeps them.

Correctness: forward and gradients against the float64 oracle (tests/oracle.py), judged by the
project's rule: error at most 2x (out) / 3x (grads) the error of the same dense computation done
naively in bf16. Timing: medians of triton.testing.do_bench on random inputs; TFLOP/s count
4*B*H*(visible pairs)*D for forward and 3.5x that for forward+backward.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import effattn  # noqa: E402
from effattn.layouts import sliding_and_summary  # noqa: E402
from oracle import naive_attention  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16


def log(*a):
    print(*a, flush=True)


def visible_pairs(L, causal, left, layout):
    """Exact number of visible (i, j) pairs of one head, counted in row chunks."""
    n = 0
    for i0 in range(0, L, 2048):
        i = torch.arange(i0, min(i0 + 2048, L), device=DEV)[:, None]
        j = torch.arange(L, device=DEV)[None, :]
        ok = torch.ones(i.shape[0], L, dtype=torch.bool, device=DEV)
        if causal:
            ok &= j <= i
        if left is not None:
            ok &= j >= i - left
        if layout is not None:
            bs = layout.block_size
            ok &= layout.mask[0][i[:, 0] // bs][:, j[0] // bs]
        n += int(ok.sum())
    return n


# ------------------------------------------------------------------------------------ correctness

def check_correctness():
    log("\n## correctness, bf16 vs float64 oracle (ratio = error / naive-bf16 error; limit 2 out, 3 grads)\n")
    log("| case | out | dq | dk | dv | verdict |")
    log("|---|---|---|---|---|---|")
    L = 4096
    cases = {
        "dense B1 H8 L4k D128": (8, 8, 128, {}),
        "causal GQA H8/Hkv2 L4k D128": (8, 2, 128, dict(causal=True)),
        "window 512 causal L4k D64": (8, 8, 64, dict(causal=True, window=512)),
        "fixed layout bs128 causal L4k D128": (8, 8, 128, dict(causal=True, layout=sliding_and_summary(L, 128, 4, 8))),
        "dense D256 H4 L4k": (4, 4, 256, {}),
    }
    ok_all = True
    for name, (H, Hkv, D, kw) in cases.items():
        torch.manual_seed(0)
        if "layout" in kw:
            kw = dict(kw, layout=kw["layout"].to(DEV))
        q = torch.randn(1, H, L, D, device=DEV, dtype=DT)
        k, v = (torch.randn(1, Hkv, L, D, device=DEV, dtype=DT) for _ in range(2))
        go = torch.randn(1, H, L, D, device=DEV, dtype=DT)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, backend="triton", **kw)
        got = (out,) + torch.autograd.grad(out, leaves, go)
        results = []
        for dtype in (torch.float64, DT):
            lv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            o, _ = naive_attention(*lv, dtype=dtype, **kw)
            results.append((o.detach(),) + torch.autograd.grad(o, lv, go.to(dtype)))
            del o, lv
        ref, low = results
        ratios, verdict = [], "PASS"
        for g, r, lo, mult in zip(got, ref, low, (2, 3, 3, 3)):
            err = (g.double() - r).abs().max().item()
            nerr = (lo.double() - r).abs().max().item()
            ratios.append(err / max(nerr, 1e-12))
            if not math.isfinite(err) or err > mult * nerr + 8e-3:
                verdict = "FAIL"
        ok_all &= verdict == "PASS"
        log(f"| {name} | " + " | ".join(f"{x:.2f}" for x in ratios) + f" | {verdict} |")
        del got, results, ref, low
        torch.cuda.empty_cache()
    # determinism
    q, k, v, go = (torch.randn(1, 8, 4096, 128, device=DEV, dtype=DT) for _ in range(4))
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, causal=True, backend="triton")
        grads.append(torch.autograd.grad(out, leaves, go))
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    log(f"\nbackward bitwise deterministic over 2 runs: {same}")
    return ok_all and same


# ---------------------------------------------------------------------------------------- timing

def flex_fn(L, causal, left, layout):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    lay = layout.mask[0] if layout is not None else None
    bs = layout.block_size if layout is not None else 1

    def mask_mod(b, h, qi, kj):
        ok = qi >= 0
        if causal:
            ok = ok & (kj <= qi)
        if left is not None:
            ok = ok & (kj >= qi - left)
        if lay is not None:
            ok = ok & lay[qi // bs, kj // bs]
        return ok

    bm = create_block_mask(mask_mod, None, None, L, L, device=DEV, _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=bm)


def sdpa_fn(backend, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fn(q, k, v):
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def bench(fn, q, k, v, go, mode):
    if mode == "fwd":
        return do_bench(lambda: fn(q, k, v), return_mode="median")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return do_bench(lambda: fn(*leaves).backward(go), grad_to_none=leaves, return_mode="median")


def timings(lengths, use_flex):
    B, H, D = 1, 16, 128
    log(f"\n## timing, bf16, B={B} H={H} D={D}, ms (median) and effattn TFLOP/s\n")
    log("| pattern | L | mode | effattn triton | TFLOP/s | SDPA flash | SDPA cuDNN | flex |")
    log("|---|---|---|---|---|---|---|---|")
    for L in lengths:
        patterns = {
            "dense": (False, None, None),
            "causal": (True, None, None),
            "window 1024 causal": (True, 1024, None),
            "fixed bs128 4 local + every 16th, causal": (True, None, sliding_and_summary(L, 128, 4, 16).to(DEV)),
        }
        q, k, v, go = (torch.randn(B, H, L, D, device=DEV, dtype=DT) for _ in range(4))
        for name, (causal, left, layout) in patterns.items():
            kw = dict(causal=causal, layout=layout)
            if left is not None:
                kw["window"] = (left, 0)
            ours = lambda q, k, v, kw=kw: effattn.attention(q, k, v, backend="triton", **kw)  # noqa: E731
            others = {}
            if left is None and layout is None:
                others = {"flash": sdpa_fn("flash", causal), "cudnn": sdpa_fn("cudnn", causal)}
            if use_flex:
                try:
                    others["flex"] = flex_fn(L, causal, left, layout)
                except Exception as e:  # noqa: BLE001
                    log(f"(flex unavailable for {name}: {type(e).__name__}: {e})")
            flops = 4 * B * H * visible_pairs(L, causal, left, layout) * D
            for mode in ("fwd", "fwd+bwd"):
                row = {}
                for label, fn in [("ours", ours)] + list(others.items()):
                    try:
                        row[label] = bench(fn, q, k, v, go, mode)
                    except Exception as e:  # noqa: BLE001
                        log(f"({label} failed on {name} L={L} {mode}: {type(e).__name__}: {str(e)[:200]})")
                t = row.get("ours")
                tf = (flops * (3.5 if mode != "fwd" else 1.0) / (t * 1e-3) / 1e12) if t else float("nan")
                cells = [f"{row[c]:.3f}" if c in row else "-" for c in ("ours",)] + [f"{tf:.0f}"] + \
                        [f"{row[c]:.3f}" if c in row else "-" for c in ("flash", "cudnn", "flex")]
                log(f"| {name} | {L} | {mode} | " + " | ".join(cells) + " |")
        del q, k, v, go
        torch.cuda.empty_cache()


def memory_check():
    log("\n## peak extra memory, fwd+bwd, B=1 H=8 D=64 causal bf16 (beyond inputs, grads, outputs)\n")
    for L in (4096, 16384):
        q, k, v, go = (torch.randn(1, 8, L, 64, device=DEV, dtype=DT) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        for label, fn in (("effattn triton", lambda *a: effattn.attention(*a, causal=True, backend="triton")),
                          ("SDPA flash", sdpa_fn("flash", True))):
            out = fn(*leaves)
            torch.autograd.grad(out, leaves, go)
            del out
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, go)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            log(f"L={L:6d} {label:15s} peak over inputs: {peak / 2**20:8.1f} MiB")
            del out, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="L=4096 timings only, no flex")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {__import__('triton').__version__}")
    log(effattn.explain(*(torch.randn(1, 2, 64, 64, device=DEV, dtype=DT) for _ in range(3)), causal=True))
    ok = True
    if not args.skip_check:
        ok = check_correctness()
    memory_check()
    timings([4096] if args.quick else [4096, 16384], use_flex=not (args.quick or args.no_flex))
    log(f"\ncorrectness: {'PASS' if ok else 'FAIL'}; total {time.time() - t0:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
