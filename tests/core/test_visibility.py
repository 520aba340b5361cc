"""`effattn.visibility`: the one home of the visibility rule (`Rule`, `normalize_window`,
`clamp_window`), judged against the test oracle's independent mask, and the canonical rule a call
carries (`make_attn_call` builds it once)."""
import pytest
import torch

from effattn import layouts
from effattn._call import make_attn_call
from effattn.layouts import BlockLayout
from effattn.testing.oracle import visibility as oracle_visibility
from effattn.visibility import Rule, clamp_window, normalize_window


def _pairs(Lq, Lk, heads=1, **kw):
    return Rule.of(Lq, Lk, **kw).visible_pairs(heads)


def test_visible_pairs_hand_counted():
    assert _pairs(100, 100) == 100 * 100
    assert _pairs(100, 100, causal=True) == 100 * 101 // 2
    assert _pairs(3, 5, causal=True) == 3 + 4 + 5            # bottom-right: row 0 sees keys 0..2
    assert _pairs(5, 3, causal=True) == 0 + 0 + 1 + 2 + 3    # first Lq - Lk rows see nothing
    assert _pairs(10, 10, causal=True, window=2) == 1 + 2 + 3 * 8
    assert _pairs(10, 10, window=2) == 3 + 4 + 5 * 6 + 4 + 3  # int window, non-causal: (2, 2)
    assert _pairs(10, 10, window=(0, 1)) == 2 * 9 + 1
    assert _pairs(10, 10, 3, causal=True) == 3 * 55


def test_visible_pairs_layout_hand_counted():
    lay = BlockLayout(torch.tensor([[True, False], [True, True]]), block_size=4)
    # L=6: query block 0 (rows 0-3) sees key block 0 (4 keys); block 1 (rows 4-5, partial) sees all 6
    assert _pairs(6, 6, layout=lay) == 4 * 4 + 2 * 6
    assert _pairs(6, 6, causal=True, layout=lay) == (1 + 2 + 3 + 4) + (5 + 6)
    fixed = layouts.sliding_and_summary(1024, 128, local_blocks=4, every=16)
    assert _pairs(1024, 1024, causal=True, layout=fixed) == 8 * (128 * 129 // 2) + (0 + 1 + 2 + 3 * 5) * 128 * 128
    per_head = BlockLayout(torch.tensor([[[True]], [[False]]]), block_size=8)   # 2 heads, 1 block
    assert _pairs(8, 8, 2, layout=per_head) == 64


@pytest.mark.parametrize("seed", range(4))
def test_pairs_masks_and_mask_mod_match_the_oracle(seed):
    """The exact pair count, the token masks and the FlexAttention mask_mod against the test
    oracle's independent mask."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(25):
        Lq, Lk, bs = (int(x) for x in torch.randint(1, 50, (3,), generator=g))
        causal = bool(torch.randint(0, 2, (1,), generator=g))
        window = [None, 3, (2, 5), (0, 1)][int(torch.randint(0, 4, (1,), generator=g))]
        lay = BlockLayout(torch.rand(2, -(-Lq // bs), -(-Lk // bs), generator=g) < 0.5, bs)
        for layout in (None, lay):
            want = oracle_visibility(Lq, Lk, causal=causal, window=window, layout=layout, H=2)[0]  # (2, Lq, Lk)
            rule = Rule.of(Lq, Lk, causal=causal, window=window, layout=layout)
            assert rule.visible_pairs(heads=2) == int(want.sum())
            m = rule.materialize()
            assert torch.equal(want, torch.ones_like(want) if m is None else m[0].expand_as(want))
            mod = rule.mask_mod()
            if mod is not None:
                h, i, j = torch.meshgrid(torch.arange(2), torch.arange(Lq), torch.arange(Lk), indexing="ij")
                assert torch.equal(want, mod(0, h, i, j))


def test_window_convention():
    assert normalize_window(None, False) == (-1, -1)
    assert normalize_window(None, True) == (-1, 0)
    assert normalize_window(3, False) == (3, 3) and normalize_window(3, True) == (3, 0)
    assert normalize_window((2, 5), True) == (2, 0) and normalize_window((2, 5), False) == (2, 5)
    with pytest.raises(ValueError, match="non-negative"):
        normalize_window((-1, 2), False)
    with pytest.raises(TypeError, match="window must be an int"):
        normalize_window(True, False)


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 9), (9, 1), (7, 7), (5, 12), (12, 5)])
@pytest.mark.parametrize("q_offset", [None, 0, 3, -2], ids=lambda o: f"q_offset={o}")
def test_a_window_wider_than_the_sequence_is_no_window(Lq, Lk, q_offset):
    """clamp_window drops exactly the bounds that remove no pair: the clamped rule sees the same
    pairs as the given one, for every window up to past both lengths, and keeps every bound that
    removes one; with positions (``q_offset``, query i at key i + q_offset) as well."""
    o = q_offset
    full = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)

    def mask(left, right=-1):
        m = Rule(Lq, Lk, left, right, q_offset=o).materialize()
        return full if m is None else m
    for left in range(-1, Lk + Lq + 4):
        for right in range(-1, Lk + Lq + 4):
            cl, cr = clamp_window(left, right, Lq, Lk, o)
            assert torch.equal(mask(left, right), mask(cl, cr))
            assert cl in (left, -1) and cr in (right, -1)
            if cl == -1 and left >= 0:
                assert torch.equal(mask(left), full)          # the left bound removed nothing
            if cl >= 0 and Lq > 0:
                assert not torch.equal(mask(cl), full)        # a kept bound removes a pair
            if cr >= 0 and Lq > 0:
                assert not torch.equal(mask(-1, cr), full)


def test_kind():
    assert Rule(4, 4).kind == "dense"
    assert Rule(4, 4, -1, 0).kind == "causal"
    assert Rule(4, 4, 2, 0).kind == "window" and Rule(4, 4, -1, 1).kind == "window"
    lay = BlockLayout(torch.ones(1, 1, 1, dtype=torch.bool), 4)
    assert Rule.of(4, 4, causal=True, layout=lay).kind == "layout"


def test_a_call_carries_its_canonical_rule():
    """make_attn_call builds the rule once: window clamped, causal folded in, the layout's mask; the
    call's window numbers and features read it."""
    q = torch.randn(1, 2, 6, 8)
    k = v = torch.randn(1, 2, 10, 8)
    wide = make_attn_call(q, k, v, window=(100, 100))
    assert (wide.rule.left, wide.rule.right, wide.rule.kind) == (-1, -1, "dense") and "window" not in wide.features()
    call = make_attn_call(q, k, v, causal=True, window=3)
    assert (call.rule.Lq, call.rule.Lk, call.rule.left, call.rule.right) == (6, 10, 3, 0)
    assert (call.window_left, call.window_right) == (3, 0) and call.rule.kind == "window"
    assert "window" in call.features() and "causal" in call.features()
    lay = BlockLayout(torch.ones(1, 2, 3, dtype=torch.bool), 4)
    laid = make_attn_call(q, k, v, layout=lay)
    assert laid.rule.layout_mask is lay.mask and laid.rule.layout_block == 4 and laid.rule.kind == "layout"
    a = call.op_args()
    assert (a.window_left, a.window_right, a.layout_mask, a.layout_block) == (3, 0, None, 0)
