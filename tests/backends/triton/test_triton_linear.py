"""Tests specific to the Triton linear-attention backend: the decoding step kernel inside KVCache,
bitwise determinism, what `explain` says, the torch.library ops, and (marked `gpu`) bf16 accuracy up
to 64k positions. The shared accuracy suite is tests/core/test_linear_attention.py."""
import math

import pytest
import torch

import effattn
from effattn.backends import base
from effattn.backends.torch.linear.reference import linear_attention_reference
from effattn.nn import KVCache, MultiheadAttention
from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif("triton" not in base._REGISTRY["linear_attention"] or
                                base._REGISTRY["linear_attention"]["triton"].available(DEVICE) is not None,
                                reason="the Triton backend cannot run here")


@pytest.fixture
def step_calls(monkeypatch):
    """Counts the launches of the one-token step op."""
    import effattn.backends.triton.linear as tlin
    calls = []
    real = tlin.triton_linear_step

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(tlin, "triton_linear_step", spy)
    return calls


def test_kvcache_decoding_uses_the_step_kernel(step_calls):
    """A module built with linear= decodes token by token through the step kernel (no gradient),
    and matches its own full forward."""
    torch.manual_seed(0)
    E, H, B, L = 16, 2, 1, 12
    mha = MultiheadAttention(E, H, batch_first=True, linear="elu", backend="triton").to(DEVICE).eval()
    x = torch.randn(B, L, E, device=DEVICE)
    with torch.no_grad():
        full, _ = mha(x, x, x, is_causal=True, need_weights=False)
        assert not step_calls
        cache = KVCache()
        outs = [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, need_weights=False,
                    cache=cache)[0] for t in range(L)]
    assert len(step_calls) == L
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    S, z = cache.state
    assert S.dtype == torch.float32 and S.shape == (B, H, E // H, E // H) and z.shape == (B, H, E // H)


def test_step_with_gradients_takes_the_differentiable_path(step_calls):
    q, k, v = (torch.randn(1, 2, 1, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    out = effattn.linear_attention(q, k, v, causal=True, backend="triton")
    (g,) = torch.autograd.grad(out.sum(), v)
    assert not step_calls and torch.allclose(g, torch.ones_like(g))    # out = v for one key


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backward_is_bitwise_deterministic(causal):
    """GQA with a per-head initial state and a returned state: two runs give the same bits (the
    key-side passes sum a group's heads in a fixed order; the non-causal reduction is split over the
    sequence and its partial sums added in a fixed order)."""
    torch.manual_seed(4)
    B, H, Hkv, L, D = 1, 4, 2, 70, 16
    q = torch.randn(B, H, L, D, device=DEVICE)
    k, v = (torch.randn(B, Hkv, L, D, device=DEVICE) for _ in range(2))
    S0, z0 = torch.rand(B, H, D, D, device=DEVICE), torch.rand(B, H, D, device=DEVICE)
    go, gS = torch.randn(B, H, L, D, device=DEVICE), torch.randn(B, H, D, D, device=DEVICE)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, S0, z0)]
        out, (S, z) = effattn.linear_attention(*leaves[:3], causal=causal, initial_state=tuple(leaves[3:]),
                                               return_state=True, backend="triton")
        runs.append((out, S, z) + torch.autograd.grad((out, S), leaves, (go, gS)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("Lq,Lk,causal", [(0, 5, True), (5, 0, True), (5, 0, False), (0, 0, False)])
def test_empty_lengths_match_torch(Lq, Lk, causal):
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, h, n, d, device=DEVICE) for h, n, d in ((2, Lq, 4), (1, Lk, 4), (1, Lk, 3)))
    got = effattn.linear_attention(q, k, v, causal=causal, return_state=True, backend="triton")
    want = effattn.linear_attention(q, k, v, causal=causal, return_state=True, backend="torch")
    for a, b in zip((got[0],) + got[1], (want[0],) + want[1]):
        assert a.shape == b.shape and not a.isnan().any()
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("base", [False, True], ids=["state", "state+base"])
def test_denominator_state_terms_keep_fp32_precision(base):
    """The normalizer ``z`` (per-chunk fp32 row sums, `chunk_sum_kernel`) and the denominator's state terms
    ``phi(q) . z`` (fp32 row dots) keep fp32: with bf16 features of a wide range (as FAVOR+'s) the
    denominators match float64 to 2^-14 relative; z or its products rounded to bf16 would leave 2^-9."""
    from effattn.backends.triton.linear.ops import triton_linear_causal_fwd
    from effattn.feature_maps import FMAP_IDENTITY
    g = torch.Generator().manual_seed(3)
    B, H, L, F, Dv = 1, 2, 100, 48, 16                # 4 chunks of 32 in the interpreter
    fq, fk = ((torch.randn(B, H, L, F, generator=g) * 1.5 - 2).exp().to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, H, L, Dv, generator=g).to(torch.bfloat16)
    s0 = torch.rand(B, H, F, Dv, generator=g) if base else None
    z0 = torch.rand(B, H, F, generator=g) * 7 + 0.1 if base else None
    _, den, _, _ = triton_linear_causal_fwd(*(t.to(DEVICE) for t in (fq, fk, v)),
                                            *(None if t is None else t.to(DEVICE) for t in (s0, z0)),
                                            0, FMAP_IDENTITY, True, 1e-6, False)
    a = (fq.double() @ fk.double().transpose(-1, -2)).tril()
    want = a.sum(-1) + 1e-6 + (fq.double() @ z0.double()[..., None])[..., 0] if base else a.sum(-1) + 1e-6
    rel = ((den.view(B, H, L).cpu().double() - want) / want).abs().max().item()
    assert rel < 2.0 ** -14, rel


def test_gradient_reaches_a_trainable_favor_projection():
    """FAVOR+ features are computed in torch: a projection made trainable gets its gradient, the same
    as through the torch reference."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 40, 8, device=DEVICE) * 0.5 for _ in range(3))
    grads = []
    for backend in ("triton", "torch"):
        phi = effattn.FavorFeatures(8, 16, seed=1).to(DEVICE)
        w = torch.nn.Parameter(phi.projection.clone())
        del phi.projection
        phi.projection = w
        out = effattn.linear_attention(q, k, v, causal=True, feature_map=phi, backend=backend)
        (g,) = torch.autograd.grad((out * v).sum(), w)
        grads.append(g)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_explain_names_fused_maps_and_torch_features():
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    fused = effattn.explain(q, k, v, op="linear_attention", feature_map="relu", causal=True)
    assert fused.can_serve("triton") and "'relu' fused into the kernels" in fused.notes["triton"]
    favor = effattn.explain(q, k, v, op="linear_attention", feature_map=effattn.FavorFeatures(16, 32, seed=0))
    assert "FAVOR+ features computed in torch" in favor.notes["triton"]
    assert "computed in torch" in str(effattn.explain(q, k, v, op="linear_attention", feature_map=torch.sigmoid))
    step = effattn.explain(q[:, :, :1], k[:, :, :1], v[:, :, :1], op="linear_attention")
    assert step.can_serve("triton/linear-step") and step.paths["triton"] == "triton/linear-step"
    assert "not one token (Lq=8, Lk=8)" in fused.row("triton/linear-step").reasons
    why = effattn.explain(q.double(), k.double(), v.double(), op="linear_attention").reasons["triton"]
    assert any("dtype float64 not served" in w for w in why)


def test_ops_trace_with_fake_tensors():
    """The torch.library ops have fake impls of the right shapes (what torch.compile traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from effattn.backends.triton.linear.ops import triton_linear_apply, triton_linear_causal_fwd
    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 9, 8), torch.empty(2, 2, 9, 8), torch.empty(2, 2, 9, 5)
        out, den, S, z = triton_linear_causal_fwd(q, k, v, None, None, 0, 1, True, 1e-6, False)
        assert out.shape == (2, 4, 9, 5) and den.shape == (8, 9) and S.shape == (2, 2, 8, 5) and z.shape == (2, 2, 8)
        out, den = triton_linear_apply(q, S, z, None, None, 0, False, 0.0, torch.float16, False)
        assert out.shape == (2, 4, 9, 5) and out.dtype == torch.float16 and den.numel() == 0


def test_opcheck():
    """torch.library.opcheck: schemas, fake impls, autograd registration of the ops."""
    from effattn.backends.triton.linear import ops
    q = torch.randn(1, 2, 9, 8, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 1, 9, 8, device=DEVICE, requires_grad=True) for _ in range(2))
    S0, z0 = torch.rand(1, 2, 8, 8, device=DEVICE), torch.rand(1, 2, 8, device=DEVICE)
    torch.library.opcheck(ops.triton_linear_causal_fwd, (q, k, v, S0, z0, -2, 1, True, 1e-6, False))
    with torch.no_grad():
        torch.library.opcheck(ops.triton_linear_step, (q[:, :, :1], k[:, :, :1], v[:, :, :1], S0, z0, 1, True, 1e-6))


