"""The Triton forward's trial switches (forward.py: ``KV_TMA``, ``WARP_SPEC``; off by default) in the
interpreter: the same results as the default path against the float64 oracle, on shapes whose last
key tile is partial and whose head dim is padded (where the descriptors' zero fill stands in for
the masked loads), with GQA, a window and a block layout."""
import pytest
import torch

from effattn.backends.triton.attention import launch
from effattn.layouts import sliding_and_summary
from effattn.testing.oracle import chunked_attention

# (B, H, Hkv, Lq, Lk, D, attention kwargs)
CASES = {
    "causal-partial-tiles-D48-gqa": (1, 4, 2, 40, 70, 48, dict(causal=True)),
    "layout-bs32-window-D32": (2, 2, 2, 64, 64, 32, dict(causal=True, window=(40, 0),
                                                         layout=sliding_and_summary(64, 32, 1, 2))),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_trial_switches_match_float64(case_id, switches=("tma", "ws")):
    B, H, Hkv, Lq, Lk, D, kw = CASES[case_id]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = (torch.randn(B, Hkv, Lk, D, generator=g) for _ in range(2))
    left, right = kw.get("window", (-1, 0))
    lay = kw.get("layout")
    args = (lay.mask if lay is not None else None, lay.block_size if lay is not None else 0, None, None, D ** -0.5,
            0.0, left, right, False)
    ref, _, _, _ = chunked_attention(q, k, v, torch.zeros_like(q), dtype=torch.float64, **kw)
    base, _ = launch.fwd(q, k, v, *args, config=(32, 32, 4, 1))
    got, lse = launch.fwd(q, k, v, *args, config=(32, 32, 4, 1) + switches)
    assert not torch.isnan(got).any() and torch.isfinite(lse).all()
    err, base_err = ((x.double() - ref).abs().max().item() for x in (got, base))
    assert err <= 2 * base_err + 1e-6, (err, base_err)


def test_tma_needs_unit_stride_rows():
    q = torch.randn(1, 1, 16, 16)
    k = torch.randn(1, 1, 16, 16).transpose(2, 3)            # (B, H, L, D) with stride 16 along D
    with pytest.raises(ValueError, match="KV_TMA: k needs unit stride"):
        launch.fwd(q, k, q, None, 0, None, None, 0.2, 0.0, -1, 0, False, config=(32, 32, 4, 1, "tma"))


def test_opcode_counts_of_the_trial_table():
    from tools.triton.kernel_resources import opcode_counts
    sass = """
        /*0000*/               @P0 UTMALDG.2D [UR8], [UR4] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;
        /*0020*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;
        /*0030*/                   UTMALDG.2D [UR16], [UR4] ;
    """
    assert opcode_counts(sass) == dict(instrs=4, utmaldg=2, ldgsts=1, setmaxreg=1)


@pytest.mark.parametrize("capability, dtype, transposed, want", [
    ((9, 0), torch.bfloat16, False, True),      # H100 / H200, contiguous 16-bit K / V: TMA
    ((10, 0), torch.float16, False, True),
    ((8, 0), torch.bfloat16, False, False),     # A100: no TMA
    (None, torch.bfloat16, False, False),       # no GPU
    ((9, 0), torch.float32, False, False),      # 4-byte inputs keep their loads
    ((9, 0), torch.bfloat16, True, False),      # D not the unit-stride axis
])
def test_tma_applies_rule(capability, dtype, transposed, want):
    k = torch.empty(1, 2, 64, 64, dtype=dtype)
    k = k.transpose(2, 3) if transposed else k
    assert launch.kv_tma_applies(k, k, capability) == want


def test_tma_is_the_forward_default_where_it_applies(monkeypatch):
    """Off the interpreter the forward reads K / V through TMA when `kv_tma_applies` (here meta
    tensors with the planner's capability), not with EFFATTN_TRITON_TMA=0 nor for an A100; in the
    interpreter a config asks for it by its tag. A forward whose default turns TMA on launches its
    config with the switch and computes what the plain loads do."""
    q = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "META_CAPABILITY", (9, 0))
    assert launch.tma_default(q, q, q)
    monkeypatch.setenv("EFFATTN_TRITON_TMA", "0")
    assert not launch.tma_default(q, q, q)
    monkeypatch.delenv("EFFATTN_TRITON_TMA")
    monkeypatch.setattr(launch, "META_CAPABILITY", (8, 0))
    assert not launch.tma_default(q, q, q)
    monkeypatch.undo()
    assert not launch.tma_default(q, q, q)                     # the interpreter
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    plain, _ = launch.fwd(q, k, v, None, 0, None, None, 0.2, 0.0, -1, 0, config=(32, 32, 4, 1))
    seen = []
    real = launch.fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(**kw):
                seen.append(kw["KV_TMA"])
                return real[grid](**kw)
            return run

    monkeypatch.setattr(launch, "tma_default", lambda q, k, v: True)
    monkeypatch.setattr(launch, "fwd_kernel", Spy())
    got, _ = launch.fwd(q, k, v, None, 0, None, None, 0.2, 0.0, -1, 0, config=(32, 32, 4, 1))
    assert seen == [True]
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-6)


def test_tma_and_register_capped_candidates(monkeypatch):
    """The "tma"-tagged candidates (128 x 128 at D = 128) are tried only where TMA applies; a
    "r<N>" tag launches with Triton's maxnreg = N (the interpreter takes and ignores it: same bits)."""
    from effattn.backends.triton.attention import configs
    assert (128, 128, 8, 3, "tma") in configs.candidates("fwd", 128, 2)
    assert (128, 64, 8, 4, "r128") in configs.candidates("fwd", 64, 2)
    q = torch.randn(1, 1, 16, 16)
    p = launch.plan_for(q, q, q, None, 0, None, 0.2, 0.0, -1, 0)
    assert p.fwd_args((32, 32, 4, 1, "r128"), q, q, q, False)[3]["maxnreg"] == 128
    tried = []
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "candidates", lambda *a, **k: [(64, 64, 4, 3, "tma"), (32, 32, 4, 1, "r128")])
    monkeypatch.setenv("EFFATTN_TRITON_AUTOTUNE", "0")
    launch._launch_tuned("fwd", p, tried.append, q.device, usable=lambda c: "tma" not in c[4:], key_extra=("t",))
    launch._TUNED.pop(("fwd",) + p.tune_key + ("t",))
    assert tried == [(32, 32, 4, 1, "r128")]
    monkeypatch.undo()
    base, _ = launch.fwd(q, q, q, None, 0, None, None, 0.2, 0.0, -1, 0, config=(32, 32, 4, 1))
    capped, _ = launch.fwd(q, q, q, None, 0, None, None, 0.2, 0.0, -1, 0, config=(32, 32, 4, 1, "r128"))
    assert torch.equal(base, capped)
