"""Tests for effattn.layouts: every builder against a pattern drawn by hand from its paper's definition.

In the drawings row = query block, column = key block, X = kept. Unless a test says otherwise the
layouts are 8 x 8 blocks of 16 tokens (seq_len = 128).
"""
import time
import weakref

import pytest
import torch

from effattn.layouts import (
    BlockLayout,
    bigbird,
    fixed,
    from_dense_mask,
    local,
    longformer,
    sliding_and_summary,
    strided,
)

BS = 16
L8 = 8 * BS


def drawn(*rows):
    """Hand-drawn pattern ("X..X", ...) -> bool (nqb, nkb)."""
    assert len({len(r) for r in rows}) == 1
    return torch.tensor([[c == "X" for c in r] for r in rows], dtype=torch.bool)


def assert_pattern(layout, *rows, head=0):
    want = drawn(*rows)
    got = layout.mask[head]
    if not torch.equal(got, want):
        show = "\n".join("".join("X" if b else "." for b in row) for row in got.tolist())
        raise AssertionError(f"layout head {head} is\n{show}\nexpected\n" + "\n".join(rows))


# ----------------------------------------------------------------------------------------------
# builders vs hand-drawn patterns
# ----------------------------------------------------------------------------------------------

def test_local_bidirectional():
    # |qb - kb| < 2
    assert_pattern(local(L8, BS, num_local_blocks=2),
                   "XX......",
                   "XXX.....",
                   ".XXX....",
                   "..XXX...",
                   "...XXX..",
                   "....XXX.",
                   ".....XXX",
                   "......XX")


def test_local_causal():
    # 0 <= qb - kb < 3
    assert_pattern(local(L8, BS, num_local_blocks=3, causal=True),
                   "X.......",
                   "XX......",
                   "XXX.....",
                   ".XXX....",
                   "..XXX...",
                   "...XXX..",
                   "....XXX.",
                   ".....XXX")


def test_strided_causal():
    # Child et al.: A1 = previous l=3 blocks, A2 = (qb - kb) % 3 == 0, kb <= qb
    assert_pattern(strided(L8, BS, stride=3),
                   "X.......",
                   "XX......",
                   "XXX.....",
                   "XXXX....",
                   ".XXXX...",
                   "..XXXX..",
                   "X..XXXX.",
                   ".X..XXXX")


def test_strided_bidirectional():
    # |qb - kb| < 3, or (qb - kb) a multiple of 3 on either side
    assert_pattern(strided(L8, BS, stride=3, causal=False),
                   "XXXX..X.",
                   "XXXXX..X",
                   "XXXXXX..",
                   "XXXXXXX.",
                   ".XXXXXXX",
                   "..XXXXXX",
                   "X..XXXXX",
                   ".X..XXXX")


def test_fixed_causal():
    # l=4, c=1: own window of 4 blocks + summary block 3 (kb % 4 == 3), kb <= qb
    assert_pattern(fixed(L8, BS, stride=4),
                   "X.......",
                   "XX......",
                   "XXX.....",
                   "XXXX....",
                   "...XX...",
                   "...XXX..",
                   "...XXXX.",
                   "...XXXXX")


def test_fixed_bidirectional_two_summaries():
    # l=4, c=2: windows {0..3}, {4..7}; summaries kb % 4 in {2, 3} -> columns 2, 3, 6, 7
    assert_pattern(fixed(L8, BS, stride=4, summary=2, causal=False),
                   "XXXX..XX",
                   "XXXX..XX",
                   "XXXX..XX",
                   "XXXX..XX",
                   "..XXXXXX",
                   "..XXXXXX",
                   "..XXXXXX",
                   "..XXXXXX")


