"""Correctness on a GPU at real sizes (``pytest -m gpu``; skipped without CUDA), for every kernel
backend that declares CUDA (the float64 reference backend is the oracle's twin and is not rerun).

Each case runs forward and backward against `oracle.chunked_attention` in float64 and is judged by
the low-precision rule: error at most 2x (output) / 3x (gradients) the error of the same computation
done naively in the input dtype, plus a small floor, and never NaN. Then: rows with no key, B*H >
65535 (1-D grids), int64 offsets, a bitwise-deterministic backward with dropout, CUDA-graph capture,
torch.compile, O(L) memory, and last a call of a never-seen kind made during graph capture.

Kernels run with their first config (``EFFATTN_TRITON_AUTOTUNE=0``, set by conftest): autotuning
compiles ~10 candidates per kind, too slow here. The tuned configs are compared with the baselines'
outputs by the benchmark suite (``python -m benchmarks.suite``, its ``max_diff`` column).

Linear attention's kernel backends are judged the same way against `oracle.chunked_linear_attention`
(the quadratic form in float64).

``EFFATTN_GPU_SMOKE=1`` runs these tests on a CPU at toy sizes (Triton's interpreter): a check of
the tests themselves before a GPU session, not of the kernels at real sizes.
``EFFATTN_GPU_BACKENDS=triton,...`` names the backends to test instead (the torch reference too).
"""
import os

import pytest
import torch

import effattn
from effattn.layouts import BlockLayout, sliding_and_summary
from effattn.testing import checks
from effattn.testing.oracle import chunked_attention, chunked_linear_attention, feature_map
from tests.conftest import GPU_SMOKE, declared_dtypes, kernel_backends, op_backends

pytestmark = [pytest.mark.gpu, pytest.mark.toy]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = DEV.type == "cpu"                      # only reached with EFFATTN_GPU_SMOKE=1 (else skipped)
RUNS = DEV.type == "cuda" or GPU_SMOKE
ONLY = [b for b in os.environ.get("EFFATTN_GPU_BACKENDS", "").split(",") if b]   # e.g. "triton"; "torch" too
BACKENDS = (ONLY or kernel_backends("attention", DEV)) if RUNS else []
LINEAR_BACKENDS = [b for b in (ONLY or kernel_backends("linear_attention", DEV)) if b in op_backends(
    "linear_attention", DEV)] if RUNS else []


