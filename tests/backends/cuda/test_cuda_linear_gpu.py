"""The CUDA linear-attention kernels on a GPU (all `gpu`-marked: skipped without CUDA; they need
effattn._C, built by `pip install --no-build-isolation -e .` with a CUDA torch and nvcc):

- the real kernels against their emulation on the same inputs (the emulation is what the CPU
  suite checks): causal with GQA, Lq != Lk and state, non-causal, FAVOR+, the one-token step;
- (accuracy against float64 at real sizes is tests/contract/test_gpu.py's, which runs every kernel backend);
- bitwise-deterministic forward and backward at L = 4096.
"""

import pytest
import torch

import effattn
from effattn.feature_maps import FavorFeatures
from tests.conftest import need_cuda_extension

pytestmark = pytest.mark.gpu


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs)
CASES = {
    "causal-gqa-state-elu": (1, 4, 2, 150, 150, 64, 64, dict(causal=True, state=True)),
    "causal-Lq<Lk-relu-D72-Dv80": (1, 2, 1, 70, 130, 72, 80, dict(causal=True, feature_map="relu")),
    "full-identity-nonorm": (2, 2, 2, 100, 100, 32, 48, dict(feature_map="identity", normalize=False)),
    "causal-favor": (1, 2, 2, 90, 90, 16, 16, dict(causal=True, feature_map=FavorFeatures(16, 40, seed=0))),
}
EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}


@pytest.mark.parametrize("dtype", list(EPS), ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_real_kernels_match_their_emulation(case_id, dtype, real_and_emulated):
    """Differences come from the tensor cores' summation order and exp: a few units in the last
    place of the dtype (of the parts' precision for fp32)."""
    B, H, Hkv, Lq, Lk, D, Dv, kw = CASES[case_id]
    kw = dict(kw)
    state = kw.pop("state", False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, d, generator=g).to(dtype) for h, L, d in ((H, Lq, D), (Hkv, Lk, D), (Hkv, Lk, Dv)))
    F = kw["feature_map"].num_features if isinstance(kw.get("feature_map"), FavorFeatures) else D
    S0, z0 = torch.rand(B, H, F, Dv, generator=g), torch.rand(B, H, F, generator=g) + 1
    go = torch.randn(B, H, Lq, Dv, generator=g).to(dtype)
    results = {}
    for dev in ("cuda", "cpu"):
        args = {n: (t.to(dev) if isinstance(t, torch.nn.Module) else t) for n, t in kw.items()}
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        extra = dict(initial_state=(S0.to(dev), z0.to(dev)), return_state=True) if state else {}
        res = effattn.linear_attention(*leaves, backend="cuda", **args, **extra)
        out = res[0] if state else res
        with torch.no_grad():                                  # the step kernel
            step = effattn.linear_attention(*(t[:, :, -1:].detach() for t in leaves), backend="cuda", **args,
                                            initial_state=(S0.to(dev), z0.to(dev)), return_state=True)
        grads = torch.autograd.grad(out, leaves, go.to(dev))
        results[dev] = [t.detach().cpu() for t in (out, step[0], *step[1]) + grads]
    for name, a, b in zip(("out", "step", "step S", "step z", "dq", "dk", "dv"), results["cuda"], results["cpu"]):
        scale = b.float().abs().max().clamp_min(1.0).item()
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 8 * EPS[dtype] * scale, f"{name}: real vs emulated {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_linear_is_bitwise_deterministic(causal):
    need_cuda_extension()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(2, 8, 4096, 64, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 4096, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    go = torch.randn_like(q)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, (S, z) = effattn.linear_attention(*leaves, causal=causal, return_state=True, backend="cuda")
        runs.append((out, S, z) + torch.autograd.grad((out, S), leaves, (go, torch.ones_like(S))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
