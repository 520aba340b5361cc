"""The Hopper (sm_90a) forward and the wgmma emulation it runs on, on the CPU:

- the emulation's wgmma matrix-descriptor decode and operand addressing (csrc/emu/wgmma.h, through
  csrc/emu/selftest_sm90.cpp) equal an independent model written below from CuTe's canonical GMMA
  layouts (mma_traits_sm90_gmma.hpp) and the PTX ISA's descriptor bit fields, for every swizzle
  mode and both majors; the 128B swizzle is the XOR of address bits 4-6 with bits 7-9;
- the wgmma D and register-A fragment maps equal CuTe's CLayout_64xN / ALayout_64x16;
- products through the forward kernel's tile layout and descriptors are matmuls, and planted layout
  mistakes (another swizzle, a wrong SBO, an unswizzled store, a tile off the 1024-byte boundary)
  give wrong results; planted misuses of wgmma abort or read NaN;
- the emulated Hopper forward (EFFATTN_CUDA_EMU_HOPPER=1) against the float64 oracle by the
  low-precision rule, every mask kind at head dims 64 and 128 in fp16 and bf16; its pipeline (two K and
  V buffers, P V behind the next S) over several key tiles, bitwise equal to the mma.sync forward at 64-key
  tiles (the cp.async kernel; the TMA kernel's 128-key tiles, every mask kind, sum in another order);
  explain says which forward runs.
"""
import random
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda import _ext
from effattn.testing.oracle import naive_attention
from tests.conftest import EMU_DEFAULT_SCHEDULE, fragment_maps, selftest_runner
from tests.core.test_attention import judge, make_inputs, naive_in

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module")
def selftest():
    return selftest_runner("selftest_sm90.cpp")


# ------------------------------------------------------------------ descriptors: an independent model

MODES = {0: 0, 1: 128, 2: 64, 3: 32}      # descriptor bits 62-63 -> swizzle width in bytes


def encode(start, lbo, sbo, mode, base=0):
    """The PTX ISA's matrix-descriptor bit fields: 14-bit (x & 0x3FFFF) >> 4 at bits 0, 16, 32; base
    offset at 49; swizzle mode at 62."""
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    return enc(start) | enc(lbo) << 16 | enc(sbo) << 32 | base << 49 | mode << 62


def cute_swizzle(addr, width):
    """CuTe's Swizzle<B, 4, 3> on a byte address: B = log2(width / 16) bits from bit 7 up, XORed
    into bit 4 up."""
    b = {0: 0, 32: 1, 64: 2, 128: 3}[width]
    mask = ((1 << b) - 1) << 7
    return addr ^ ((addr & mask) >> 3)


def model_address(start, lbo, sbo, width, mn_major, mn, k):
    """CuTe's canonical GMMA layouts for 16-bit elements (T = 8 per 16 bytes), in bytes, offset from
    the start address, then swizzled.
      K-major   INTERLEAVE ((8,m),(T,2)):((1T,SBO),(1,LBO));  B32/B64/B128 ((8,m),(T,2)):((wT,SBO),(1,T))
      MN-major  INTERLEAVE ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)); swizzled ((T,w,m),(8,k)):((1,T,LBO),(wT,SBO))
    with w = width / 16 (strides in elements, SBO / LBO in bytes)."""
    T, w = 8, width // 16
    if not mn_major:
        (r, mi), (e, kc) = divmod(mn, 8)[::-1], divmod(k, T)[::-1]
        if width == 0:
            off = 2 * (r * T + e) + mi * sbo + kc * lbo
        else:
            off = 2 * (r * w * T + e + kc * T) + mi * sbo
    else:
        (r, ki) = divmod(k, 8)[::-1]
        if width == 0:
            e, mi = mn % T, mn // T
            off = 2 * (e + r * T) + mi * sbo + ki * lbo
        else:
            e, rest = mn % T, mn // T
            c, mi = rest % w, rest // w
            off = 2 * (e + c * T + r * w * T) + mi * lbo + ki * sbo
    return cute_swizzle(start + off, width)


