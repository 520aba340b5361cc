"""A Gluon forward trial (dense, D = 128, bf16) with FA3's overlap inside a warp group, compiled offline.

``python -m tools.triton.gluon_fwd`` compiles it for sm_90 (no GPU) and prints its resources as
``tools.triton.kernel_resources`` measures them; ``--run`` (a GPU) checks it against torch in float64 and
times it. Gluon (``triton.experimental.gluon``: explicit layouts, shared memory and async wgmma) is in
triton 3.6 and 3.9, but its kernels do not run under ``TRITON_INTERPRET=1`` (the launch asks for a GPU
driver), so the CPU cannot check its numerics: it stays out of the backend and its autotune candidates
until a GPU run passes ``--run`` (tests/backends/triton/test_triton_host.py compiles it for sm_90).

The loop (one query tile of ``BM`` rows, key tiles of ``BN``): while the tensor cores compute the next
tile's scores ``S_{j+1} = Q K_{j+1}^T`` (an async wgmma), the warps run the online softmax of ``S_j``,
then issue ``P_j V_j`` (async) and wait for both; FA3's intra-warpgroup pipelining, without its
producer warp group (the key / value tiles are loaded by the same warps, one tile ahead, into two
shared-memory buffers). Its limits: ``Lq % BM == 0``, ``Lk % BN == 0``, no mask, one scale.
"""
from __future__ import annotations

import argparse
import json
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# the CTA-wide barrier: gl.thread_barrier on triton 3.6, gl.barrier on 3.9
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

BM, BN, D, WARPS = 128, 64, 128, 8


@gluon.jit
def gluon_fwd_kernel(Q, K, V, O, Lq, Lk, qk_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                     WARPS: gl.constexpr):
    """One (batch x head, query tile) per program; q, k, v, o contiguous (B * H, L, D) bf16;
    ``qk_scale`` = softmax scale x log2(e)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, D, 16])
    kv_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
    bh = gl.program_id(0).to(gl.int64)
    m0 = gl.program_id(1) * BM
    rm = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    rd = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q = gl.load(Q + bh * Lq * D + rm[:, None] * D + rd[None, :])
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16), q)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], kv_sh)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], kv_sh)
    kv = K + bh * Lk * D + rn[:, None] * D + rd[None, :]
    vv = V + bh * Lk * D + rn[:, None] * D + rd[None, :]
    k_s.index(0).store(gl.load(kv))
    v_s.index(0).store(gl.load(vv))
    fence_async_shared()
    _barrier()
    s = warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l))
    m = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    lsum = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BM, D], gl.float32, o_l)
    n = Lk // BN
    for j in range(n):
        buf = j % 2
        nxt = 1 - buf
        more = j + 1 < n
        if more:                                   # the next key / value tiles into the other buffers
            k_s.index(nxt).store(gl.load(kv + (j + 1) * BN * D))
            v_s.index(nxt).store(gl.load(vv + (j + 1) * BN * D))
            fence_async_shared()
            _barrier()
        # the next scores on the tensor cores while the softmax of these runs
        s_next = warpgroup_mma(q_s, k_s.index(nxt).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l),
                               is_async=True)
        m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        lsum = lsum * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        m = m_new
        p_op = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(0, o_l, 2))
        acc = warpgroup_mma(p_op, v_s.index(buf), acc, is_async=True)
        s_next = warpgroup_mma_wait(1, deps=[s_next])
        acc = warpgroup_mma_wait(0, deps=[acc])
        s = s_next
        _barrier()                                 # every warp is done with this iteration's buffers
    out = acc / gl.convert_layout(lsum, gl.SliceLayout(1, o_l))[:, None]
    out = gl.convert_layout(out.to(gl.bfloat16), blk)
    gl.store(O + bh * Lq * D + rm[:, None] * D + rd[None, :], out)


def compile_sm90(arch: int = 90):
    """The kernel compiled for sm_<arch> offline (Triton's compiler, no GPU)."""
    from triton.backends.compiler import GPUTarget
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:                            # triton 3.6 keeps it in the runtime module
        from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", Lq="i32", Lk="i32", qk_scale="fp32", BM="constexpr",
               BN="constexpr", D="constexpr", WARPS="constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    src = GluonASTSource(gluon_fwd_kernel, sig, constexprs=dict(BM=BM, BN=BN, D=D, WARPS=WARPS), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=WARPS))


def run_gpu(B: int = 2, H: int = 8, L: int = 4096) -> dict:
    """On a GPU: the largest error against float64 (output NaN-poisoned first) and the time per call
    (do_bench, ms) beside SDPA's flash kernel and effattn's Triton forward on the same inputs, so the
    trial's time has its baselines from the same run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import effattn
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B * H, L, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    o = torch.full_like(q, float("nan"))
    scale = D ** -0.5

    def call():
        gluon_fwd_kernel[(B * H, L // BM)](q, k, v, o, L, L, scale * 1.4426950408889634, BM=BM, BN=BN, D=D,
                                           WARPS=WARPS, num_warps=WARPS)
    call()
    ref = torch.softmax(q.double() @ k.double().transpose(1, 2) * scale, -1) @ v.double()
    err = (o.double() - ref).abs().max().item()
    q4, k4, v4 = (t.view(B, H, L, D) for t in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q4, k4, v4)
    flops = 4 * B * H * L * L * D
    ms = {"gluon": do_bench(call, warmup=10, rep=50), "sdpa_flash": do_bench(sdpa, warmup=10, rep=50),
          "effattn_triton": do_bench(lambda: effattn.attention(q4, k4, v4, backend="triton"), warmup=10, rep=50)}
    return dict(shape=f"B{B} H{H} L{L} D{D} bf16", max_abs_err=err, nan=bool(o.isnan().any()),
                ms=ms, tflops={n: flops / t / 1e9 for n, t in ms.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--run", action="store_true", help="on a GPU: check against float64 and time it")
    args = ap.parse_args(argv)
    if args.run:
        print(json.dumps(run_gpu()))
        return 0
    from .kernel_resources import resources
    k = compile_sm90(args.arch)
    row = dict(triton=triton.__version__, config=f"BM{BM}xBN{BN}xD{D}x{WARPS}", **resources(k))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