def L_(n):
    """A sequence length: n on the GPU; a toy one in a smoke run (keeping n's ratio to 4096)."""
    return n if not SMOKE else max(16, min(96, n * 64 // 4096))


def D_(n):
    return n if not SMOKE else min(n, 64 if n > 128 else 32)


def rand_layout(H, Lq, Lk, bs, density, seed):
    g = torch.Generator().manual_seed(seed)
    return BlockLayout(torch.rand(H, -(-Lq // bs), -(-Lk // bs), generator=g) < density, bs)


def randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen, device=DEV, dtype=torch.float32).to(dtype)


class Case:
    """One shape: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); `kw` the mask arguments,
    `layout(Lq, Lk)` builds one; `kpm` the fraction of keys padded (on the right, and a few on the
    left of batch 0)."""

    def __init__(self, B, H, Hkv, Lq, Lk, D, Dv=None, layout=None, kpm=0.0, **kw):
        self.B, self.H, self.Hkv, self.Lq, self.Lk, self.D = B, H, Hkv, L_(Lq) if Lq > 1 else Lq, L_(Lk), D_(D)
        self.Dv, self.layout, self.kpm, self.kw = D_(Dv or D), layout, kpm, kw
        if SMOKE:
            self.B, self.H, self.Hkv = min(B, 4), min(H, 4), min(Hkv, 2)
            if "window" in kw:
                self.kw["window"] = tuple(max(1, w * 64 // 4096) for w in kw["window"])


BS = 16 if SMOKE else 128                       # layout block in the toy run: several blocks per toy length
CASES = {
    "dense-B2-H8-L2k-D128": Case(2, 8, 8, 2048, 2048, 128),
    "dense-B2-H8-L4k-D64": Case(2, 8, 8, 4096, 4096, 64),
    "causal-gqa-H8-Hkv2-L16k-D128": Case(1, 8, 2, 16384, 16384, 128, causal=True),
    "causal-gqa-H8-Hkv2-L4k-D128": Case(1, 8, 2, 4096, 4096, 128, causal=True),
    "window512-causal-L4k-D128": Case(1, 8, 8, 4096, 4096, 128, causal=True, window=(512, 0)),
    "window1024-causal-L16k-D128": Case(1, 8, 8, 16384, 16384, 128, causal=True, window=(1024, 0)),
    "window300-50-two-sided-L4k-D64": Case(1, 4, 4, 4096, 4096, 64, window=(300, 50)),
    "fixed4+8th-causal-L4k-D128": Case(1, 8, 8, 4096, 4096, 128, causal=True,
                                       layout=lambda Lq, Lk: sliding_and_summary(Lq, BS, 4, 8)),
    "fixed4+16th-causal-L8k-D128": Case(1, 8, 8, 8192, 8192, 128, causal=True,
                                        layout=lambda Lq, Lk: sliding_and_summary(Lq, BS, 4, 16)),
    # block 64 against the kernels' tiles: tiles straddle layout blocks; per-head layout; padding
    "layout-bs64-30%-per-head-kpm-B2-L4k-D64": Case(2, 4, 4, 4096, 4096, 64, kpm=0.1,
                                                    layout=lambda Lq, Lk: rand_layout(4, Lq, Lk, BS // 2, 0.3, 1)),
    "dense-D256-H4-L2k": Case(1, 4, 4, 2048, 2048, 256),
    "causal-Lq1000-Lk3000-D96-Dv64-gqa": Case(1, 4, 2, 1000, 3000, 96, 64, causal=True),
    "causal-L3000-D96-Dv64-gqa": Case(1, 4, 2, 3000, 3000, 96, 64, causal=True),
    "decode-Lq1-Lk16k-B4-H32-Hkv8-D128": Case(4, 32, 8, 1, 16384, 128, causal=True),
    # more rows than keys: the first Lq - Lk rows see nothing (output 0, no gradient)
    "causal-Lq2k-Lk1500-empty-rows": Case(1, 4, 4, 2048, 1500, 64, causal=True),
}
FP32_CASES = {"fp32-causal-L2k-D64": Case(1, 4, 4, 2048, 2048, 64, causal=True),
              "fp32-window300-L2k-D64": Case(1, 4, 4, 2048, 2048, 64, causal=True, window=(300, 0))}
FLOOR = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}


def _params():
    out = []
    for b in BACKENDS:
        dts = declared_dtypes("attention", b)
        for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            if dt in dts:
                out += [pytest.param(b, dt, False, c, id=f"{b}-{name}-{c}") for c in CASES]
        if torch.float32 in dts:
            for tf32 in (False, True):
                out += [pytest.param(b, torch.float32, tf32, c, id=f"{b}-fp32{'-tf32' if tf32 else ''}-{c}")
                        for c in FP32_CASES]
    return out


def naive_error(lo, r):
    """The naive computation's largest error over the entries it computed at all: in fp16 a naive
    normalizer over 16k keys can overflow (inf / NaN rows), which says nothing of the kernel's error;
    the kernel's own output is held to be finite everywhere by `judge`."""
    d = (lo.double() - r.double()).abs()
    ok = torch.isfinite(d)
    if not ok.any():
        raise AssertionError("the naive reference is not finite anywhere: no error scale to judge by")
    return d[ok].max().item()


def judge(got, ref, low, dtype, names=("out", "dq", "dk", "dv")):
    """The low-precision rule: |got - ref| <= m x |naive - ref| + floor, m = 2 (out) / 3 (grads)."""
    for name, x, r, lo, mult in zip(names, got, ref, low, (2, 3, 3, 3)):
        assert torch.isfinite(x).all(), f"{name}: not finite (NaN or inf)"
        if x.numel() == 0:
            continue
        err = (x.double() - r.double()).abs().max().item()
        nerr = naive_error(lo, r)
        assert err <= mult * nerr + FLOOR[dtype], f"{name}: error {err:.3g} > {mult} x naive {nerr:.3g} + floor"


@pytest.mark.parametrize("backend,dtype,tf32,case_id", _params())
def test_against_float64_at_real_sizes(backend, dtype, tf32, case_id):
    c = {**CASES, **FP32_CASES}[case_id]
    g = torch.Generator(device=DEV).manual_seed(0)
    q = randn(c.B, c.H, c.Lq, c.D, dtype=dtype, gen=g)
    k = randn(c.B, c.Hkv, c.Lk, c.D, dtype=dtype, gen=g)
    v = randn(c.B, c.Hkv, c.Lk, c.Dv, dtype=dtype, gen=g)
    go = randn(c.B, c.H, c.Lq, c.Dv, dtype=dtype, gen=g)
    kw = dict(c.kw)
    if c.layout is not None:
        kw["layout"] = c.layout(c.Lq, c.Lk).to(DEV)
    if c.kpm:
        kpm = torch.zeros(c.B, c.Lk, dtype=torch.bool, device=DEV)
        kpm[:, int(c.Lk * (1 - c.kpm)):] = True
        kpm[0, :max(1, c.Lk // 50)] = True
        kw["key_padding_mask"] = kpm
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with checks.tf32(tf32):
        out = effattn.attention(*leaves, backend=backend, **kw)
        got = (out,) + torch.autograd.grad(out, leaves, go)
        ref = chunked_attention(q, k, v, go.double(), dtype=torch.float64, **kw)
        low = chunked_attention(q, k, v, go, dtype=dtype, **kw)
    judge(got, ref, low, dtype)
    if c.Lq > c.Lk and kw.get("causal"):                    # rows with no key: exactly 0
        assert torch.equal(out[:, :, :c.Lq - c.Lk], torch.zeros_like(out[:, :, :c.Lq - c.Lk]))


# id -> (B, H, Hkv, Lq, Lk, D, feature map, causal, normalize, input scale)
LINEAR_CASES = {
    "elu-causal-gqa-H8-Hkv2-L16k-D128": (1, 8, 2, 16384, 16384, 128, "elu", True, True, 1.0),
    "elu-noncausal-B2-L4k-D64": (2, 8, 8, 4096, 4096, 64, "elu", False, True, 1.0),
    "elu-causal-Lq1000-Lk3000-D64": (1, 4, 4, 1000, 3000, 64, "elu", True, True, 1.0),
    "identity-causal-unnormalized-L4k-D64": (1, 8, 8, 4096, 4096, 64, "identity", True, False, 0.3),
    "favor256-causal-L4k-D64": (1, 8, 8, 4096, 4096, 64, "favor", True, True, 0.5),
}


def _linear_params():
    return [pytest.param(b, dt, c, id=f"{b}-{name}-{c}") for b in LINEAR_BACKENDS
            for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))
            if dt in declared_dtypes("linear_attention", b) for c in LINEAR_CASES]


@pytest.mark.parametrize("backend,dtype,case_id", _linear_params())
def test_linear_attention_against_float64(backend, dtype, case_id):
    B, H, Hkv, Lq, Lk, D, fmap, causal, normalize, scale = LINEAR_CASES[case_id]
    Lq, Lk, D = L_(Lq), L_(Lk), D_(D)
    if SMOKE:
        B, H, Hkv = min(B, 2), min(H, 4), min(Hkv, 2)
    g = torch.Generator(device=DEV).manual_seed(4)
    q, go = randn(B, H, Lq, D, dtype=dtype, gen=g) * scale, randn(B, H, Lq, D, dtype=dtype, gen=g)
    k, v = randn(B, Hkv, Lk, D, dtype=dtype, gen=g) * scale, randn(B, Hkv, Lk, D, dtype=dtype, gen=g)
    fm = effattn.FavorFeatures(D, 256, seed=0).to(DEV) if fmap == "favor" else fmap
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = effattn.linear_attention(*leaves, causal=causal, feature_map=fm, normalize=normalize, backend=backend)
    got = (out,) + torch.autograd.grad(out, leaves, go)
    phi = feature_map(fmap, fm)
    kw = dict(causal=causal, normalize=normalize)
    judge(got, chunked_linear_attention(q, k, v, go.double(), phi, **kw),
          chunked_linear_attention(q, k, v, go, phi, dtype=dtype, **kw), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_times_heads_above_65535(backend):
    """B * H = 65552 programs per query tile: more than a grid's y size (65535), fine on 1-D grids.
    Decode-like: one query row per (b, h) against 128 keys, GQA."""
    B, H, Hkv, Lk, D = (4097, 16, 4, 128, 128) if not SMOKE else (4, 4, 2, 40, 16)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, go = (randn(B, H, 1, D, dtype=torch.bfloat16, gen=g) for _ in range(2))
    k, v = (randn(B, Hkv, Lk, D, dtype=torch.bfloat16, gen=g) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = effattn.attention(*leaves, causal=True, backend=backend)
    got = (out,) + torch.autograd.grad(out, leaves, go)
    judge(got, chunked_attention(q, k, v, go.double(), causal=True),
          chunked_attention(q, k, v, go, causal=True, dtype=torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_offsets_match_a_contiguous_copy(backend):
    """Keys and values viewed from one (Lk, B, 2, Hkv, D) tensor: the length stride B*2*Hkv*D makes
    one slice span more than 2**31 elements, so offsets need int64; the result must equal, bitwise,
    that of contiguous copies (small spans)."""
    Lk, Hkv, D, Lq = ((1 << 20) + 64, 8, 128, 256) if not SMOKE else (64, 2, 16, 32)
    g = torch.Generator(device=DEV).manual_seed(1)
    kv = randn(Lk, 1, 2, Hkv, D, dtype=torch.bfloat16, gen=g)
    k, v = kv[:, :, 0].permute(1, 2, 0, 3), kv[:, :, 1].permute(1, 2, 0, 3)     # (1, Hkv, Lk, D) views
    q, go = (randn(1, 2 * Hkv, Lq, D, dtype=torch.bfloat16, gen=g) for _ in range(2))
    span = (Lk - 1) * k.stride(2) + (D - 1) * k.stride(3)
    assert SMOKE or span >= 2**31
    results = []
    for kk, vv in ((k.contiguous(), v.contiguous()), (k, v)):
        leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
        out = effattn.attention(*leaves, causal=True, backend=backend)
        results.append((out,) + torch.autograd.grad(out, leaves, go))
        del leaves, out
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{name} differs with int64 offsets"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_bitwise_deterministic_with_dropout(backend):
    L, H, Hkv, D = L_(4096), 8 if not SMOKE else 2, 2 if not SMOKE else 1, D_(128)
    g = torch.Generator(device=DEV).manual_seed(2)
    q, go = (randn(2, H, L, D, dtype=torch.bfloat16, gen=g) for _ in range(2))
    k, v = (randn(2, Hkv, L, D, dtype=torch.bfloat16, gen=g) for _ in range(2))
    layout = sliding_and_summary(L, BS, 4, 8).to(DEV)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(1)
        out = effattn.attention(*leaves, causal=True, layout=layout, dropout_p=0.1, backend=backend)
        runs.append((out,) + torch.autograd.grad(out, leaves, go))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_equals_eager(backend):
    if SMOKE:
        pytest.skip("CUDA graphs need CUDA")
    g = torch.Generator(device=DEV).manual_seed(3)
    q, go = (randn(1, 8, 2048, 128, dtype=torch.bfloat16, gen=g) for _ in range(2))
    leaves = [q] + [randn(1, 2, 2048, 128, dtype=torch.bfloat16, gen=g) for _ in range(2)]
    leaves = [t.requires_grad_() for t in leaves]

    def step():
        out = effattn.attention(*leaves, causal=True, backend=backend)
        return (out,) + torch.autograd.grad(out, leaves, go)

    same = checks.graph_replay_matches_eager(step)
    assert all(same), f"bitwise equal (out, dq, dk, dv): {same}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_equals_eager(backend):
    L, D = L_(1024), D_(128)
    q, k, v = (torch.randn(2, 4, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    layout = sliding_and_summary(L, BS, 2, 4).to(DEV)

    def f(q, k, v):
        return effattn.attention(q, k, v, causal=True, layout=layout, backend=backend) * 2

    same, diff = checks.compile_matches_eager(f, (q, k, v), backend="aot_eager" if SMOKE else "inductor")
    assert diff < 1e-2, f"compiled vs eager: max |diff| {diff:.3g} (bitwise {same})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_is_linear_in_length(backend):
    """Peak memory of forward + backward beyond inputs and results is O(L): at L = 16k far below
    one score matrix (B=1, H=8: 4 GiB in bf16), and about 4x from 4k to 16k."""
    if SMOKE:
        pytest.skip("measures CUDA memory")
    extra = {}
    for L in (4096, 16384):
        q, k, v, go = (torch.randn(1, 8, L, 64, device=DEV, dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = effattn.attention(*leaves, causal=True, backend=backend)
        torch.autograd.grad(out, leaves, go)                 # warm-up: compiles, allocates once
        del out
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = effattn.attention(*leaves, causal=True, backend=backend)
        grads = torch.autograd.grad(out, leaves, go)
        torch.cuda.synchronize()
        results = out.numel() * 2 + 8 * L * 4 + sum(t.numel() * 2 for t in grads)   # out, lse, grads
        extra[L] = torch.cuda.max_memory_allocated() - base - results
        del out, grads
    assert extra[16384] < 64 * 2**20, f"extra peak {extra[16384] / 2**20:.1f} MiB at L=16k"
    assert extra[16384] <= 6 * max(extra[4096], 1 << 20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_time_follows_visible_work(backend, monkeypatch):
    """Autotuned (the one test here that times): a causal window of 1024 at 16k sees ~1/8 of
    causal's pairs; it must take well under a third of causal's time."""
    if SMOKE:
        pytest.skip("times CUDA kernels")
    from triton.testing import do_bench
    monkeypatch.setenv("EFFATTN_TRITON_AUTOTUNE", "1")
    q, k, v = (torch.randn(1, 16, 16384, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    t_causal = do_bench(lambda: effattn.attention(q, k, v, causal=True, backend=backend), return_mode="median")
    t_window = do_bench(lambda: effattn.attention(q, k, v, causal=True, window=1024, backend=backend),
                        return_mode="median")
    assert t_window * 3 < t_causal, f"window {t_window:.3f} ms vs causal {t_causal:.3f} ms"


@pytest.mark.parametrize("backend", BACKENDS)
def test_zz_unseen_kind_during_graph_capture(backend):
    """Last (a failed capture can leave CUDA in an error state): a call of a kind no test made
    before (fp16, D=80, a two-sided window), first met while a CUDA graph is being captured, must
    compile and choose its config without timing anything and give the right result."""
    if SMOKE:
        pytest.skip("CUDA graphs need CUDA")
    q = torch.randn(1, 4, 640, 80, device=DEV, dtype=torch.float16)
    ref = chunked_attention(q, q, q, torch.zeros_like(q), window=(33, 7))[0]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = effattn.attention(q, q, q, window=(33, 7), backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-2, f"max |err| {err:.3g} against float64"

