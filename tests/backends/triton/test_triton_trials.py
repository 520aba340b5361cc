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
