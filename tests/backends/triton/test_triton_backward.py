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
# the five-product backward: dK/dV programs of 16 x 32 tiles that also write dQ partials
FIVE = (16, 32, 0, 0, 4, 1, "dq5")

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


@pytest.mark.parametrize("config", [CONFIG, FIVE], ids=["seven", "five"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_one_launch_backward_against_float64_and_visits(case_id, config):
    """dQ, dK, dV (with an lse gradient) against float64 by the fp32 rule; the dK/dV programs visit
    the plan's query tiles per key tile (summed over the group's heads), the dQ programs the plan's
    key tiles per query tile, each with its own tile sizes. The five-product backward: its dQ
    reduction adds the plan's key tiles per query tile of the dK/dV programs' tile sizes (its
    partial buffer comes NaN-filled from the suite's poisoned torch.empty: a slot read that no
    dK/dV program wrote would show)."""
    case = CASES[case_id]
    B, H, Hkv, Lq, Lk, D, Dv, left, right, lay, _ = case
    q, k, v, layout, pad = make_inputs(case, seed=len(case_id))
    go, gl = fixed(1), fixed(2)
    dq, dk, dv, kv_visits, q_visits = launch_both(q, k, v, layout, pad, left, right, go, gl, config=config,
                                                  counts=True)
    for got, ref in zip((dq, dk, dv), oracle_grads(q, k, v, layout, pad, left, right, go, gl)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    lm, lb = (layout.mask, layout.block_size) if layout is not None else (None, 0)
    m1, n1, m2, n2 = config[:2] * 2 if ta.configs.five_product(config) else config[:4]
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


@pytest.mark.parametrize("config", [CONFIG, FIVE], ids=["seven", "five"])
def test_gqa_split_matches_the_unsplit_backward_and_is_deterministic(config):
    """Splitting each key tile's G = 3 query heads in runs of 2 + 1 or 1 + 1 + 1 gives dK, dV equal to
    the unsplit ones up to fp32 rounding (same dQ bitwise: in the five-product backward each head's
    dQ partials come from one program per key tile whatever the split), the same visits, and the
    same bits on a repeat, dropout included."""
    case = (1, 3, 1, 32, 40, 16, 16, 20, 0, (16, 0.7), 0.2)
    q, k, v, layout, pad = make_inputs(case, seed=9)
    go, gl = fixed(3), fixed(4)
    dq, dk, dv, kv_visits, q_visits = launch_both(q, k, v, layout, pad, 20, 0, go, gl, config=config, counts=True,
                                                  n_split=1)
    for n_split in (2, 3):
        sdq, sdk, sdv, s_kv, s_q = launch_both(q, k, v, layout, pad, 20, 0, go, gl, config=config, counts=True,
                                               n_split=n_split)
        assert torch.equal(sdq, dq) and torch.equal(s_kv, kv_visits) and torch.equal(s_q, q_visits)
        torch.testing.assert_close(sdk, dk, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sdv, dv, atol=1e-6, rtol=1e-6)
    for got, ref in zip((sdq, sdk, sdv), oracle_grads(q, k, v, layout, pad, 20, 0, go, gl)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    runs = [launch_both(q, k, v, layout, pad, 20, 0, go, gl, dropout_p=0.25, config=config, n_split=2)
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


def test_five_product_is_dkdv_programs_then_a_reduction(monkeypatch):
    """The five-product backward launches Delta, a bwd_kernel grid of the dK/dV programs only, then
    one dq_reduce_kernel program per (b, h, query tile of the dK/dV tiles); its gradients equal the
    seven-product's up to fp32 rounding (dQ summed per key tile instead of per query program), with
    dropout too."""
    from tests.backends.triton.test_triton_attention import GridRecorder
    B, H, Hkv, Lq, Lk = 1, 4, 2, 20, 40
    q, k, v, _, _ = make_inputs((B, H, Hkv, Lq, Lk, 16, 16, -1, 0, None, 0.0), seed=3)
    seven = launch_both(q, k, v, None, None, -1, 0, fixed(1), fixed(2), config=CONFIG)
    rec = GridRecorder(monkeypatch)
    five = launch_both(q, k, v, None, None, -1, 0, fixed(1), fixed(2), config=FIVE)
    n_kv = -(-Lk // FIVE[1]) * B * Hkv
    assert rec.grids[1:] == [(-(-Lq // 32) * B * H,), (n_kv,), (-(-Lq // FIVE[0]) * B * H,)], rec.grids
    for a, b in zip(five, seven):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    drops = [launch_both(q, k, v, None, None, -1, 0, fixed(1), fixed(2), dropout_p=0.25, config=c) for c in (FIVE, CONFIG)]
    for a, b in zip(*drops):                           # the same pairs dropped by both
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_five_product_keys_no_query_sees_do_not_leak():
    """A bottom-right causal window (16 queries over 48 keys, left 8): keys 0..23 are seen by no
    query. NaN / inf in them leave dQ and dV bitwise as with clean keys (the dQ products take K
    rows that are zeroed where no query sees them), and their dK is 0."""
    q, k, v, _, _ = make_inputs((1, 2, 2, 16, 48, 16, 16, 8, 0, None, 0.0), seed=4)
    go, gl = fixed(5), fixed(6)
    clean = launch_both(q, k, v, None, None, 8, 0, go, gl, config=FIVE)
    for poison in (float("nan"), float("inf")):
        kp, vp = k.clone(), v.clone()
        kp[:, :, :24] = poison
        vp[:, :, :24] = poison
        dq, dk, dv = launch_both(q, kp, vp, None, None, 8, 0, go, gl, config=FIVE)
        assert torch.equal(dq, clean[0]) and torch.equal(dv, clean[2])
        assert torch.equal(dk[:, :, 24:], clean[1][:, :, 24:]) and not dk[:, :, :24].any()


def test_five_product_refuses_packed_sequences_and_the_autotuner_skips_it(monkeypatch):
    """Packed calls have no five-product backward: a forced config is refused by name; the
    autotuner's candidates pass through the launcher's predicate (five-product ones skipped for a
    packed call)."""
    q, k, v, _, _ = make_inputs((1, 2, 2, 16, 16, 16, 16, -1, 0, None, 0.0), seed=1)
    out, lse = ta.fwd(q, k, v, None, 0, None, None, 0.3, 0.0, -1, 0)
    segs = [(0, 16, 0, 16, 0)]
    with pytest.raises(ValueError, match="five-product"):
        ta.bwd(out, None, q, k, v, out, lse, None, 0, None, None, 0.3, 0.0, -1, 0, config=FIVE, segments=segs)
    tried = []
    monkeypatch.setattr(ta.launch, "_INTERPRET", False)
    monkeypatch.setattr(ta.launch, "candidates", lambda *a, **k: [FIVE, CONFIG])
    monkeypatch.setenv("EFFATTN_TRITON_AUTOTUNE", "0")
    p = ta.launch.plan_for(q, k, v, None, 0, None, 0.3, 0.0, -1, 0)
    ta.launch._launch_tuned("bwd", p, tried.append, q.device, usable=lambda c: not ta.configs.five_product(c),
                            key_extra=("packed-test",))
    ta.launch._TUNED.pop(("bwd",) + p.tune_key + ("packed-test",))
    assert tried == [CONFIG]


# The contract cases of tests/core/test_attention.py the five-product backward runs (fp32; bf16 for
# the case with everything on): causal with empty rows, both window sides, per-head layouts read per
# element, padding with a fully padded batch entry, GQA with everything on, an odd head dim and Dv
FIVE_CONTRACT_CASES = [("causal-Lq>Lk-q50-k19-emptyrows", torch.float32), ("window-pair-3-9", torch.float32),
                       ("layout-perhead-bs16-partial", torch.float32), ("kpm-B2", torch.float32),
                       ("all-gqa-window-layout-kpm", torch.float32), ("all-gqa-window-layout-kpm", torch.bfloat16),
                       ("headdim-odd-D5-Dv3", torch.float32)]


@pytest.fixture
def five_by_default(monkeypatch):
    """The interpreter's backward config replaced by the five-product one for effattn.attention."""
    monkeypatch.setitem(ta.configs.INTERPRET_CONFIGS, "bwd", FIVE)
    yield


@pytest.mark.parametrize("case_id,dtype", FIVE_CONTRACT_CASES)
def test_five_product_contract_cases_against_float64(five_by_default, case_id, dtype):
    """effattn.attention's contract (tests/core/test_attention.py: output, lse and three gradients
    against float64) with the five-product backward."""
    from tests.core import test_attention as contract
    q, k, v, kwargs = contract.make_inputs(contract.CASES[case_id], dtype, transposed=case_id.startswith("all"))
    contract.check_against_oracle(q, k, v, kwargs, dtype, "triton")


@pytest.mark.parametrize("name", ["test_backward_is_bitwise_deterministic", "test_dropout", "test_grad_through_lse",
                                  "test_rows_seeing_no_key_are_zero"])
def test_five_product_contract_properties(five_by_default, name):
    """The contract's backward properties (bitwise repeats, dropout's mask in the gradients, the lse
    gradient, rows that see no key) with the five-product backward."""
    from tests.core import test_attention as contract
    getattr(contract, name)("triton")
