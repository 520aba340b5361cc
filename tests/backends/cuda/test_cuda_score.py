"""Score terms in the CUDA kernels (softcap, attention sinks, ALiBi, relative tables, adaptive span,
dense bias tensors), run on the CPU through their host emulation (EFFATTN_CUDA_EMU=1), against the
float64 oracle forward and backward, parameter gradients included (test_score.check): every term
alone and all of them together with causal / window / GQA / padding / layout / rows that see no key,
several query and key tiles, every head-dim bucket of the instances with bias tensors, bf16 and fp16,
the Hopper forward (and its refusal of the bias tensors), per-head span windows, bitwise repeatable
gradients, T5's bias through effattn.nn.T5RelativeBias, and what explain says."""
import shutil

import pytest
import torch

import effattn
from effattn.bias import ALiBi, Relative, Span
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


KINDS = ["softcap", "sinks", "alibi", "alibi-BH", "cuda-all", "relative", "relative-past", "span", "dense",
         "dense-bcast", "all"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["causal", "causal-Lq>Lk-empty"])
def test_terms_against_float64(kind, mode):
    shape, kw = MODES[mode]
    check(shape, kind, kw, torch.bfloat16, backend="cuda")


@pytest.mark.parametrize("mode", [m for m in MODES if m not in ("causal", "causal-Lq>Lk-empty")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["cuda-all", "all"])
def test_all_terms_with_every_mask(kind, mode, dtype):
    """"cuda-all": the terms of the kernels without bias tensors; "all": every term (softcap, sinks,
    ALiBi, a relative table, a span and a (B, 1, Lq, 1) dense bias), on the instances with them."""
    shape, kw = MODES[mode]
    check(shape, kind, kw, dtype, backend="cuda")


@pytest.mark.parametrize("kind", ["cuda-all", "all"])
def test_terms_at_positions_with_an_fp32_output(kind):
    """A context-parallel chunk: the terms' distances are the positions' (q_start + i) - (k_start + j), in
    the forward and in the backward's parameter gradients; two query tiles, the dQ pass's partials."""
    check((1, 2, 2, 70, 40, 16), kind, dict(causal=True, window=90, positions=(100, 70), out_dtype=torch.float32),
          torch.bfloat16, backend="cuda")


def test_terms_dropout_at_positions_and_a_head_shard():
    """softcap and ALiBi with dropout on a chunk at positions on heads 2..3 of 4: the whole call's pairs
    (the score kernels' forward takes drop_at)."""
    from tests.core.test_score_packed import check_terms_dropout_mask
    check_terms_dropout_mask("cuda", torch.bfloat16)


def test_several_tiles_and_batch_slopes():
    """Query and key tiles beyond the first (64 rows): the slope partials of several tiles summed."""
    check((1, 2, 1, 80, 100, 16), "alibi-BH", dict(causal=True), torch.bfloat16, backend="cuda")
    check((2, 2, 2, 70, 70, 24), "cuda-all", dict(window=(30, 4)), torch.float16, backend="cuda")


@pytest.mark.parametrize("shape,kind,kw,dtype", [
    ((1, 2, 1, 80, 100, 16), "relative", dict(causal=True), torch.bfloat16),      # table entries across tiles
    ((1, 2, 1, 80, 100, 16), "all", dict(window=(50, 7)), torch.float16),
    ((2, 2, 2, 70, 70, 24), "dense", dict(window=(30, 4)), torch.float16),
    ((1, 2, 2, 70, 90, 128), "all", dict(causal=True), torch.bfloat16),            # dK/dV query tiles of 32
    ((1, 2, 2, 40, 70, 256), "all", dict(causal=True), torch.bfloat16),            # key tiles of 32, split columns
], ids=["relative-tiles", "all-window", "dense-window", "all-d128", "all-d256"])
def test_bias_tensors_several_tiles_and_buckets(shape, kind, kw, dtype):
    check(shape, kind, kw, dtype, backend="cuda")


@pytest.mark.parametrize("mode", [dict(causal=True), dict(window=(40, 5)), {}], ids=["causal", "window", "none"])
def test_span_per_head_windows(mode):
    """Each head's kernels visit the key (dK/dV: query) tiles of its own span z[h] + ramp: heads whose
    spans end in different tiles, GQA (a dK/dV block walks each of its query heads' ranges), Lq < Lk."""
    check((1, 4, 2, 53, 70, 8), "span-per-head", mode, torch.bfloat16, backend="cuda")


def test_hopper_forward_serves_the_terms(monkeypatch):
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    assert "Hopper wgmma" in effattn.explain(q, q, q, backend="cuda", softcap=1.0).paths["cuda"]
    check((1, 2, 2, 70, 70, 64), "cuda-all", dict(causal=True), torch.bfloat16, backend="cuda")


def test_hopper_forward_refuses_bias_tensors(monkeypatch):
    """The bias tensors run on the mma.sync forward's instances with them (explain says why), also
    where the Hopper forward would run; its op refuses them by name."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "1")
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    e = effattn.explain(q, q, q, backend="cuda", bias=Relative(torch.zeros(2, 5), max_distance=2))
    assert "Hopper forward is not used: relative tables, adaptive span and dense bias" in e.paths["cuda"]
    check((1, 2, 2, 70, 70, 64), "all", dict(causal=True), torch.bfloat16, backend="cuda")
    ops = torch.ops.effattn_cuda_emu
    with pytest.raises(RuntimeError, match="Hopper forward does not serve relative tables"):
        ops.attention_fwd_sm90(q, q, q, None, None, 0, 0, None, 0, None, 0.1, 0.0, -1, -1,
                               rel=torch.zeros(2, 5), rel_max=2)


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
    table, z, dense = torch.randn(2, 41, generator=g), torch.tensor([9.5, 30.0]), torch.randn(1, 2, 70, 70, generator=g)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes, sinks, table, z, dense)]
        out = effattn.attention(*leaves[:3], causal=True, softcap=3.0, sinks=leaves[4],
                                bias=[ALiBi(leaves[3]), Relative(leaves[5], max_distance=20),
                                      Span(leaves[6], ramp=8, max_span=40), leaves[7]], backend="cuda")
        out.float().square().sum().backward()
        return [t.grad for t in leaves]

    first = grads()
    assert all(gr is not None and bool(gr.abs().sum() > 0) for gr in first)
    for a, b in zip(first, grads()):
        assert torch.equal(a, b)


def test_dense_bias_without_grad_and_one_term_per_kind():
    """A dense bias that needs no gradient costs no (B, H, Lq, Lk) buffer (its gradient is None); two
    tables are refused with a reason (sum them first)."""
    q, k, v = (torch.randn(1, 2, 20, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask_bias = torch.zeros(20, 20).masked_fill(torch.rand(20, 20) < 0.3, -1e4)
    out = effattn.attention(q, k, v, bias=mask_bias, backend="cuda")
    ref = effattn.attention(q, k, v, bias=mask_bias, backend="torch")
    assert (out.float() - ref.float()).abs().max() < 3e-2
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    two = [Relative(torch.zeros(2, 5), max_distance=2), Relative(torch.zeros(2, 3), max_distance=1)]
    e = effattn.explain(q, k, v, backend="cuda", bias=two)
    assert any("2 bias terms of kind Relative" in r for r in e.reasons["cuda"])


def test_t5_relative_bias_matches_transformers():
    """effattn.nn.T5RelativeBias on the CUDA kernels against T5's own bias (transformers' bucket function,
    materialized densely) on the float64 oracle: the kernels read the table at the clipped distance, so
    the bucket of every (query, key) pair is the Python one (bidirectional encoder, causal decoder)."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from effattn.nn import T5RelativeBias
    from effattn.testing.oracle import score_attention
    g = torch.Generator().manual_seed(5)
    for bidirectional, L, kw in ((True, 90, {}), (False, 75, dict(causal=True))):
        mod = T5RelativeBias(2, num_buckets=8, max_distance=20, bidirectional=bidirectional)
        with torch.no_grad():
            mod.relative_attention_bias.weight.copy_(torch.randn(8, 2, generator=g))
        q, k, v = (torch.randn(1, 2, L, 16, generator=g, dtype=torch.bfloat16) for _ in range(3))
        out = effattn.attention(q, k, v, bias=mod(), backend="cuda", **kw)
        d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
        bucket = t5.T5Attention._relative_position_bucket(-d, bidirectional=bidirectional, num_buckets=8,
                                                          max_distance=20)
        dense = mod.relative_attention_bias.weight.detach().double()[bucket].permute(2, 0, 1)[None]
        ref, _ = score_attention(q.double(), k.double(), v.double(), bias=dense, **kw)
        assert (out.double() - ref).abs().max() < 2e-2


def test_explain_names_what_cuda_serves():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    e = effattn.explain(q, q, q, backend="cuda", softcap=1.0, sinks=torch.zeros(2), bias=ALiBi(torch.ones(2)))
    assert "score terms (bias=alibi, sinks, softcap)" in e.paths["cuda"]
    e = effattn.explain(q, q, q, backend="cuda", bias=[Relative(torch.zeros(2, 5), max_distance=2), q[:1, :1, :, :1]])
    assert "score terms (bias=dense, bias=relative) evaluated in the tile" in e.paths["cuda"]
    assert "the kernel instances with bias tensors" in e.paths["cuda"]
    # a decode-shaped call with a term: the split-KV kernels take none, the prefill kernels serve it
    k = torch.randn(1, 2, 600, 16, dtype=torch.bfloat16)
    assert effattn.explain(q[:, :, :1], k, k, backend="cuda").paths["cuda"].startswith("cuda/decode")
    assert effattn.explain(q[:, :, :1], k, k, backend="cuda", sinks=torch.zeros(2)).paths["cuda"].startswith(
        "cuda/prefill")
