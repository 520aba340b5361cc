"""Score terms in the CUDA kernels (softcap, attention sinks, ALiBi), run on the CPU through their
host emulation (EFFATTN_CUDA_EMU=1), against the float64 oracle forward and backward, parameter
gradients included (test_score.check): every term alone and all three together with causal / window /
GQA / padding / layout / rows that see no key, bf16 and fp16, the Hopper forward, bitwise repeatable
gradients, and what explain says."""
import shutil

import pytest
import torch

import effattn
from effattn.bias import ALiBi, Relative
from tests.core.test_score import MODES, _terms, check

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]


def _all3(B, H, Lq, Lk, g):
    kw, _ = _terms("sinks", B, H, Lq, Lk, g)
    kw.update(softcap=2.0, bias=ALiBi(0.2 * torch.rand(H, generator=g, dtype=torch.float64)))
    return kw, {}


@pytest.fixture(autouse=True)
def _three_terms(monkeypatch):
    """`check` draws its terms from test_score._terms; "cuda-all" is the three CUDA terms together."""
    from tests.core import test_score
    base = test_score._terms
    monkeypatch.setattr(test_score, "_terms",
                        lambda kind, *a: _all3(*a) if kind == "cuda-all" else base(kind, *a))


KINDS = ["softcap", "sinks", "alibi", "alibi-BH", "cuda-all"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["causal", "causal-Lq>Lk-empty"])
def test_terms_against_float64(kind, mode):
    shape, kw = MODES[mode]
    check(shape, kind, kw, torch.bfloat16, backend="cuda")


@pytest.mark.parametrize("mode", [m for m in MODES if m not in ("causal", "causal-Lq>Lk-empty")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_all_terms_with_every_mask(mode, dtype):
    shape, kw = MODES[mode]
    check(shape, "cuda-all", kw, dtype, backend="cuda")


def test_several_tiles_and_batch_slopes():
    """Query and key tiles beyond the first (64 rows): the slope partials of several tiles summed."""
    check((1, 2, 1, 80, 100, 16), "alibi-BH", dict(causal=True), torch.bfloat16, backend="cuda")
    check((2, 2, 2, 70, 70, 24), "cuda-all", dict(window=(30, 4)), torch.float16, backend="cuda")


def test_hopper_forward_serves_the_terms(monkeypatch):
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    assert "Hopper wgmma" in effattn.explain(q, q, q, backend="cuda", softcap=1.0).paths["cuda"]
    check((1, 2, 2, 70, 70, 64), "cuda-all", dict(causal=True), torch.bfloat16, backend="cuda")


def test_sinks_rows_that_see_no_key():
    """A row with no visible key outputs 0 and its lse is the sink logit; gradients stay finite."""
    H = 2
    q, k, v = (torch.randn(1, H, 6, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    kpm = torch.ones(1, 6, dtype=torch.bool)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = effattn.attention(q, k, v, key_padding_mask=kpm, sinks=sinks, return_lse=True, backend="cuda")
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, sinks.detach()[None, :, None].expand_as(lse))
    (out.float().sum() + lse.sum()).backward()
    # d lse_i / d sink = 1 for such a row
    assert torch.allclose(sinks.grad, torch.full((H,), 6.0))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_parameter_gradients_bitwise_repeatable():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=g, dtype=torch.bfloat16) for _ in range(3))
    slopes, sinks = torch.rand(2, generator=g), torch.randn(2, generator=g)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes, sinks)]
        out = effattn.attention(*leaves[:3], causal=True, softcap=3.0, sinks=leaves[4], bias=ALiBi(leaves[3]),
                                backend="cuda")
        out.float().square().sum().backward()
        return [t.grad for t in leaves]

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


def test_explain_names_what_cuda_serves():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    e = effattn.explain(q, q, q, backend="cuda", softcap=1.0, sinks=torch.zeros(2), bias=ALiBi(torch.ones(2)))
    assert "score terms (bias=alibi, sinks, softcap)" in e.paths["cuda"]
    e = effattn.explain(q, q, q, bias=Relative(torch.zeros(2, 5), max_distance=2))
    assert any("bias=relative" in r for r in e.reasons["cuda"])
    # a decode-shaped call with a term: the split-KV kernels take none, the prefill kernels serve it
    k = torch.randn(1, 2, 600, 16, dtype=torch.bfloat16)
    assert effattn.explain(q[:, :, :1], k, k, backend="cuda").paths["cuda"].startswith("cuda/decode")
    assert effattn.explain(q[:, :, :1], k, k, backend="cuda", sinks=torch.zeros(2)).paths["cuda"].startswith(
        "cuda/prefill")
