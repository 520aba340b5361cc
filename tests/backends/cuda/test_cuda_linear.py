"""The CUDA backend's linear-attention kernels (csrc/linear_*.cuh), run on the CPU through their host
emulation (EFFATTN_CUDA_EMU=1, see csrc/emu/): the shared linear-attention suite
(test_linear_attention.py, its emulation-sized subset) against the float64 oracle, then what is
specific to these kernels: feature and value tiles that cross the kernels' tile edges, bitwise
equal results under every thread schedule, the FAVOR+ prologue kernel against FavorFeatures, one
wavefront per ldmatrix phase (the swizzle), and what explain says.

The emulated extension is compiled with g++ on first use (about 40 s) and cached.
"""
import shutil

import pytest
import torch

import effattn
from effattn.feature_maps import FavorFeatures
from effattn.testing.oracle import feature_map
from tests.conftest import EMU_DEFAULT_SCHEDULE, run_sanitized
from tests.core import test_linear_attention as shared

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)

F64 = torch.float64


# ------------------------------------------------------------------ the shared suite, backend "cuda"

ORACLE = shared._rotate("cuda", shared.ORACLE_COMBOS, shared.SHAPES)
LOW = shared._low_params(["cuda"])
SEGMENTS = shared._rotate("cuda", shared.SEG_COMBOS)


@pytest.mark.parametrize("params", ORACLE, ids=[shared._id(p) for p in ORACLE])
def test_shared_dense_oracle(params):
    shared.test_matches_dense_oracle(*params)


@pytest.mark.parametrize("params", LOW, ids=[shared._id(p) for p in LOW])
def test_shared_low_precision(params):
    shared.test_low_precision_within_2x_of_naive(*params)


@pytest.mark.parametrize("params", SEGMENTS, ids=[shared._id(p) for p in SEGMENTS])
def test_shared_segments_with_state(params):
    shared.test_segments_with_state_equal_one_call(*params)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shared_initial_state_per_query_head(causal):
    shared.test_initial_state_per_query_head_and_its_gradient("cuda", causal)


def test_shared_state_passing_and_decoding():
    shared.test_state_dtype_and_low_precision_state_passing("cuda")
    shared.test_decode_100_tokens_one_at_a_time("cuda")        # one-token calls: the step kernel


def test_shared_edge_behaviour():
    shared.test_relu_query_that_sees_nothing_outputs_zero_not_nan("cuda")
    shared.test_causal_lq_gt_lk_leading_queries_output_zero("cuda")


def test_shared_compiles_without_graph_breaks():
    shared.test_compiles_without_graph_breaks("cuda", True)


# --------------------------------------------------------------------------- kernel-specific checks

def _call(q, k, v, **kw):
    return effattn.linear_attention(q, k, v, backend="cuda", **kw)


# (B, H, Hkv, Lq, Lk, D, Dv, feature map): F = 72 > 64 spans two state-pass row tiles and three
# 32-wide feature slices of the output pass; Dv = 80 two column tiles; L = 70 two chunks
TILE_CASES = [
    (1, 2, 1, 70, 70, 72, 80, "elu", torch.float32),
    (1, 4, 2, 40, 70, 72, 80, "relu", torch.bfloat16),      # Lq < Lk: a base state from the first 30 keys
    (1, 2, 2, 70, 3, 8, 72, "identity", torch.float16),     # Lq > Lk: keys on the timeline at row + 67
]


@pytest.mark.parametrize("case", TILE_CASES, ids=[f"D{c[5]}-Dv{c[6]}-Lq{c[3]}-Lk{c[4]}-{c[7]}-{str(c[8])[6:]}"
                                                  for c in TILE_CASES])
def test_tile_edges_against_float64(case):
    B, H, Hkv, Lq, Lk, D, Dv, fmap, dtype = case
    torch.manual_seed(Lq * 1000 + D)
    pos = fmap == "identity"
    q, k, v = shared.make_qkv((B, H, Hkv, Lq, Lk, D, Dv, False), positive=pos)
    S0 = torch.rand(B, H, D, Dv, dtype=F64)
    z0 = torch.rand(B, H, D, dtype=F64) + 1
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    leaves += [S0.float().requires_grad_(), z0.float().requires_grad_()]
    out, (S, z) = _call(*leaves[:3], causal=True, feature_map=fmap, initial_state=tuple(leaves[3:]), return_state=True)
    refs = [t.clone().requires_grad_() for t in (q, k, v, S0, z0)]
    phi = feature_map(fmap)
    ref = shared.oracle(*refs[:3], phi, causal=True, normalize=True, S0=refs[3], z0=refs[4])
    S_ref, z_ref = shared.oracle_state(refs[1], refs[2], phi, H, refs[3], refs[4])
    douts = (torch.randn_like(ref), torch.randn_like(S_ref), torch.randn_like(z_ref))
    grads = torch.autograd.grad((out, S, z), leaves, [d.to(t.dtype) for d, t in zip(douts, (out, S, z))])
    grads_ref = torch.autograd.grad((ref, S_ref, z_ref), refs, douts)
    # the products keep ~24 bits (fp32), 16 (fp16), 8 (bf16), inputs rounded to the dtype
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    for name, got, want in zip(["out", "S", "z", "dq", "dk", "dv", "dS0", "dz0"], (out, S, z) + grads,
                               (ref, S_ref, z_ref) + grads_ref):
        assert got.shape == want.shape and not got.isnan().any(), name
        err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        assert err <= tol * (10 if name.startswith("d") else 1), (name, err)