# ------------------------------------------------------------------------------------------- GPU

def _reference(q, k, v, causal, normalize, fmap, dtype):
    """The torch reference's chunked math with every tensor in `dtype` (float64: the oracle at lengths
    a dense oracle cannot reach; bf16: the naive low-precision error bar)."""
    phi = {"elu": lambda x: torch.nn.functional.elu(x) + 1, "identity": lambda x: x}[fmap]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _, _ = linear_attention_reference(phi(leaves[0]), phi(leaves[1]), leaves[2], causal=causal,
                                           normalize=normalize, eps=1e-6)
    return out, leaves


@pytest.mark.gpu
@pytest.mark.parametrize("L", [4096, 16384, 65536])
@pytest.mark.parametrize("causal,normalize,fmap", [(True, False, "identity"), (True, True, "elu"),
                                                   (False, True, "elu")], ids=["causal-identity", "causal-elu",
                                                                               "full-elu"])
def test_gpu_bf16_long_sequences(L, causal, normalize, fmap, monkeypatch):
    monkeypatch.setenv("EFFATTN_TRITON_AUTOTUNE", "0")
    torch.manual_seed(0)
    B, H, Hkv, D = 1, 4, 2, 64
    dev = torch.device("cuda")
    q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) * 0.5
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16) * 0.5
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
    go = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = effattn.linear_attention(*leaves, causal=causal, normalize=normalize, feature_map=fmap, backend="triton")
    grads = torch.autograd.grad(out, leaves, go)
    ref, ref_leaves = _reference(q, k, v, causal, normalize, fmap, torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_leaves, go.double())
    low, low_leaves = _reference(q, k, v, causal, normalize, fmap, torch.bfloat16)
    low_grads = torch.autograd.grad(low, low_leaves, go)
    for name, got, r, n, mult in [("out", out, ref, low, 2)] + [
            (f"d{c}", g, rg, lg, 3) for c, g, rg, lg in zip("qkv", grads, ref_grads, low_grads)]:
        assert not got.isnan().any(), name
        err = (got.double() - r).abs().max().item()
        nerr = (n.double() - r).abs().max().item()
        assert err <= mult * nerr + 1e-3 * r.abs().max().item(), f"{name}: {err:.3g} vs naive bf16 {nerr:.3g}"