def test_fixed_vary_heads():
    lay = fixed(L8, BS, stride=4, num_heads=3, vary_heads=True)
    assert lay.shape == (3, 8, 8)
    # head 0: the plain pattern (summary column 3 and 7)
    assert_pattern(lay, "X.......", "XX......", "XXX.....", "XXXX....",
                   "...XX...", "...XXX..", "...XXXX.", "...XXXXX", head=0)
    # head 1: summaries shifted one subblock (c=1) left: kb % 4 == 2 -> columns 2, 6
    assert_pattern(lay, "X.......", "XX......", "XXX.....", "XXXX....",
                   "..X.X...", "..X.XX..", "..X.XXX.", "..X.XXXX", head=1)
    # head 2: kb % 4 == 1 -> columns 1, 5
    assert_pattern(lay, "X.......", "XX......", "XXX.....", "XXXX....",
                   ".X..X...", ".X..XX..", ".X..XXX.", ".X..XXXX", head=2)
    # without vary_heads all heads are the plain pattern
    same = fixed(L8, BS, stride=4, num_heads=3)
    assert torch.equal(same.mask, lay.mask[:1].expand(3, -1, -1))


def test_fixed_vary_heads_distinct_subblocks():
    # l=4, c=2: head 0 uses kb % 4 in {2, 3}, head 1 the other subblock {0, 1}, head 2 repeats head 0
    lay = fixed(L8, BS, stride=4, summary=2, causal=False, num_heads=3, vary_heads=True)
    assert_pattern(lay, "XXXXXX..", "XXXXXX..", "XXXXXX..", "XXXXXX..",
                   "XX..XXXX", "XX..XXXX", "XX..XXXX", "XX..XXXX", head=1)
    assert torch.equal(lay.mask[2], lay.mask[0])


def test_sliding_and_summary_causal():
    # previous 2 blocks + summary blocks kb % 3 == 2 (columns 2, 5), kb <= qb
    assert_pattern(sliding_and_summary(L8, BS, local_blocks=2, every=3),
                   "X.......",
                   "XX......",
                   ".XX.....",
                   "..XX....",
                   "..XXX...",
                   "..X.XX..",
                   "..X..XX.",
                   "..X..XXX")


def test_sliding_and_summary_bidirectional():
    # |qb - kb| < 2 + columns 2 and 5
    assert_pattern(sliding_and_summary(L8, BS, local_blocks=2, every=3, causal=False),
                   "XXX..X..",
                   "XXX..X..",
                   ".XXX.X..",
                   "..XXXX..",
                   "..XXXX..",
                   "..X.XXX.",
                   "..X..XXX",
                   "..X..XXX")


def test_sliding_and_summary_benchmark_sparsity():
    # counted by hand: L=16384, bs=128 -> 128 blocks. local: 1+2+3+4*125 = 506; summary columns
    # kb = 15, 31, ..., 111 add the rows qb >= kb + 4: 109+93+77+61+45+29+13 = 427 -> 933 blocks
    lay = sliding_and_summary(16384, 128, local_blocks=4, every=16)
    assert lay.shape == (1, 128, 128)
    assert int(lay.mask.sum()) == 933
    assert lay.density() == pytest.approx(933 / 128 ** 2)
    assert round(1 - lay.density(), 2) == 0.94
    # L=65536 -> 512 blocks. local: 6 + 4*509 = 2042; summaries kb = 15+16m add 493-16m rows, m=0..30
    lay = sliding_and_summary(65536, 128, local_blocks=4, every=16)
    assert int(lay.mask.sum()) == 2042 + 7843
    assert round(1 - lay.density(), 2) == 0.96


def test_bigbird_without_random():
    # w=3 -> |qb - kb| <= 1; g=1 -> row 0 and column 0 full
    assert_pattern(bigbird(L8, BS, num_window_blocks=3, num_global_blocks=1, num_random_blocks=0),
                   "XXXXXXXX",
                   "XXX.....",
                   "XXXX....",
                   "X.XXX...",
                   "X..XXX..",
                   "X...XXX.",
                   "X....XXX",
                   "X.....XX")
    assert_pattern(bigbird(L8, BS, num_window_blocks=3, num_global_blocks=1, num_random_blocks=0,
                           causal=True),
                   "X.......",
                   "XX......",
                   "XXX.....",
                   "X.XX....",
                   "X..XX...",
                   "X...XX..",
                   "X....XX.",
                   "X.....XX")