def test_descriptor_decode_and_addressing_match_the_model(selftest):
    rnd = random.Random(5)
    cases = []
    for mode in MODES:
        for mn_major in (0, 1):
            for _ in range(6):
                start = rnd.randrange(0, 1 << 14) * 16
                lbo, sbo = rnd.randrange(1, 1 << 10) * 16, rnd.randrange(1, 1 << 10) * 16
                cases.append((start, lbo, sbo, mode, rnd.randrange(8), mn_major))
    lines = "".join(f"{encode(s, l, b, m, base):x} {t}\n" for s, l, b, m, base, t in cases)
    res = selftest("desc", stdin=lines)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert len(out) == len(cases) * 129
    bad = []
    for i, (start, lbo, sbo, mode, base, mn_major) in enumerate(cases):
        block = out[i * 129:(i + 1) * 129]
        assert block[0].split()[1:] == [str(start), str(lbo), str(sbo), str(base), str(MODES[mode])], block[0]
        for mn in range(128):
            got = [int(x) for x in block[1 + mn].split()[1:]]
            want = [model_address(start, lbo, sbo, MODES[mode], mn_major, mn, k) for k in range(16)]
            if got != want:
                bad.append((cases[i], mn, got[:4], want[:4]))
    assert not bad, bad[:3]


def test_128b_swizzle_is_the_xor_of_bits_4_6_with_bits_7_9():
    for addr in range(0, 4096, 2):
        want = addr ^ (((addr >> 7) & 7) << 4)
        assert cute_swizzle(addr, 128) == want
    # K-major 128B atom at 1024: row 1's first 16-byte chunk is stored one chunk over, row 7's
    # chunk 7 at chunk 0 of its row
    assert model_address(1024, 16, 1024, 128, False, 1, 0) == 1024 + 128 + 16
    assert model_address(1024, 16, 1024, 128, False, 7, 56) == 1024 + 7 * 128


# ------------------------------------------------------------------ fragments

