"""The Triton backward's one launch (`bwd_kernel`: dK/dV programs per key tile, then dQ programs per
query tile) and its GQA split (a key tile's query heads over several programs, fp32 partial sums
added in a fixed order), in Triton's interpreter at small sizes: against the float64 oracle, tile
visits against `effattn.tiles`, bitwise determinism, and the split rule for a given SM count.
"""
import pytest
import torch

from effattn import tiles
from effattn.testing.oracle import naive_attention
from tests.conftest import DEVICE

ta = pytest.importorskip("effattn.backends.triton.attention")
rt = pytest.importorskip("effattn.backends.triton.runtime")
if rt.triton is None or rt._available(DEVICE) is not None:
    pytest.skip(f"triton backend unavailable: {rt._available(DEVICE)}", allow_module_level=True)
from tests.backends.triton.test_triton_attention import rand_layout, window_kwargs  # noqa: E402

# the dK/dV programs' tiles (16 x 32) differ from the dQ programs' (32 x 16)
CONFIG = (16, 32, 32, 16, 4, 1)

# id -> (B, H, Hkv, Lq, Lk, D, Dv, left, right, layout (bs, density) or None, kpm fraction)
CASES = {
    "gqa-causal-kpm-q40-k56-Dv24": (1, 4, 2, 40, 56, 16, 24, -1, 0, None, 0.2),
    "gqa3-layout-gather-bs24-window-20-3": (2, 3, 1, 48, 48, 16, 16, 20, 3, (24, 0.6), 0.0),
    "layout-nested-bs32-q50-k37-dense": (1, 2, 2, 50, 37, 8, 16, -1, -1, (32, 0.7), 0.0),
}


def make_inputs(case, seed):
    B, H, Hkv, Lq, Lk, D, Dv, left, right, lay, kpm = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, d, generator=g).to(DEVICE) for h, L, d in ((H, Lq, D), (Hkv, Lk, D), (Hkv, Lk, Dv)))
    layout = rand_layout(H, Lq, Lk, lay[0], lay[1], seed=seed) if lay else None
    pad = (torch.rand(B, Lk, generator=g) < kpm).to(DEVICE) if kpm else None
    return q, k, v, layout, pad


def launch_both(q, k, v, layout, pad, left, right, go, gl, dropout_p=0.0, **bwd_kw):
    """The forward, then the backward launcher with the given config / split / counts."""
    lm, lb = (layout.mask, layout.block_size) if layout is not None else (None, 0)
    seed = torch.tensor([11, 12]) if dropout_p > 0 else None
    out, lse = ta.fwd(q, k, v, lm, lb, pad, seed, 0.3, dropout_p, left, right)
    fin = torch.isfinite(lse)
    return ta.bwd(go(out), torch.where(fin, gl(lse), 0.0), q, k, v, out, lse, lm, lb, pad, seed, 0.3, dropout_p,
                  left, right, **bwd_kw)


def oracle_grads(q, k, v, layout, pad, left, right, go, gl):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_attention(*leaves, layout=layout, key_padding_mask=pad, scale=0.3,
                                   **window_kwargs(left, right))
    fin = torch.isfinite(ref_lse)
    loss = (ref * go(ref).double()).sum() + (torch.where(fin, ref_lse, 0.0) * gl(ref_lse).double()).sum()
    return torch.autograd.grad(loss, leaves)


def fixed(seed):
    """A function of a tensor giving the same random tensor of its shape, dtype and device every call
    (dO, dlse)."""
    def draw(t):
        return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.device, t.dtype)
    return draw


