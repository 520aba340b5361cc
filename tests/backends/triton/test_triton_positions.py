"""The block-sparse Triton kernels' per-row positions feature (``q_pos`` / ``k_pos`` / ``pos_causal``,
the rows of `effattn.lsh_attention`) against the float64 rule (`effattn.testing.oracle.positions_reference`),
forward and both backwards; and that without positions the kernels are launched as before."""
import inspect
import math

import pytest
import torch

from effattn.lsh import SELF_SCORE, lsh_layout
from effattn.testing.oracle import positions_reference

rt = pytest.importorskip("effattn.backends.triton.runtime")
if rt.triton is None or rt._available(torch.device("cpu")) is not None:
    pytest.skip("the Triton interpreter is not usable here", allow_module_level=True)

from effattn.backends.triton.attention import launch, schedule  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEVEN = (16, 32, 32, 16, 4, 1)
FIVE = (16, 32, 0, 0, 4, 1, "dq5")


def inputs(B, H, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    q_pos = torch.stack([torch.randperm(L, generator=g) for _ in range(B * H)]).to(torch.int32)
    k_pos = q_pos.clone()
    k_pos[0, 3:9] = -1                                      # padding keys
    k_pos[-1, torch.randperm(L, generator=g)[:5]] = -1
    return q, k, v, q_pos, k_pos, g


@pytest.mark.parametrize("block, causal, config", [(16, True, SEVEN), (16, False, FIVE), (32, True, FIVE),
                                                   (32, False, SEVEN)],
                         ids=["cl16-causal-seven", "cl16-five", "cl32-causal-five", "cl32-seven"])
def test_positions_match_the_float64_rule_forward_and_backward(block, causal, config):
    B, H, L, D = 1, 2, 64, 16
    q, k, v, q_pos, k_pos, g = inputs(B, H, L, D, block + causal)
    lay = lsh_layout(L, block, 1, 0)
    scale = 0.7
    out, lse = launch.fwd(q, k, v, lay.mask, block, None, None, scale, 0.0, -1, -1, out_fp32=True, q_pos=q_pos,
                          k_pos=k_pos, pos_causal=causal)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = positions_reference(q64, k64, v64, lay.mask, block, q_pos, k_pos, causal, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], rtol=1e-6, atol=2e-5)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g).masked_fill(~fin, 0)
    grads = launch.bwd(dout, dlse, q, k, v, out, lse, lay.mask, block, None, None, scale, 0.0, -1, -1,
                       out_fp32=True, q_pos=q_pos, k_pos=k_pos, pos_causal=causal, config=config)
    ref_grads = torch.autograd.grad((ref, ref_lse.masked_fill(~fin, 0)), (q64, k64, v64), (dout.double(), dlse.double()))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("config", [SEVEN, FIVE], ids=["seven", "five"])
def test_positions_with_grouped_query_heads(config):
    """k_pos is per query head: two query heads sharing a key head see different keys."""
    B, H, Hkv, L, D, block = 1, 4, 2, 32, 16, 16
    q, _, _, q_pos, k_pos, g = inputs(B, H, L, D, 9)
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    lay = lsh_layout(L, block, 1, 0)
    out, lse = launch.fwd(q, k, v, lay.mask, block, None, None, 0.5, 0.0, -1, -1, out_fp32=True, q_pos=q_pos,
                          k_pos=k_pos, pos_causal=True)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = positions_reference(q64, k64, v64, lay.mask, block, q_pos, k_pos, True, 0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape, generator=g)
    grads = launch.bwd(dout, None, q, k, v, out, lse, lay.mask, block, None, None, 0.5, 0.0, -1, -1, out_fp32=True,
                       q_pos=q_pos, k_pos=k_pos, pos_causal=True, config=config)
    for a, b in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_self_score_alone_gives_the_value_and_no_gradient_to_q_or_k():
    """A query whose only visible key is itself (causal, first position): out = v there, lse = SELF_SCORE,
    and its row passes no gradient to q or k."""
    B, H, L, D = 1, 1, 32, 16
    q, k, v, _, _, g = inputs(B, H, L, D, 3)
    pos = torch.arange(L, dtype=torch.int32).view(1, L)
    lay = lsh_layout(L, 16, 0, 0)                           # each chunk sees itself
    out, lse = launch.fwd(q, k, v, lay.mask, 16, None, None, 1.0, 0.0, -1, -1, out_fp32=True, q_pos=pos, k_pos=pos,
                          pos_causal=True)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    assert abs(float(lse[0, 0, 0]) - SELF_SCORE) < 0.05
    dout = torch.zeros_like(out)
    dout[0, 0, 0] = torch.randn(D, generator=g)              # gradient only into the lone row
    dq, dk, dv = launch.bwd(dout, None, q, k, v, out, lse, lay.mask, 16, None, None, 1.0, 0.0, -1, -1,
                            out_fp32=True, q_pos=pos, k_pos=pos, pos_causal=True, config=SEVEN)
    assert dq.abs().max() == 0 and dk.abs().max() == 0
    torch.testing.assert_close(dv[0, 0, 0], dout[0, 0, 0])