def cute_wgmma_maps():
    """CuTe's CLayout_64xN ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)) and ALayout_64x16
    ((4,8,4),(2,2,2)):((128,1,16),(64,8,512)), into column-major (64 x N) / (64 x 16) tiles:
    thread = t0 + 4 t1 + 32 t2, value = v0 + 2 v1 + 4 v2."""
    t = {}
    for thr in range(128):
        t0, t1, t2 = thr % 4, (thr // 4) % 8, thr // 32
        for v in range(64):
            v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
            idx = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2
            t[("D", thr, v)] = (idx % 64, idx // 64)
        for v in range(8):
            v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
            idx = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2
            t[("A", thr, v // 2, v % 2)] = (idx % 64, idx // 64)
    return t


def test_wgmma_fragment_maps_match_cute(selftest):
    res = selftest("maps")
    assert res.returncode == 0, res.stderr
    got = fragment_maps(res.stdout)
    cute = cute_wgmma_maps()
    assert set(got) == set(cute)
    assert {k: v for k, v in got.items() if cute[k] != v} == {}
    assert len({v for k, v in got.items() if k[0] == "D"}) == 64 * 128
    assert len({v for k, v in got.items() if k[0] == "A"}) == 64 * 16


# ------------------------------------------------------------------ products and planted mistakes

def product_errors(selftest, variant):
    res = selftest("product", variant)
    assert res.returncode == 0, res.stderr
    f = res.stdout.split()
    return float(f[1]), float(f[3])


def test_products_through_the_kernels_descriptors_are_matmuls(selftest):
    es, eo = product_errors(selftest, "ok")
    assert es < 1e-4 and eo < 1e-4, (es, eo)     # exact bf16 products, fp32 sums of 128 / 64 terms


@pytest.mark.parametrize("variant", ["swizzle64", "sbo512", "unswizzled", "misaligned"])
def test_a_wrong_layout_or_descriptor_gives_wrong_results(selftest, variant):
    es, eo = product_errors(selftest, variant)
    assert max(es, eo) > 1.0, (variant, es, eo)


MISUSE = {
    "bug-no-fence": "without a wgmma.fence",
    "bug-overwrite-before-wait": "overwritten before its wait_group",
    "bug-no-proxy-fence": "before its writer's fence.proxy.async",
    "bug-no-proxy-fence-st": "before its writer's fence.proxy.async",
    "bug-a-registers-modified": "A registers of an in-flight wgmma were modified",
    "bug-divergent-descriptor": "different shapes, types, flags or descriptors",
    "bug-unwaited": "never waited for",
}


@pytest.mark.parametrize("scenario", list(MISUSE))
def test_planted_wgmma_misuse_aborts(selftest, scenario):
    res = selftest(scenario)
    assert res.returncode != 0 and "no abort" not in res.stdout
    assert MISUSE[scenario] in res.stderr, res.stderr


def test_accumulators_read_nan_until_the_wait_and_fenced_copies_pass(selftest):
    res = selftest("bug-read-before-wait")
    assert res.returncode == 0 and int(res.stdout.split()[1]) == 128 * 32, res.stdout + res.stderr
    for fenced in ("proxy-fenced", "proxy-fenced-st"):     # cp.async copies; plain st.shared stores
        res = selftest(fenced)
        assert res.returncode == 0 and int(res.stdout.split()[1]) == 0, res.stdout + res.stderr


# ------------------------------------------------------------------ the emulated Hopper forward

# (B, H, Hkv, Lq, Lk, Dv - D, mask kwargs): two query tiles and two key tiles at most
MASKS = {
    "dense": (1, 2, 2, 70, 90, 0, {}),
    "causal": (1, 2, 2, 70, 70, 0, dict(causal=True)),
    "causal-Lq<Lk": (1, 1, 1, 19, 90, 0, dict(causal=True)),
    "causal-Lq>Lk-empty-rows": (1, 1, 1, 70, 19, 0, dict(causal=True)),
    "window-pair": (1, 2, 2, 70, 70, 0, dict(window=(3, 9))),
    "gqa-window-causal": (1, 4, 2, 40, 70, 0, dict(causal=True, window=20)),
    "kpm": (2, 1, 1, 37, 70, 0, dict(kpm=0.3)),
    "layout-perhead-bs16": (1, 2, 2, 50, 70, 0, dict(layout=(16, True))),
    "layout-shared-bs64-causal": (1, 2, 2, 128, 128, 0, dict(layout=(64, False), causal=True)),
    "dv<d-all": (2, 2, 1, 45, 64, -24, dict(layout=(16, True), causal=True, window=20, kpm=0.2)),
}


def to_device(kwargs, device):
    return {n: (t.to(device) if hasattr(t, "to") else t) for n, t in kwargs.items()}


def forward_case(name, D, dtype):
    """q, k, v, kwargs on the CPU (the emulation's device, also where a GPU is present)."""
    B, H, Hkv, Lq, Lk, dv, kw = MASKS[name]
    q, k, v, kwargs = make_inputs((B, H, Hkv, Lq, Lk, D, D + dv, kw), dtype, seed=D,
                                  transposed=name.startswith("gqa"))
    return q.cpu(), k.cpu(), v.cpu(), to_device(kwargs, "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", list(MASKS))
def test_hopper_forward_against_float64(hopper, mask, D, dtype):
    q, k, v, kwargs = forward_case(mask, D, dtype)
    hopper.emu_stats()
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    blocks, mma = hopper.emu_stats()[:2].tolist()
    assert blocks > 0 and mma == 0          # the wgmma kernel ran (no mma.sync)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kwargs)
    low, _ = naive_in(dtype, q, k, v, kwargs)
    judge(out, ref, low, 2, dtype, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-3


# (B, H, Hkv, Lq, Lk, mask kwargs): several key tiles of 64 per query tile of 128, so that both K and both
# V buffers are reused and each tile's P V runs behind the next tile's S; a partial last query tile
PIPELINE = {
    "dense-4-tiles": (1, 1, 1, 130, 256, {}),                       # kDense: Lk a multiple of 64
    "ragged-5-tiles-gqa": (1, 2, 1, 130, 300, {}),                  # kWindow: the last key tile partial
    "causal-kpm": (2, 1, 1, 200, 200, dict(causal=True, kpm=0.2)),   # kAny: masked tiles zero V rows
}


@pytest.mark.parametrize("case", list(PIPELINE))
def test_hopper_pipeline_over_many_key_tiles(hopper, case, monkeypatch):
    """The double-buffered, asynchronous pipeline over 4-5 key tiles (the emulation aborts where a copy
    lands in a buffer an in-flight wgmma reads, or an accumulator is read before its wait): against the
    float64 oracle (the TMA kernel, 128-key tiles, every mask kind), and the cp.async kernel
    (EFFATTN_CUDA_HOPPER_TMA=0, 64-key tiles) against it and bitwise equal to the mma.sync forward (per row the
    same fp32 operations in the same order: O rescaled, then P V added, tile by tile)."""
    B, H, Hkv, Lq, Lk, kw = PIPELINE[case]
    q, k, v, kwargs = make_inputs((B, H, Hkv, Lq, Lk, 64, 64, kw), torch.bfloat16, seed=7)
    q, k, v, kwargs = q.cpu(), k.cpu(), v.cpu(), to_device(kwargs, "cpu")
    hopper.emu_stats()
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    blocks, mma = hopper.emu_stats()[:2].tolist()
    assert mma == 0 and blocks == B * H * 2                  # the wgmma kernel, 128 query rows per block
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kwargs)
    low, _ = naive_in(torch.bfloat16, q, k, v, kwargs)
    judge(out, ref, low, 2, torch.bfloat16, "out")
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_TMA", "0")       # the TMA kernel's 128-key tiles: the cp.async one
    out, lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    judge(out, ref, low, 2, torch.bfloat16, "out (cp.async)")
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    out2, lse2 = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    assert hopper.emu_stats()[1].item() > 0                  # the mma.sync forward this time
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_hopper_forward_same_under_warp_serial_schedules_and_with_dropout(hopper, monkeypatch):
    """Results bitwise equal across schedules; with dropout, the cp.async Hopper forward's output equals the
    mma.sync forward's (the same Philox keep-mask, the same fp32 sums in the emulation; the TMA kernel's keep-mask
    at 128-key tiles: test_cuda_hopper_tma.py)."""
    q, k, v, kwargs = forward_case("dv<d-all", 64, torch.bfloat16)
    outs = []
    for s in (0, 1, 2):
        hopper.emu_set_schedule(s)
        outs.append(effattn.attention(q, k, v, backend="cuda", **kwargs))
    hopper.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # head dim 64: both forwards run key tiles of 64 there (the mma.sync forward's 128-row tiles take 32 at 128)
    q, k, v, kwargs = forward_case("causal", 64, torch.float16)
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER_TMA", "0")
    torch.manual_seed(3)
    a = effattn.attention(q, k, v, backend="cuda", dropout_p=0.3, **kwargs)
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    torch.manual_seed(3)
    b = effattn.attention(q, k, v, backend="cuda", dropout_p=0.3, **kwargs)
    plain = effattn.attention(q, k, v, backend="cuda", **kwargs)
    assert not torch.isnan(a).any() and not torch.equal(a, plain) and torch.equal(a, b)


def test_gradients_through_the_hopper_forward(hopper):
    """The backward (here the Hopper backward, bwd_sm90.cuh; test_cuda_hopper_bwd.py) uses the Hopper forward's
    output and lse."""
    q, k, v, kwargs = forward_case("causal", 64, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = effattn.attention(*leaves, backend="cuda", **kwargs)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, go)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*ref_leaves, **kwargs)
    low_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    low, _ = naive_in(torch.bfloat16, *low_leaves, kwargs)
    for name, g, rg, lg in zip("qkv", grads, torch.autograd.grad(ref, ref_leaves, go.double()),
                               torch.autograd.grad(low, low_leaves, go)):
        judge(g, rg, lg, 3, torch.bfloat16, f"d{name}")


def test_explain_says_which_forward_runs(hopper, monkeypatch):
    q, k, v, _ = forward_case("dense", 128, torch.bfloat16)
    assert "forward: Hopper wgmma kernel" in str(effattn.explain(q, k, v))
    small = q[..., :32], k[..., :32], v[..., :32]
    text = str(effattn.explain(*small))
    assert "forward: mma.sync kernel" in text and "bucket is 32" in text
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER", "0")
    assert "turned off by EFFATTN_CUDA_HOPPER=0" in str(effattn.explain(q, k, v))
    hopper.emu_stats()
    effattn.attention(q, k, v, backend="cuda")
    assert hopper.emu_stats()[1].item() > 0          # mma.sync ran
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER")
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    assert "EFFATTN_CUDA_EMU_HOPPER=1" in str(effattn.explain(q, k, v))
    with pytest.raises(RuntimeError, match="buckets 64 and 128"):
        hopper.attention_fwd_sm90(*small, None, None, 0, 0, None, 0, None, 0.1, 0.0, -1, -1)


def test_dispatch_on_a_gpu_picks_the_hopper_forward_for_the_benchmarked_shapes(monkeypatch):
    """The decision the backend makes on a GPU, without one: the benchmarked prefill calls (bf16,
    D = 128 dense / causal, D = 64) take the wgmma forward on compute capability 9.0 when the build
    has sm_90a code, and the mma.sync one (with the reason) elsewhere."""
    from types import SimpleNamespace

    from effattn.backends.cuda.attention import hopper as hp
    monkeypatch.delenv("EFFATTN_CUDA_HOPPER", raising=False)
    dev = torch.device("cuda", 0)

    def call(D, Dv=None):
        q = SimpleNamespace(device=dev, shape=(4, 16, 4096, D))
        return q, SimpleNamespace(device=dev, shape=(4, 16, 4096, Dv or D))

    cc = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc["now"])
    monkeypatch.setitem(hp._built, "cuda", True)
    for D in (128, 64, 40):
        assert hp.why_not(*call(D)) is None, D
    assert "bucket is 256" in hp.why_not(*call(256))
    assert "bucket is 32" in hp.why_not(*call(32))
    monkeypatch.setitem(hp._built, "cuda", False)
    assert "without sm_90a code" in hp.why_not(*call(128))
    monkeypatch.setitem(hp._built, "cuda", True)
    for other in ((8, 0), (8, 9), (10, 0), (12, 0)):
        cc["now"] = other
        assert "needs compute capability 9.0" in hp.why_not(*call(128)), other
    cc["now"] = (9, 0)
    monkeypatch.setenv("EFFATTN_CUDA_HOPPER", "0")
    assert "EFFATTN_CUDA_HOPPER=0" in hp.why_not(*call(128))


# ------------------------------------------------------------------ on a Hopper GPU (marked gpu)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["causal", "gqa-window-causal", "dv<d-all"])
@pytest.mark.parametrize("D", [64, 128])
def test_real_hopper_forward_matches_its_emulation(D, mask, dtype, monkeypatch):
    """On a compute-capability 9.0 GPU with the sm_90a kernels built: the real wgmma forward against
    the emulated one on the same inputs (differences: ex2.approx and the tensor cores' summation
    order, a few units in the last place)."""
    from effattn.backends.cuda.attention import hopper as hp
    if not torch.cuda.is_available() or _ext.cuda_problem():
        pytest.skip("needs a GPU and effattn._C")
    q, k, v, kwargs = forward_case(mask, D, dtype)
    dev = to_device(kwargs, "cuda")
    why = hp.why_not(q.cuda(), v.cuda())
    if why:
        pytest.skip(f"the Hopper forward does not run here: {why}")
    assert "Hopper wgmma" in str(effattn.explain(q.cuda(), k.cuda(), v.cuda(), **dev))
    out, lse = effattn.attention(q.cuda(), k.cuda(), v.cuda(), return_lse=True, backend="cuda", **dev)
    monkeypatch.setenv("EFFATTN_CUDA_EMU", "1")
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    assert _ext.emu_problem() is None, _ext.emu_problem()
    emu_out, emu_lse = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    eps = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for name, a, b in (("out", out.cpu(), emu_out), ("lse", lse.cpu(), emu_lse)):
        scale = b.float().abs().nan_to_num(posinf=0.0, neginf=0.0).max().clamp_min(1.0).item()
        err = (a.float() - b.float()).abs().nan_to_num(posinf=0.0, neginf=0.0).max().item()
        assert err <= 4 * eps * scale, f"{name}: real vs emulated {err:.3g}"
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(emu_lse))