@pytest.mark.parametrize("case_id", list(CASES))
def test_one_launch_backward_against_float64_and_visits(case_id):
    """dQ, dK, dV (with an lse gradient) against float64 by the fp32 rule; the dK/dV programs visit
    the plan's query tiles per key tile (summed over the group's heads), the dQ programs the plan's
    key tiles per query tile, each with its own tile sizes."""
    case = CASES[case_id]
    B, H, Hkv, Lq, Lk, D, Dv, left, right, lay, _ = case
    q, k, v, layout, pad = make_inputs(case, seed=len(case_id))
    go, gl = fixed(1), fixed(2)
    dq, dk, dv, kv_visits, q_visits = launch_both(q, k, v, layout, pad, left, right, go, gl, config=CONFIG,
                                                  counts=True)
    for got, ref in zip((dq, dk, dv), oracle_grads(q, k, v, layout, pad, left, right, go, gl)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    lm, lb = (layout.mask, layout.block_size) if layout is not None else (None, 0)
    m1, n1, m2, n2 = CONFIG[:4]
    vis1, _ = tiles.tile_pairs(Lq, Lk, m1, n1, left, right, lm, lb, DEVICE)     # (Hl, q tiles, k tiles)
    vis2, _ = tiles.tile_pairs(Lq, Lk, m2, n2, left, right, lm, lb, DEVICE)
    per_head_kv = vis1.sum(-2).to(torch.int32).expand(H, -1)                     # per key tile
    want_kv = per_head_kv.reshape(Hkv, H // Hkv, -1).sum(1, dtype=torch.int32).repeat(B, 1)
    want_q = vis2.sum(-1).to(torch.int32).expand(H, -1).repeat(B, 1)
    assert torch.equal(kv_visits, want_kv) and torch.equal(q_visits, want_q)


def test_backward_is_one_launch_after_the_delta_pass(monkeypatch):
    """The backward launches Delta, then one bwd_kernel grid holding every dK/dV and dQ program."""
    from tests.backends.triton.test_triton_attention import GridRecorder
    rec = GridRecorder(monkeypatch)
    B, H, Hkv, Lq, Lk = 1, 4, 2, 20, 40
    q, k, v, layout, pad = make_inputs((B, H, Hkv, Lq, Lk, 16, 16, -1, 0, None, 0.0), seed=3)
    launch_both(q, k, v, None, None, -1, 0, fixed(1), fixed(2), config=CONFIG)
    n_kv, n_q = -(-Lk // CONFIG[1]) * B * Hkv, -(-Lq // CONFIG[2]) * B * H
    assert rec.grids[1:] == [(-(-Lq // 32) * B * H,), (n_kv + n_q,)], rec.grids       # [0]: the forward


def test_gqa_split_matches_the_unsplit_backward_and_is_deterministic():
    """Splitting each key tile's G = 3 query heads in runs of 2 + 1 or 1 + 1 + 1 gives dK, dV equal to
    the unsplit ones up to fp32 rounding (same dQ bitwise), the same visits, and the same bits on a
    repeat, dropout included."""
    case = (1, 3, 1, 32, 40, 16, 16, 20, 0, (16, 0.7), 0.2)
    q, k, v, layout, pad = make_inputs(case, seed=9)
    go, gl = fixed(3), fixed(4)
    dq, dk, dv, kv_visits, q_visits = launch_both(q, k, v, layout, pad, 20, 0, go, gl, config=CONFIG, counts=True,
                                                  n_split=1)
    for n_split in (2, 3):
        sdq, sdk, sdv, s_kv, s_q = launch_both(q, k, v, layout, pad, 20, 0, go, gl, config=CONFIG, counts=True,
                                               n_split=n_split)
        assert torch.equal(sdq, dq) and torch.equal(s_kv, kv_visits) and torch.equal(s_q, q_visits)
        torch.testing.assert_close(sdk, dk, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sdv, dv, atol=1e-6, rtol=1e-6)
    for got, ref in zip((sdq, sdk, sdv), oracle_grads(q, k, v, layout, pad, 20, 0, go, gl)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    runs = [launch_both(q, k, v, layout, pad, 20, 0, go, gl, dropout_p=0.25, config=CONFIG, n_split=2)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("n_kv, G, n_sm, want", [
    (256, 4, 132, 1),     # the dK/dV programs fill the SMs: no split
    (132, 8, 132, 1),
    (32, 4, 132, 4),      # 32 x 4 = 128 programs: every head alone
    (64, 4, 132, 2),      # 3 wanted: runs of 2 + 2 do as well as 2 + 1 + 1
    (64, 8, 132, 3),      # runs of 3 + 3 + 2
    (16, 1, 132, 1),      # no group to split
    (16, 4, 0, 1),        # SM count unknown (the CPU)
])
def test_gqa_split_rule(n_kv, G, n_sm, want):
    assert ta.launch.gqa_splits(n_kv, G, n_sm) == want


def test_split_is_chosen_from_the_sm_count(monkeypatch):
    """With an SM count (forced on the CPU) larger than B * Hkv * key tiles, the launcher splits the
    group's heads on its own: the grid grows by the extra dK/dV programs and the gradients match
    the unsplit ones."""
    from tests.backends.triton.test_triton_attention import GridRecorder
    case = (1, 4, 1, 33, 48, 16, 16, -1, 0, None, 0.0)
    q, k, v, _, _ = make_inputs(case, seed=5)
    go, gl = fixed(5), fixed(6)
    plain = launch_both(q, k, v, None, None, -1, 0, go, gl, config=CONFIG)
    monkeypatch.setattr(ta.launch, "sm_count", lambda device: 132)
    rec = GridRecorder(monkeypatch)
    split = launch_both(q, k, v, None, None, -1, 0, go, gl, config=CONFIG)
    assert rec.grids[-1] == (2 * 4 + 2 * 4,), rec.grids      # 2 key tiles x 4 runs of one head, 2 x 4 query tiles
    assert torch.equal(split[0], plain[0])
    for a, b in zip(split[1:], plain[1:]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
def test_gqa_split_on_the_gpu_at_a_real_size():
    """B * Hkv = 4 kv heads of 8 query heads, L = 1024, D = 128, bf16: 8 key tiles per kv head give 32
    dK/dV programs, fewer than any data-center GPU's SMs, so the launcher splits the heads by
    itself. Against the unsplit backward: dQ the same bits, dK and dV within a bf16 rounding of the
    fp32 sums; the split run repeats bitwise."""
    B, H, Hkv, L, D = 1, 32, 4, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, L, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    go, gl = fixed(7), fixed(8)
    assert ta.launch.gqa_splits(-(-L // 128) * B * Hkv, H // Hkv, ta.launch.sm_count(q.device)) > 1
    plain = launch_both(q, k, v, None, None, -1, 0, go, gl, n_split=1)
    split = [launch_both(q, k, v, None, None, -1, 0, go, gl) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*split))
    assert torch.equal(split[0][0], plain[0])
    for a, b in zip(split[0][1:], plain[1:]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