@pytest.mark.gpu
def test_gpu_step_kernel_and_determinism(monkeypatch):
    monkeypatch.setenv("EFFATTN_TRITON_AUTOTUNE", "0")
    torch.manual_seed(1)
    dev = torch.device("cuda")
    B, H, Hkv, L, D = 2, 8, 2, 4096, 128
    q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    full, state = effattn.linear_attention(q, k, v, causal=True, return_state=True, backend="triton")
    with torch.no_grad():
        o, st = effattn.linear_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], causal=True, initial_state=state,
                                         return_state=True, backend="triton")
    ref, _ = effattn.linear_attention(q[:, :, :1].float(), k[:, :, :1].float(), v[:, :, :1].float(), causal=True,
                                      initial_state=state, return_state=True, backend="torch")
    torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=2e-2)
    go = torch.randn_like(full)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = effattn.linear_attention(*leaves, causal=True, backend="triton")
        runs.append(torch.autograd.grad(out, leaves, go))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _offline_rows(*argsets):
    """Rows of `python -m tools.triton.linear_kernel_resources --json` (sm_90, Triton's compiler, no GPU), one
    subprocess per argument list: the test process may run under the interpreter, which compiles nothing."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(effattn.__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    rows = []
    for args in argsets:
        proc = subprocess.run([sys.executable, "-m", "tools.triton.linear_kernel_resources", "--json", "--processes",
                               "2", "--default-placement-only", *args], cwd=root, capture_output=True, text=True,
                              env=env, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows += [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert rows and not [r for r in rows if "error" in r], rows
    return rows


def _no_narrow_product(rows):
    """Every pass (not the step, map or chunk-sum kernels, which have no product) runs wgmma, none
    narrower than 64 x 32 in a loop; no loop spills; no reduction of a pipelined tile a dot reads."""
    passes = [r for r in rows if r["role"] not in ("step", "map", "sums", "sums-weighted")]
    assert all(r["hgmma"] > 0 for r in passes), rows
    assert all(r["wgmma_min_n"] is not None and r["wgmma_min_n"] >= 32 for r in passes), \
        [(r["role"], r["dtype"], r["wgmma_min_n"]) for r in passes]
    assert all(r["fits"] and r.get("loop_spills") == 0 for r in rows), rows
    assert all(r["tile_reductions"] == 0 for r in rows), rows


def test_normalizer_takes_no_narrow_product_offline():
    """The causal forward's two passes (bf16, F = Dv = 128, default configs) compiled for sm_90: the
    normalizer's 64 x 16 products (``z`` in the state loop, the denominator in the output loop) stay out,
    wgmma no narrower than 32 in their loops, no loop spill (the long run compiles every role)."""
    rows = _offline_rows(["--dtypes", "bf16", "--feature-dims", "128", "--roles", "state-fwd,out-fwd-normalized"])
    assert [r["role"] for r in rows] == ["state-fwd", "out-fwd-normalized"], rows
    _no_narrow_product(rows)


def test_kernels_compile_for_sm90_offline():
    """The interpreter skips Triton's compiler: compile the roles of the linear kernels (and the step,
    feature-map and chunk-sum kernels) for sm_90 in the default bf16 config at F = Dv = 128, and the fp16
    output pass (which spilled 9 registers in its loop at a 128-wide output tile), so a GPU-only compile
    error fails CI, and check they fit, use wgmma no narrower than 64 x 32 in their loops and spill nothing
    inside their loops (`python -m tools.triton.linear_kernel_resources` prints the table of every role and
    dtype). No kernel reduces a pipelined shared-memory tile that a dot also reads (features fed to the
    passes as they are): Triton 3.6 computed that reduction wrongly on an H200 (the normalizer of bf16
    FAVOR+ attention at L = 4096)."""
    # the roles whose flags are not a subset of another's (the committed table has all of them)
    roles = ["state-fwd", "state-bwd-reverse", "state-noncausal-split", "out-fwd-normalized", "out-dq", "out-dk",
             "sums-weighted", "step", "map"]
    rows = _offline_rows(["--dtypes", "bf16", "--roles", ",".join(roles)],
                         ["--dtypes", "fp16", "--roles", "out-fwd-normalized"])
    assert len(rows) == len(roles) + 1, rows
    _no_narrow_product(rows)


def test_map_placement_follows_the_committed_offline_model():
    """`launch.MAP_ONCE` puts each dtype's feature map (per feature dim) where the committed offline table's model
    (benchmarks/results/offline-sm90/linear_resources.md, "Where the feature map runs") counts fewer
    forward instructions per chunk, at every feature dim it lists (regenerate the table after a kernel
    change; a placement against its model fails here)."""
    import os
    import re

    from effattn.backends.triton.linear import launch
    path = os.path.join(os.path.dirname(os.path.dirname(effattn.__file__)), "benchmarks", "results", "offline-sm90",
                        "linear_resources.md")
    with open(path) as f:
        section = f.read().split("## Where the feature map runs", 1)[1]
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    rows = re.findall(r"^\| (bf16|fp16|fp32) \| (\d+) \|.*\| (once|in pass) \| (once|in pass) \|$", section, re.M)
    assert {r[0] for r in rows} == set(names) and len(rows) >= 3, rows
    for dtype, feat, fewer, listed in rows:
        want = launch.map_once(names[dtype], int(feat))
        assert (fewer == "once") == want and (listed == "once") == want, (dtype, feat, fewer, listed)


@pytest.mark.parametrize("bv, fc, rows, n_sm, want", [
    (64, 128, 64, 132, 32),    # 64 x 2 = 128 programs < 132: one halving (256)
    (64, 128, 512, 132, 64),   # enough programs: as chosen
    (64, 128, 4, 132, 16),     # few heads: down to the 16-wide floor
    (64, 128, 4, 0, 64),       # SM count unknown (the CPU): as chosen
])
def test_state_pass_output_tile_rule(bv, fc, rows, n_sm, want):
    from effattn.backends.triton.linear import launch
    assert launch.dv_tile(bv, fc, rows, n_sm) == want


def test_state_pass_splits_dv_at_small_batch_heads(monkeypatch):
    """With an SM count (forced on the CPU) above the state pass's programs, its output features are
    cut in narrower tiles (more programs on the grid's second axis) and the results match the
    unsplit pass's (the same sums per state element)."""
    from effattn.backends.triton.linear import launch
    torch.manual_seed(6)
    q, k = (torch.randn(1, 2, 40, 32, device=DEVICE) for _ in range(2))
    v = torch.randn(1, 2, 40, 32, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    plain = effattn.linear_attention(*leaves, causal=True, backend="triton")
    plain_g = torch.autograd.grad(plain.square().sum(), leaves)
    grids = []
    real = launch.chunk_state_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return real[grid]

    monkeypatch.setattr(launch, "chunk_state_kernel", Spy())
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    split = effattn.linear_attention(*leaves, causal=True, backend="triton")
    split_g = torch.autograd.grad(split.square().sum(), leaves)
    assert grids and all(g[1] == 2 for g in grids), grids        # 32 features: two 16-wide tiles, not one
    torch.testing.assert_close(split, plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(split_g, plain_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture
def map_launches(monkeypatch):
    """Records the feature maps `map_kernel` applies (one entry per launch: the map's code)."""
    from effattn.backends.triton.linear import launch
    maps = []
    real = launch.map_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(**kw):
                maps.append(kw["MAP"])
                return real[grid](**kw)
            return run

    monkeypatch.setattr(launch, "map_kernel", Spy())
    return maps


@pytest.mark.parametrize("fmap", ["elu", "relu"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("once", [True, False], ids=["map-once", "in-pass"])
def test_feature_map_placements_match_float64(fmap, causal, once, map_launches, monkeypatch):
    """Both placements of the feature map (`launch.MAP_ONCE`, per dtype; float32 switched here) give the
    float64 dense rule's result, forward and backward, with an initial state passed in and the final state
    and its gradients (GQA, two chunks and a partial one under the interpreter's 32-row chunks). Once per
    token: one `map_kernel` launch maps q and k in the causal forward, one more in its backward (the
    non-causal calls map k and q apart: two launches each way); in the passes: no map launch."""
    from effattn.backends.triton.linear import launch
    from effattn.feature_maps import KERNEL_MAPS
    from tests.core.test_linear_attention import close_to, oracle, oracle_phi, oracle_state
    monkeypatch.setitem(launch.MAP_ONCE, torch.float32, 0 if once else math.inf)
    torch.manual_seed(21)
    f64 = torch.float64
    B, H, Hkv, L, Lp, D, Dv = 1, 2, 1, 70, 9, 16, 8
    phi = oracle_phi(fmap)
    q, k = (torch.randn(B, h, L, D, dtype=f64) for h in (H, Hkv))
    v = torch.randn(B, Hkv, L, Dv, dtype=f64)
    kp, vp = torch.randn(B, H, Lp, D, dtype=f64), torch.randn(B, H, Lp, Dv, dtype=f64)
    S0, z0 = phi(kp).transpose(-1, -2) @ vp, phi(kp).sum(-2)
    leaves64 = [t.requires_grad_() for t in (q, k, v, S0, z0)]
    leaves = [t.detach().float().requires_grad_() for t in leaves64]
    out, (S, z) = effattn.linear_attention(*leaves[:3], causal=causal, feature_map=fmap,
                                           initial_state=tuple(leaves[3:]), return_state=True, backend="triton")
    per_pass = (1 if causal else 2) if once else 0
    assert map_launches == [KERNEL_MAPS[fmap]] * per_pass
    ref = oracle(q, k, v, phi, causal=causal, normalize=True, S0=S0, z0=z0)
    S_ref, z_ref = oracle_state(k, v, phi, H, S0, z0)
    close_to(out, ref, torch.float32, "out")
    close_to(S, S_ref, torch.float32, "S")
    close_to(z, z_ref, torch.float32, "z")
    douts = [torch.randn_like(t) for t in (ref, S_ref, z_ref)]
    g = torch.autograd.grad((out, S, z), leaves, [d.float() for d in douts])
    g_ref = torch.autograd.grad((ref, S_ref, z_ref), leaves64, douts)
    assert len(map_launches) == 2 * per_pass                 # the backward maps as many once more
    for a, b, name in zip(g, g_ref, ("q", "k", "v", "S0", "z0")):
        close_to(a, b, torch.float32, f"d{name}", grad=True)


def test_map_kernel_rounds_to_the_input_dtype(monkeypatch):
    """`mapped` writes phi(x) in x's dtype, rounded to nearest from the fp32 map (as the passes' dots
    round a tile), for strided operands: two of other heads and lengths (a causal call's q and k, k
    shifted) in one launch, or one; a dtype whose map runs in the passes keeps its operands as they are."""
    from effattn.backends.triton.linear import launch
    from effattn.feature_maps import FMAP_ELU, FMAP_RELU
    x = torch.randn(1, 40, 3, 24, dtype=torch.float32).mul(4).transpose(1, 2)       # (1, 3, 40, 24) strided
    x2 = torch.randn(1, 33, 2, 24, dtype=torch.float32).mul(4).transpose(1, 2)      # (1, 2, 33, 24)
    launches = []
    real = launch.map_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(launch, "map_kernel", Spy())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        monkeypatch.setitem(launch.MAP_ONCE, dtype, 0)
        xd, x2d = x.to(dtype), x2.to(dtype)
        elu, elu2 = launch.mapped(launch.Rows(xd, 0, FMAP_ELU), launch.Rows(x2d, -7, FMAP_ELU))
        relu, = launch.mapped(launch.Rows(xd, 0, FMAP_RELU))
        assert elu2.shift == -7 and elu.fmap == elu2.fmap == 0 and elu2.x.dtype == dtype and elu2.x.is_contiguous()
        for got, raw in ((elu, xd), (elu2, x2d)):
            ref = torch.where(raw > 0, raw.float() + 1, raw.float().exp())
            # rounded to nearest (half an ulp of the dtype), beside a few fp32 ulps of exp's own error
            tol = (torch.finfo(dtype).eps / 2 + 4 * torch.finfo(torch.float32).eps) * ref.abs()
            assert ((got.x.float() - ref).abs() <= tol + (2 ** -25 if dtype == torch.float16 else 0)).all()
        assert torch.equal(relu.x, xd.clamp_min(0))
        monkeypatch.setitem(launch.MAP_ONCE, dtype, math.inf)
        kept = launch.Rows(xd, 0, FMAP_ELU)
        assert launch.mapped(kept) == (kept,)
    assert len(launches) == 6                                       # two launches per dtype, q and k in one
