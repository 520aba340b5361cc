"""The split-KV decode's per-warp key sub-ranges, a trial compiled offline (no GPU).

The decode kernel (effattn/backends/triton/attention/decode.py) walks a (rows x BLOCK_N) score tile:
Triton spreads its key columns over the warps, so each tile's row max and row sum cross warps (shared
memory and CTA barriers). Per-warp key sub-ranges are expressible as a 3-D batched dot: W sub-ranges of
BLOCK_N / W keys on the batch axis, which Triton gives one warp each (mma v2), so the online softmax
runs per warp and the warps' (m, l, acc) merge once after the loop. This compiles the loop's skeleton
both ways (no masks: the same loads, products and softmax) for sm_90 and reports what
tools.triton.kernel_resources reads from the SASS:

    python -m tools.triton.decode_warp_trials                  # D = 128, 16 rows, 64 keys a tile, 4 warps

Run it without ``TRITON_INTERPRET=1``. The result (benchmarks/results/offline-sm90/decode_warp_trials.md)
is why the decode kernel does not take it yet: see there.
"""
from __future__ import annotations

import argparse
import sys

import triton
import triton.language as tl


@triton.jit
def flat(Q, K, V, O, n_tiles, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, BM)
    d = tl.arange(0, D)
    n = tl.arange(0, BN)
    q = tl.load(Q + r[:, None] * D + d[None, :])
    m = tl.full((BM,), float("-inf"), tl.float32)
    l = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for t in range(n_tiles):
        kt = tl.load(K + (t * BN + n)[None, :] * D + d[:, None])
        s = tl.dot(q, kt)
        mn = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - mn[:, None])
        a = tl.exp2(m - mn)
        l = l * a + tl.sum(p, 1)
        v = tl.load(V + (t * BN + n)[:, None] * D + d[None, :])
        acc = acc * a[:, None] + tl.dot(p.to(v.dtype), v)
        m = mn
    tl.store(O + r[:, None] * D + d[None, :], acc / l[:, None])


@triton.jit
def per_warp(Q, K, V, O, n_tiles, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, W: tl.constexpr):
    SUB: tl.constexpr = BN // W
    r = tl.arange(0, BM)
    d = tl.arange(0, D)
    w = tl.arange(0, W)
    j = tl.arange(0, SUB)
    q = tl.load(Q + r[:, None] * D + d[None, :])
    q3 = tl.broadcast_to(q[None, :, :], (W, BM, D))
    m = tl.full((W, BM), float("-inf"), tl.float32)
    l = tl.zeros((W, BM), tl.float32)
    acc = tl.zeros((W, BM, D), tl.float32)
    for t in range(n_tiles):
        key = t * BN + w[:, None] * SUB + j[None, :]                        # (W, SUB): sub-range w
        kt = tl.load(K + key[:, None, :] * D + d[None, :, None])              # (W, D, SUB)
        s = tl.dot(q3, kt)                                                    # (W, BM, SUB)
        mn = tl.maximum(m, tl.max(s, 2))
        p = tl.exp2(s - mn[:, :, None])
        a = tl.exp2(m - mn)
        l = l * a + tl.sum(p, 2)
        v = tl.load(V + key[:, :, None] * D + d[None, None, :])               # (W, SUB, D)
        acc = acc * a[:, :, None] + tl.dot(p.to(v.dtype), v)
        m = mn
    mt = tl.max(m, 0)                                                         # one cross-warp merge at the end
    wt = tl.exp2(m - mt[None, :])
    lt = tl.sum(l * wt, 0)
    o = tl.sum(acc * wt[:, :, None], 0)
    tl.store(O + r[:, None] * D + d[None, :], o / lt[:, None])


def compile_one(fn, consts: dict, warps: int, stages: int, arch: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .kernel_resources import resources
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", O="*fp32", n_tiles="i32")
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    return resources(k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    a = ap.parse_args(argv)
    base = dict(BM=a.rows, BN=a.block_n, D=a.head_dim)
    print(f"sm_{a.arch}, bf16, {a.rows} rows x {a.block_n} keys a tile, D = {a.head_dim}, {a.warps} warps, "
          f"{a.stages} stages, triton {triton.__version__}\n")
    print("| loop | regs | spills | smem KiB | instrs per tile | barriers per tile | HMMA | HGMMA |")
    print("|---|---|---|---|---|---|---|---|")
    for name, fn, consts in (("2-D tile (today)", flat, base), (f"{a.warps} per-warp sub-ranges", per_warp,
                                                                 dict(base, W=a.warps))):
        r = compile_one(fn, consts, a.warps, a.stages, a.arch)
        print(f"| {name} | {r.get('regs')} | {r.get('spills')} | {r['shared'] / 1024:.0f} | "
              f"{'/'.join(map(str, r.get('loop_instrs', [])))} | {'/'.join(map(str, r.get('loop_barriers', [])))} | "
              f"{r.get('hmma')} | {r.get('hgmma')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