def test_dropout_with_positions_uses_the_kernels_philox_mask():
    B, H, L, D, p, block = 1, 2, 32, 16, 0.3, 16
    q, k, v, q_pos, k_pos, g = inputs(B, H, L, D, 5)
    seed = torch.tensor([123, 456])
    eye = torch.eye(L).expand(B, H, L, L).contiguous()
    keep = launch.fwd(q, k, eye, None, 0, None, seed, 1.0, p, -1, -1)[0] != 0     # out = P M / (1 - p), P > 0
    assert 0.5 < keep.float().mean() < 0.85
    lay = lsh_layout(L, block, 1, 0)
    out, lse = launch.fwd(q, k, v, lay.mask, block, None, seed, 0.5, p, -1, -1, out_fp32=True, q_pos=q_pos,
                          k_pos=k_pos, pos_causal=True)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref, _ = positions_reference(q64, k64, v64, lay.mask, block, q_pos, k_pos, True, 0.5,
                                 keep=keep.view(B * H, L, L), dropout_p=p)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape, generator=g)
    grads = launch.bwd(dout, None, q, k, v, out, lse, lay.mask, block, None, seed, 0.5, p, -1, -1, out_fp32=True,
                       q_pos=q_pos, k_pos=k_pos, pos_causal=True, config=SEVEN)
    for a, b in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_without_positions_the_launch_is_unchanged():
    """No positions: no POS meta (the kernels' constexprs default off: the kernel compiled before the
    feature) and the pointers are None (constexpr, not in the signature); the log2 self score is
    `SELF_SCORE`'s."""
    q = torch.empty(1, 2, 64, 16, device="meta")
    p = launch.LaunchPlan(q, q, q, None, 0, None, 0.1, 0.0, -1, -1)
    assert launch.positions_meta(p, None, None, False) == (None, None, {})
    for kern in (launch.fwd_kernel, launch.bwd_kernel):
        params = inspect.signature(kern.fn).parameters
        for name in ("POS", "POS_CAUSAL"):
            assert params[name].default is False and "constexpr" in str(params[name].annotation), (kern, name)
    assert math.isclose(schedule.SELF_SCORE_LOG2.value, SELF_SCORE / math.log(2), rel_tol=1e-15)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(q_pos=torch.zeros(2, 64, dtype=torch.int32)), ValueError, "go together"),
    (dict(q_pos=torch.zeros(2, 64), k_pos=torch.zeros(2, 64, dtype=torch.int32)), TypeError, "q_pos must be an int32"),
    (dict(q_pos=torch.zeros(2, 64, dtype=torch.int32), k_pos=torch.zeros(1, 64, dtype=torch.int32)), ValueError,
     r"k_pos must have shape \(B\*H, 64\)"),
    (dict(pos_causal=True), ValueError, "pos_causal=True needs"),
])
def test_position_errors_name_the_argument(kwargs, err, match):
    q = torch.empty(1, 2, 64, 16, device="meta")
    p = launch.LaunchPlan(q, q, q, None, 0, None, 0.1, 0.0, -1, -1)
    kw = dict(q_pos=None, k_pos=None, pos_causal=False)
    kw.update(kwargs)
    with pytest.raises(err, match=match):
        launch.positions_meta(p, kw["q_pos"], kw["k_pos"], kw["pos_causal"])