def _bigbird_fixed_part(n, w, g, causal):
    """The window + global part of BigBird written with Python loops (independent of the builder)."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            ok = abs(i - j) <= w // 2 or i < g or j < g
            m[i, j] = ok and (j <= i or not causal)
    return m


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_bigbird_random_blocks(causal):
    n, w, g, r = 32, 3, 2, 3
    lay = bigbird(n * BS, BS, num_window_blocks=w, num_global_blocks=g, num_random_blocks=r, seed=7,
                  num_heads=4, causal=causal)
    assert lay.shape == (4, n, n)
    base = _bigbird_fixed_part(n, w, g, causal)
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    for h in range(4):
        m = lay.mask[h]
        assert bool((m & base).eq(base).all()), "window/global blocks missing"
        assert not bool((m & ~allowed).any()), "random block above the diagonal with causal=True"
        extra = (m & ~base).sum(dim=1)
        left = (allowed & ~base).sum(dim=1)
        assert torch.equal(extra, left.clamp(max=r)), f"head {h}: random blocks per row {extra.tolist()}"
    # each head draws its own random blocks
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(lay.mask[a], lay.mask[b])


def test_bigbird_seed():
    kw = dict(num_window_blocks=3, num_global_blocks=2, num_random_blocks=3, num_heads=2)
    a = bigbird(64 * BS, BS, seed=1, **kw)
    b = bigbird(64 * BS, BS, seed=1, **kw)
    c = bigbird(64 * BS, BS, seed=2, **kw)
    assert a is not b and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.mask, c.mask)
    # the draw is its own generator: the global RNG state neither matters nor moves
    torch.manual_seed(123)
    state = torch.get_rng_state()
    d = bigbird(64 * BS, BS, seed=1, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.mask, d.mask)


def test_longformer():
    # |qb - kb| <= 1, blocks 0 and 5 global (full rows and columns)
    assert_pattern(longformer(L8, BS, window_blocks=1, global_blocks=(0, 5)),
                   "XXXXXXXX",
                   "XXX..X..",
                   "XXXX.X..",
                   "X.XXXX..",
                   "X..XXX..",
                   "XXXXXXXX",
                   "X....XXX",
                   "X....XXX")
    assert_pattern(longformer(L8, BS, window_blocks=1, global_blocks=(0, 5), causal=True),
                   "X.......",
                   "XX......",
                   "XXX.....",
                   "X.XX....",
                   "X..XX...",
                   "XXXXXX..",
                   "X....XX.",
                   "X....XXX")
    # no global blocks: just the band
    assert_pattern(longformer(4 * BS, BS, window_blocks=0, global_blocks=()),
                   "X...", ".X..", "..X.", "...X")


# ----------------------------------------------------------------------------------------------
# non-square and partial blocks
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Lq,Lk,bs", [(100, 100, 16), (37, 150, 16), (150, 37, 16), (65, 127, 64),
                                      (129, 64, 64), (1, 300, 32)],
                         ids=lambda v: str(v))
def test_causal_cut_is_cover_of_bottom_right_causal(Lq, Lk, bs):
    # The convention: query i sees key j <= i + (Lk - Lq). The causal block cut must be that mask's block cover.
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    token_causal = j <= i + (Lk - Lq)
    want = torch.zeros((Lq + bs - 1) // bs, (Lk + bs - 1) // bs, dtype=torch.bool)
    for a in range(want.shape[0]):
        for b in range(want.shape[1]):
            want[a, b] = bool(token_causal[a * bs:(a + 1) * bs, b * bs:(b + 1) * bs].any())
    everything = local((Lq, Lk), bs, num_local_blocks=10 ** 6, causal=True)
    assert torch.equal(everything.mask[0], want)
    # a width-1 causal band keeps, for each query block, the key block on the diagonal of its last query
    band = local((Lq, Lk), bs, num_local_blocks=1, causal=True)
    assert torch.equal(band.mask.any(-1), everything.mask.any(-1))      # no query block loses all keys
    diag = band.to_dense(Lq, Lk)[0]
    for q in range(Lq):
        k = q + Lk - Lq
        if 0 <= k < Lk and (q % bs == bs - 1 or q == Lq - 1):
            assert diag[q, k]
    if (Lk - Lq) % bs == 0:                                   # aligned: the whole diagonal is kept
        for q in range(Lq):
            if 0 <= q + Lk - Lq < Lk:
                assert diag[q, q + Lk - Lq]


def test_non_square_shapes():
    Lq, Lk, bs = 100, 250, 32
    want = (2, 4, 8)
    for lay in (local((Lq, Lk), bs, 2, num_heads=2), strided((Lq, Lk), bs, 3, num_heads=2),
                fixed((Lq, Lk), bs, 4, num_heads=2, vary_heads=True),
                sliding_and_summary((Lq, Lk), bs, 2, 3, num_heads=2),
                bigbird((Lq, Lk), bs, num_heads=2), longformer((Lq, Lk), bs, 1, num_heads=2)):
        assert lay.shape == want
        assert lay.mask.dtype == torch.bool and lay.mask.is_contiguous()


def test_to_dense_partial_last_block():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(2, 5, 4, generator=g) < 0.5
    lay = BlockLayout(m, 16)
    Lq, Lk = 70, 50                           # 4 full + 6 rows; 3 full + 2 columns
    dense = lay.to_dense(Lq, Lk)
    assert dense.shape == (2, Lq, Lk) and dense.dtype == torch.bool
    for h in range(2):
        for i in range(Lq):
            for j in range(Lk):
                assert bool(dense[h, i, j]) == bool(m[h, i // 16, j // 16])
    full = lay.to_dense()
    assert full.shape == (2, 80, 64)
    assert torch.equal(full[:, :Lq, :Lk], dense)


def test_density():
    lay = BlockLayout(torch.tensor([[True, False], [True, True]]), 10)
    assert lay.density() == pytest.approx(0.75)
    # token areas with Lq=15, Lk=12: blocks (0,0)=10*10, (1,0)=5*10, (1,1)=5*2 -> 160 of 180 tokens
    assert lay.density(15, 12) == pytest.approx(160 / 180)
    assert lay.density(20, 20) == pytest.approx(0.75)
    g = torch.Generator().manual_seed(1)
    lay = BlockLayout(torch.rand(3, 7, 5, generator=g) < 0.3, 16)
    for Lq, Lk in [(100, 70), (97, 65), (112, 80)]:
        assert lay.density(Lq, Lk) == pytest.approx(lay.to_dense(Lq, Lk).float().mean().item())
    assert lay.density() == pytest.approx(lay.mask.float().mean().item())


# ----------------------------------------------------------------------------------------------
# from_dense_mask
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(50, 37), (3, 50, 37), (64, 64)], ids=lambda s: "x".join(map(str, s)))
def test_from_dense_mask_block_cover(shape):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(shape, generator=g) < 0.015          # sparse enough that some blocks are empty
    bs = 8
    lay = from_dense_mask(mask, bs)
    m3 = mask if mask.dim() == 3 else mask.unsqueeze(0)
    H, Lq, Lk = m3.shape
    assert lay.shape == (H, -(-Lq // bs), -(-Lk // bs)) and lay.block_size == bs
    # a block is True iff any of its tokens is
    for h in range(H):
        for a in range(lay.shape[1]):
            for b in range(lay.shape[2]):
                tile = m3[h, a * bs:(a + 1) * bs, b * bs:(b + 1) * bs]
                assert bool(lay.mask[h, a, b]) == bool(tile.any())
    assert bool((~lay.mask).any()) and bool(lay.mask.any())
    # the cover contains the mask
    dense = lay.to_dense(Lq, Lk)
    assert not bool((m3 & ~dense).any())
    # a block-aligned mask round-trips exactly
    again = from_dense_mask(dense, bs)
    assert torch.equal(again.mask, lay.mask)


# ----------------------------------------------------------------------------------------------
# BlockLayout object
# ----------------------------------------------------------------------------------------------

def test_blocklayout_basics():
    m = torch.tensor([[True, False, True], [False, True, True]])
    lay = BlockLayout(m, 32)
    assert lay.shape == (1, 2, 3) and lay.num_heads == 1 and lay.block_size == 32
    assert lay.num_query_blocks == 2 and lay.num_key_blocks == 3
    # the layout holds its own copy: changing the caller's tensor does not change it
    m[0, 1] = True
    assert not bool(lay.mask[0, 0, 1])
    r = repr(lay)
    assert "heads=1" in r and "2x3" in r and "block_size=32" in r and "density=0.6667" in r
    assert lay.to("cpu") is lay


def test_identity_semantics():
    a = local(L8, BS, 2)
    b = local(L8, BS, 2)
    assert torch.equal(a.mask, b.mask)
    assert a != b and a == a
    assert len({a, b}) == 2
    ref = weakref.ref(a)
    assert ref() is a
    cache = weakref.WeakKeyDictionary()
    cache[a] = "blocks"
    assert cache[a] == "blocks" and b not in cache


def test_expand_heads():
    lay = local(L8, BS, 2)
    e = lay.expand_heads(4)
    assert e.shape == (4, 8, 8) and e.mask.is_contiguous()
    assert all(torch.equal(e.mask[h], lay.mask[0]) for h in range(4))
    assert e.expand_heads(4) is e
    with pytest.raises(ValueError, match="num_heads=3"):
        e.expand_heads(3)


def test_union_and_intersection():
    a = BlockLayout(drawn("X...", ".X..", "..X.", "...X"), BS)
    b = BlockLayout(drawn("XX..", "X...", "X...", "X..."), BS)
    assert_pattern(a | b, "XX..", "XX..", "X.X.", "X..X")
    assert_pattern(a & b, "X...", "....", "....", "....")
    # heads broadcast: 1 vs 2
    c = BlockLayout(torch.stack([drawn("....", "....", "....", "...X"), drawn("...X", "....", "....", "....")]), BS)
    u = a | c
    assert u.shape == (2, 4, 4)
    assert_pattern(u, "X...", ".X..", "..X.", "...X", head=0)
    assert_pattern(u, "X..X", ".X..", "..X.", "...X", head=1)
    i = c & a
    assert_pattern(i, "....", "....", "....", "...X", head=0)
    assert_pattern(i, "....", "....", "....", "....", head=1)
    with pytest.raises(ValueError, match="block sizes differ"):
        a | BlockLayout(drawn("X...", ".X..", "..X.", "...X"), 32)
    with pytest.raises(ValueError, match="block grids differ"):
        a & BlockLayout(drawn("X..", ".X.", "..X"), BS)
    three = BlockLayout(torch.ones(3, 4, 4, dtype=torch.bool), BS)
    with pytest.raises(ValueError, match="head counts 2 and 3"):
        c | three
    with pytest.raises(TypeError):
        a | torch.ones(4, 4, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------

def test_blocklayout_bad_input():
    ok = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="mask must have dtype torch.bool"):
        BlockLayout(torch.ones(2, 2, dtype=torch.int64), 16)
    with pytest.raises(TypeError, match="mask must be a bool torch.Tensor"):
        BlockLayout([[True]], 16)
    with pytest.raises(ValueError, match="mask must be 3-D"):
        BlockLayout(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        BlockLayout(ok, 0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        BlockLayout(ok, 16.0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        BlockLayout(ok, True)
    lay = BlockLayout(ok, 16)
    with pytest.raises(ValueError, match="Lq=40 does not fit"):
        lay.to_dense(40, 32)
    with pytest.raises(ValueError, match="Lk=16 does not fit"):
        lay.density(32, 16)


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: local(L8, BS, 0), ValueError, "num_local_blocks must be a positive int"),
    (lambda: local(L8, 0, 2), ValueError, "block_size must be a positive int"),
    (lambda: local(0, BS, 2), ValueError, "seq_len must be a positive int"),
    (lambda: local((L8, -1), BS, 2), ValueError, r"seq_len\[1\] \(Lk\)"),
    (lambda: local((1, 2, 3), BS, 2), ValueError, "seq_len must be an int or a"),
    (lambda: local(L8, BS, 2, causal=1), TypeError, "causal must be a bool"),
    (lambda: strided(L8, BS, 0), ValueError, "stride must be a positive int"),
    (lambda: fixed(L8, BS, 0), ValueError, "stride must be a positive int"),
    (lambda: fixed(L8, BS, 4, summary=0), ValueError, "summary must be a positive int"),
    (lambda: fixed(L8, BS, 4, summary=5), ValueError, "summary"),
    (lambda: fixed(L8, BS, 4, num_heads=0), ValueError, "num_heads must be a positive int"),
    (lambda: sliding_and_summary(L8, BS, 0, 4), ValueError, "local_blocks must be a positive int"),
    (lambda: sliding_and_summary(L8, BS, 2, 0), ValueError, "every must be a positive int"),
    (lambda: bigbird(L8, BS, num_window_blocks=0), ValueError, "num_window_blocks must be a positive int"),
    (lambda: bigbird(L8, BS, num_global_blocks=-1), ValueError, "num_global_blocks must be an int >= 0"),
    (lambda: bigbird(L8, BS, num_random_blocks=-2), ValueError, "num_random_blocks must be an int >= 0"),
    (lambda: bigbird(L8, BS, seed=1.5), TypeError, "seed must be an int"),
    (lambda: longformer(L8, BS, -1), ValueError, "window_blocks must be an int >= 0"),
    (lambda: longformer(L8, BS, 1, global_blocks=(8,)), ValueError, "global_blocks must be key block indices"),
    (lambda: longformer(L8, BS, 1, global_blocks=3), TypeError, "global_blocks must be a sequence"),
    (lambda: from_dense_mask(torch.ones(4, 4), 2), TypeError, "mask must have dtype torch.bool"),
    (lambda: from_dense_mask(torch.ones(4, 4, dtype=torch.bool), -2), ValueError, "block_size"),
    (lambda: from_dense_mask(torch.ones(4, dtype=torch.bool), 2), ValueError, r"\(Lq, Lk\) or \(H, Lq, Lk\)"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_builder_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


# ----------------------------------------------------------------------------------------------
# speed sanity: 64k tokens, block 64 (1024 x 1024 blocks)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,build", [
    ("local", lambda: local(65536, 64, 4, causal=True)),
    ("strided", lambda: strided(65536, 64, 32)),
    ("fixed", lambda: fixed(65536, 64, 32, summary=4, num_heads=8, vary_heads=True)),
    ("sliding_and_summary", lambda: sliding_and_summary(65536, 64, 4, 16)),
    ("bigbird", lambda: bigbird(65536, 64)),
    ("longformer", lambda: longformer(65536, 64, 3, global_blocks=(0, 100))),
    ("from_dense_mask-4k", lambda: from_dense_mask(torch.ones(4096, 4096, dtype=torch.bool).tril(), 64)),
], ids=lambda v: v if isinstance(v, str) else None)
def test_build_speed(name, build):
    t0 = time.perf_counter()
    lay = build()
    dt = time.perf_counter() - t0
    assert lay.mask.shape[1:] in {(1024, 1024), (64, 64)}
    assert dt < 1.0, f"{name} took {dt:.3f} s"


def test_to_other_device_is_memoized():
    lay = local(64, 16, 2)
    meta = lay.to("meta")
    assert meta.mask.device.type == "meta" and meta is not lay
    assert lay.to("meta") is meta, "moving twice must give the same object (backend caches key on it)"
    assert lay.to("cpu") is lay
