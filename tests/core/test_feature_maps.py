"""Feature maps: named maps, resolve_feature_map, and Performer FAVOR+ random features."""
import math

import pytest
import torch

from effattn.feature_maps import FAVOR_MAX_EXPONENT, FavorFeatures, resolve_feature_map
from effattn.linear import linear_attention

torch.set_num_threads(2)
F64 = torch.float64


# ------------------------------------------------------------------------------------ named maps

@pytest.mark.parametrize("name,expected", [
    ("elu", lambda x: torch.where(x > 0, x + 1, torch.exp(x))),
    ("relu", lambda x: x.clamp_min(0)),
    ("identity", lambda x: x),
])
def test_named_maps(name, expected):
    x = torch.randn(3, 5, 7, dtype=F64)
    torch.testing.assert_close(resolve_feature_map(name)(x), expected(x))


@pytest.mark.parametrize("dtype,want", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                        (torch.float32, torch.float32), (F64, F64)],
                         ids=["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("name", ["elu", "relu", "identity", "favor"])
def test_maps_compute_in_fp32_or_fp64(name, dtype, want):
    phi = FavorFeatures(8, 16, seed=0) if name == "favor" else resolve_feature_map(name)
    assert phi(torch.randn(2, 8).to(dtype)).dtype == want


def test_resolve_passes_callables_and_modules_through():
    fn = lambda x: x.exp()  # noqa: E731
    m = FavorFeatures(4, 4, seed=0)
    assert resolve_feature_map(fn) is fn and resolve_feature_map(m) is m


def test_resolve_rejects_bad_input():
    with pytest.raises(ValueError, match=r"'elu', 'relu', 'identity'"):
        resolve_feature_map("exp")
    with pytest.raises(TypeError, match=r"feature_map must be"):
        resolve_feature_map(None)


# -------------------------------------------------------------------------------------- FAVOR+

def test_favor_defaults_and_shapes():
    m = FavorFeatures(64, seed=0)
    assert m.num_features == round(64 * math.log(64)) == 266
    assert m.scale == pytest.approx(64 ** -0.5)
    assert m.projection.shape == (266, 64) and m.projection.dtype == torch.float32
    assert FavorFeatures(1, seed=0).num_features == 1
    out = m(torch.randn(2, 3, 5, 64))
    assert out.shape == (2, 3, 5, 266) and (out > 0).all()
    with pytest.raises(ValueError, match=r"head_dim=64"):
        m(torch.randn(5, 32))
    for bad in (dict(head_dim=0), dict(head_dim=4, num_features=0), dict(head_dim=4, scale=-1.0)):
        with pytest.raises(ValueError, match=r"FavorFeatures"):
            FavorFeatures(**bad)


def test_favor_projection_fixed_until_redrawn():
    m = FavorFeatures(16, 40, seed=1)
    x = torch.randn(4, 16)
    w0 = m.projection.clone()
    y0 = m(x)
    torch.testing.assert_close(m(x), y0, rtol=0, atol=0)           # fixed across calls
    m.redraw()
    assert not torch.equal(m.projection, w0)
    assert not torch.allclose(m(x), y0)
    w1 = m.projection.clone()
    m.redraw()
    assert not torch.equal(m.projection, w1)                         # each redraw is a fresh draw
    m.redraw(seed=123)
    w2 = m.projection.clone()
    m.redraw(seed=123)
    torch.testing.assert_close(m.projection, w2, rtol=0, atol=0)    # a given seed reproduces
    torch.testing.assert_close(FavorFeatures(16, 40, seed=1).projection, w0, rtol=0, atol=0)


def test_favor_seed_none_follows_torch_manual_seed():
    torch.manual_seed(0)
    a = FavorFeatures(8, 8)
    torch.manual_seed(0)
    b = FavorFeatures(8, 8)
    torch.testing.assert_close(a.projection, b.projection, rtol=0, atol=0)


def test_favor_state_dict_round_trip():
    a = FavorFeatures(16, 40, seed=1)
    a.redraw()
    b = FavorFeatures(16, 40, seed=2)
    assert "projection" in a.state_dict()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


@pytest.mark.parametrize("D,Fn", [(16, 48), (16, 40), (7, 7), (64, 266)], ids=lambda p: str(p))
def test_favor_rows_orthogonal_within_blocks(D, Fn):
    w = FavorFeatures(D, Fn, seed=4).projection.double()
    for start in range(0, Fn, D):
        blk = w[start:start + D]
        unit = blk / blk.norm(dim=1, keepdim=True)
        gram = unit @ unit.T
        torch.testing.assert_close(gram, torch.eye(len(blk), dtype=F64), rtol=0, atol=1e-5)
    # the next block is drawn independently: not orthogonal to the first
    if Fn >= 2 * D:
        assert (w[:D] @ w[D:2 * D].T).abs().max() > 1e-2


def test_favor_row_norms_are_chi_distributed():
    D = 16
    w = FavorFeatures(D, 4096, seed=0).projection.double()
    sq = (w * w).sum(1)  # chi^2_D: mean D, variance 2D
    assert abs(sq.mean().item() - D) < 4 * math.sqrt(2 * D / 4096)
    assert abs(sq.var().item() - 2 * D) < 0.15 * 2 * D
    iid = FavorFeatures(D, 4096, orthogonal=False, seed=0).projection.double()
    assert abs((iid * iid).sum(1).mean().item() - D) < 4 * math.sqrt(2 * D / 4096)


def test_favor_estimates_the_softmax_kernel_with_custom_scale():
    D, scale = 8, 0.3
    m = FavorFeatures(D, 8192, seed=0, scale=scale)
    q, k = torch.randn(16, D, dtype=F64) * 0.5, torch.randn(16, D, dtype=F64) * 0.5
    est = m(q) @ m(k).T
    exact = torch.exp(scale * q @ k.T)
    assert ((est - exact).abs() / exact).mean() < 0.05


def _softmax_approx_error(Fn, seeds=4, D=16, L=64, s=0.3):
    errs = []
    for sd in range(seeds):
        g = torch.Generator().manual_seed(100 + sd)
        q, k = (torch.randn(1, 2, L, D, generator=g, dtype=F64) * s for _ in range(2))
        v = torch.randn(1, 2, L, D, generator=g, dtype=F64)
        exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v
        out = linear_attention(q, k, v, feature_map=FavorFeatures(D, Fn, seed=sd))
        errs.append(((out - exact).norm() / exact.norm()).item())
    return sum(errs) / len(errs)


def test_favor_approximation_error_falls_with_num_features():
    err = {Fn: _softmax_approx_error(Fn) for Fn in (16, 64, 256, 1024)}
    assert err[1024] < err[256] < err[64] < err[16], err
    assert err[1024] < 0.1, err


def test_favor_normalized_output_tracks_softmax_at_d64():
    """A realistic head dim with the default number of features: the features keep their natural
    scale, so eps stays negligible and nothing underflows in float32."""
    torch.manual_seed(0)
    D, L = 64, 64
    q, k = (torch.randn(1, 2, L, D) * 0.3 for _ in range(2))
    v = torch.randn(1, 2, L, D)
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1) @ v
    out = linear_attention(q, k, v, feature_map=FavorFeatures(D, seed=0))
    assert ((out - exact).norm() / exact.norm()).item() < 0.2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_favor_large_norm_inputs_stay_finite_fp32(causal):
    D = 16
    m = FavorFeatures(D, 64, seed=0)
    x = torch.randn(3, 2, 50, D)
    q = (30 * x / x.norm(dim=-1, keepdim=True)).requires_grad_()     # |q| = 30
    k = (30 * torch.roll(x, 1, 2) / x.norm(dim=-1, keepdim=True)).requires_grad_()
    v = torch.randn(3, 2, 50, 8, requires_grad=True)
    assert torch.isfinite(m(q)).all()
    out = linear_attention(q, k, v, causal=causal, feature_map=m)
    assert torch.isfinite(out).all()
    for g in torch.autograd.grad(out.sum(), (q, k, v)):
        assert torch.isfinite(g).all()


def test_favor_exponent_cap_prevents_overflow():
    """An input aligned with the longest projection row: at D=256 the uncapped exponent
    |w|^2 / 2 is far beyond float32's exp range."""
    D = 256
    m = FavorFeatures(D, 512, seed=0)
    w = m.projection[m.projection.norm(dim=1).argmax()]
    assert 0.5 * w.norm().item() ** 2 > 89                            # exp would overflow float32
    x = (w / math.sqrt(m.scale)).expand(1, 1, 4, D).contiguous()     # sqrt(scale) * x == w
    phi = m(x)
    assert torch.isfinite(phi).all()
    assert phi.max().item() == pytest.approx(math.exp(FAVOR_MAX_EXPONENT) / math.sqrt(512), rel=1e-5)
    out = linear_attention(x, x, torch.randn(1, 1, 4, 8), causal=True, feature_map=m)
    assert torch.isfinite(out).all()
