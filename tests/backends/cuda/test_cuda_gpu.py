"""The CUDA backend on a GPU (all `gpu`-marked: skipped without CUDA; they need effattn._C, built by
`pip install --no-build-isolation -e .` with a CUDA torch and nvcc):

- the real kernels against their emulation on the same inputs (conformance: the emulation is what
  the CPU test suite checks), every mask kind, dropout masks bit for bit;
- (accuracy against float64 at real sizes is tests/contract/test_gpu.py's, which runs every kernel backend);
- bitwise-deterministic backward.
"""
import math

import pytest
import torch

import effattn
from effattn.layouts import BlockLayout
from tests.conftest import need_cuda_extension

pytestmark = pytest.mark.gpu


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs)
CONFORMANCE = {
    "causal-gqa-D64": (1, 4, 2, 130, 130, 64, 64, dict(causal=True)),
    "window-Lq<Lk-D128-Dv96": (1, 2, 2, 70, 150, 128, 96, dict(window=(40, 7))),
    "layout-kpm-D256": (2, 2, 1, 96, 96, 256, 256, dict(layout=(32, 0.6), kpm=0.2)),
    "dropout-dense-D32": (1, 2, 2, 100, 90, 32, 32, dict(dropout_p=0.3)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case_id", list(CONFORMANCE))
def test_real_kernels_match_their_emulation(case_id, dtype, real_and_emulated):
    """Differences come only from ex2.approx and the tensor cores' summation order: a couple of
    units in the last place of the dtype. Dropout keeps exactly the same elements."""
    B, H, Hkv, Lq, Lk, D, Dv, kw = CONFORMANCE[case_id]
    kw = dict(kw)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, d, generator=g).to(dtype) for h, L, d in ((H, Lq, D), (Hkv, Lk, D), (Hkv, Lk, Dv)))
    go = torch.randn(B, H, Lq, Dv, generator=g).to(dtype)
    if "layout" in kw:
        bs, dens = kw.pop("layout")
        kw["layout"] = BlockLayout(torch.rand(H, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < dens, bs)
    if "kpm" in kw:
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g) < kw.pop("kpm")
    results = {}
    for dev in ("cuda", "cpu"):
        args = {n: (t.to(dev) if isinstance(t, (torch.Tensor, BlockLayout)) else t) for n, t in kw.items()}
        leaves = [t.to(dev).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        out, lse = effattn.attention(*leaves, return_lse=True, backend="cuda", **args)
        results[dev] = [t.detach().cpu() for t in (out, lse) + torch.autograd.grad(out, leaves, go.to(dev))]
    eps = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    if "dropout_p" in kw:
        assert torch.equal(results["cuda"][0] == 0, results["cpu"][0] == 0)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["cuda"], results["cpu"]):
        scale = b.float().abs().max().clamp_min(1.0).item()
        err = (a.float() - b.float()).abs().nan_to_num(posinf=0.0, neginf=0.0).max().item()
        assert err <= 4 * eps * scale, f"{name}: real vs emulated {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused-bwd", "two-pass-bwd"])
def test_gpu_backward_is_bitwise_deterministic(fused, monkeypatch):
    """Ten backward runs on the same inputs give the same bits: the fused backward's dQ is added under an
    ordered per-tile semaphore (its acquire / release order is what the emulation cannot show), the two
    passes write every element once."""
    need_cuda_extension()
    monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", fused)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(2, 8, 2048, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 2048, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    go = torch.randn_like(q)
    for kw in (dict(causal=True, window=500, dropout_p=0.1), dict(causal=False)):
        runs = []
        for _ in range(10):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(1)
            out = effattn.attention(*leaves, backend="cuda", **kw)
            runs.append((out,) + torch.autograd.grad(out, leaves, go))
        for run in runs[1:]:
            for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], run):
                assert torch.equal(a, b), (kw, name)


@pytest.mark.parametrize("case_id", ["txl-past-causal-query-gqa", "shaw-M20-bidir-q-itself-kpm-lse"])
def test_relative_keys_real_kernels_match_their_emulation(case_id, real_and_emulated):
    """The relative-keys forward and backward (csrc/attention/relkeys*.cu) on the GPU against their
    emulation on the same inputs (tests/backends/cuda/test_cuda_relative.py checks the emulation against
    float64): gradients of q, k, v, r and the term's query."""
    from tests.backends.cuda.test_cuda_relative import GRAD_CASES, _inputs
    *case, with_lse = GRAD_CASES[case_id]
    q, k, v, r, query, M, kw, kpm, g = _inputs(*case, torch.Generator().manual_seed(len(case_id)))
    w_out = torch.randn(*q.shape[:3], v.shape[3], generator=g)
    dtype = torch.bfloat16
    leaves0 = [t.to(dtype) for t in (q, k, v, r)] + ([query.to(dtype)] if query is not None else [])
    results = {}
    for dev in ("cuda", "cpu"):
        leaves = [t.to(dev).requires_grad_() for t in leaves0]
        query_ = leaves[4] if len(leaves) == 5 else None
        out, lse = effattn.relative_attention(*leaves[:4], query=query_, max_distance=M, scale=0.4, return_lse=True,
                                              key_padding_mask=None if kpm is None else kpm.to(dev), backend="cuda",
                                              **kw)
        loss = (out.float() * w_out.to(dev)).sum() + (lse.nan_to_num(neginf=0.0).sum() if with_lse else 0)
        results[dev] = [t.detach().cpu() for t in (out, lse) + torch.autograd.grad(loss, leaves)]
    eps = 2.0 ** -7
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dr", "dquery"), results["cuda"], results["cpu"]):
        scale = b.float().abs().nan_to_num(posinf=0.0, neginf=0.0).max().clamp_min(1.0).item()
        err = (a.float() - b.float()).abs().nan_to_num(posinf=0.0, neginf=0.0).max().item()
        assert err <= 8 * eps * scale, f"{name}: real vs emulated {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["causal", "gqa", "kpm", "causal-Lq>Lk-empty"])
def test_score_terms_on_the_real_kernels(mode, dtype):
    """softcap + sinks + ALiBi (the CUDA kernels' score terms) on the GPU against the float64 oracle,
    forward and backward with the parameters' gradients (test_score's rule), at test_score's shapes
    and one of several tiles."""
    need_cuda_extension()
    from tests.backends.cuda import test_cuda_score  # its "cuda-all" kind: the three terms together
    from tests.core import test_score
    base = test_score._terms
    test_score._terms = lambda kind, *a: test_cuda_score._all3(*a) if kind == "cuda-all" else base(kind, *a)
    try:
        shape, kw = test_score.MODES[mode]
        test_score.check(shape, "cuda-all", kw, dtype, backend="cuda")
        if mode == "causal":
            test_score.check((2, 4, 2, 200, 260, 128), "cuda-all", kw, dtype, backend="cuda")
    finally:
        test_score._terms = base