def _det_run(emulation, schedule):
    emulation.emu_set_schedule(schedule)
    try:
        torch.manual_seed(9)
        q, k, v = (torch.randn(1, h, 70, d).to(torch.float16).requires_grad_() for h, d in ((4, 16), (2, 16), (2, 16)))
        S0, z0 = torch.rand(1, 4, 16, 16, requires_grad=True), torch.rand(1, 4, 16, requires_grad=True)
        out, (S, z) = _call(q, k, v, causal=True, initial_state=(S0, z0), return_state=True)
        full = _call(q, k, v, causal=False)
        loss = (out.float() * torch.linspace(-1, 1, 16)).sum() + S.square().sum() + z.sum() + full.float().sum()
        return [t.detach() for t in (out, S, z, full)] + list(torch.autograd.grad(loss, (q, k, v, S0, z0)))
    finally:
        emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_step_kernel_with_favor_features(dtype):
    """One-token calls (the step kernel) on FAVOR+ features (fp32 for fp16 calls, bf16 for bf16)
    continue a chunked call's state as the chunked call would."""
    torch.manual_seed(4)
    m = FavorFeatures(8, 24, seed=2)
    q, k, v = (torch.randn(1, h, 6, 8).to(dtype) for h in (2, 1, 1))
    full, (S_full, z_full) = _call(q, k, v, causal=True, feature_map=m, return_state=True)
    with torch.no_grad():
        o, state = _call(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True, feature_map=m, return_state=True)
        outs = [o]
        for t in (4, 5):
            o, state = _call(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], causal=True, feature_map=m,
                             initial_state=state, return_state=True)
            outs.append(o)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(torch.cat(outs, 2).float(), full.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state[0], S_full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[1], z_full, rtol=1e-4, atol=1e-4)


def test_bitwise_equal_under_every_schedule(emulation):
    """No atomics, fixed summation orders: lockstep, warp-serial and reversed warp-serial runs give
    the same bits, forward and backward (GQA sums over query heads included)."""
    runs = [_det_run(emulation, s) for s in (0, 1, 2)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_favor_prologue_kernel_against_favor_features():
    """The FAVOR+ kernel and its backward against FavorFeatures in float64, the exponent cap included."""
    from effattn.backends.cuda.linear.favor import cuda_favor_features
    m = FavorFeatures(12, 40, seed=1)
    with torch.no_grad():
        m.projection[0] *= 4                       # |w|^2 / 2 > 30: the cap can act at x' = w
    x = torch.randn(2, 3, 70, 12, dtype=F64)
    x[0, 0, 0] = m.projection[0].double() / m.scale ** 0.5
    xf = x.float().requires_grad_()
    w = m.projection.clone().requires_grad_()
    got = cuda_favor_features(xf, w, m.scale)
    x64, w64 = x.clone().requires_grad_(), m.projection.double().clone().requires_grad_()
    xs = x64 * m.scale ** 0.5
    u = xs @ w64.T - 0.5 * (xs * xs).sum(-1, keepdim=True)
    assert (u > 30).any()
    ref = torch.exp(u.clamp(max=30.0)) / 40 ** 0.5
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=1e-7)
    d = torch.randn_like(ref)
    gx, gw = torch.autograd.grad(got, (xf, w), d.float())
    rx, rw = torch.autograd.grad(ref, (x64, w64), d)
    torch.testing.assert_close(gx.double(), rx, rtol=1e-4, atol=1e-4 * rx.abs().max().item())
    torch.testing.assert_close(gw.double(), rw, rtol=1e-4, atol=1e-4 * rw.abs().max().item())


def test_swizzled_tiles_one_wavefront_per_ldmatrix_phase(emulation):
    emulation.emu_stats()
    q, k, v = (torch.randn(1, 2, 70, d, dtype=torch.bfloat16) for d in (64, 64, 64))
    _call(q, k, v, causal=True)
    blocks, mma, phases, wavefronts, worst = emulation.emu_stats().tolist()
    assert mma > 0 and phases > 0
    assert worst == 1 and wavefronts == phases


def test_explain_names_the_fused_map_the_favor_prologue_and_the_step():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    text = str(effattn.explain(q, k, v, op="linear_attention"))
    assert "cuda" in text and "feature map 'elu' fused into the kernels' loads" in text
    favor = str(effattn.explain(q, k, v, op="linear_attention", feature_map=FavorFeatures(8, 16, seed=0)))
    assert "FAVOR+ features computed by a CUDA prologue kernel" in favor
    step = effattn.explain(q[:, :, :1], k[:, :, :1], v[:, :, :1], op="linear_attention")
    assert step.can_serve("cuda/linear-step") and step.paths["cuda"] == "cuda/linear-step"
    assert "not one token (Lq=5, Lk=5)" in effattn.explain(q, k, v, op="linear_attention").row("cuda/linear-step").reasons


def test_linear_kernels_under_address_and_ub_sanitizers():
    """Every pass and operand permutation of a forward and backward, a split reduction, the step and
    FAVOR+ kernels on heap buffers of exactly the tensors' size (csrc/emu/linear_selftest.cpp),
    lockstep and warp-serial: any read or write past them is reported, no output is left NaN."""
    for schedule in ("0", "1"):
        out = run_sanitized("linear_selftest.cpp", schedule)
        assert out.count("nan=0") == 3, out


def test_causal_op_passes_opcheck():
    """Schema, fake tensor, autograd registration and AOT dispatch of the causal forward op."""
    from effattn.backends.cuda.linear.ops import cuda_linear_causal_fwd
    q, k, v = (torch.randn(1, h, 20, 8, requires_grad=True) for h in (2, 1, 1))
    S0, z0 = torch.rand(1, 2, 8, 8, requires_grad=True), torch.rand(1, 2, 8, requires_grad=True)
    torch.library.opcheck(cuda_linear_causal_fwd, (q, k, v, S0, z0, 0, 1, True, 1e-6))
