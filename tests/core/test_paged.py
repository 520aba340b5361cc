"""Paged KV cache: the paged call equals the contiguous call over each sequence's keys."""
import pytest
import torch

import effattn
from effattn.nn import PagedKVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def paged_setup(lens, page_size=4, num_pages=60, H=4, Hkv=2, D=8, Lq=1, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    k_pages = torch.randn(num_pages, page_size, Hkv, D, generator=g, dtype=dtype)
    v_pages = torch.randn(num_pages, page_size, Hkv, D + 2, generator=g, dtype=dtype)
    max_pages = max(-(-n // page_size) for n in lens) + 1          # one spare column
    perm = torch.randperm(num_pages, generator=g)                  # pages scattered over the pool
    table = torch.full((B, max_pages), -1, dtype=torch.int32)      # unused entries: garbage
    used = 0
    for b, n in enumerate(lens):
        p = -(-n // page_size)
        table[b, :p] = perm[used:used + p].to(torch.int32)
        used += p
    q = torch.randn(B, H, Lq, D, generator=g, dtype=dtype)
    return q, k_pages, v_pages, table, torch.tensor(lens, dtype=torch.int32)


def contiguous(pages, table, n, page_size):
    """Sequence keys in order: (1, Hkv, n, D)."""
    t = torch.arange(n, device=pages.device)
    return pages[table.to(pages.device)[t // page_size].long(), t % page_size].permute(1, 0, 2)[None]


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("Lq, causal, window", [(1, False, None), (1, True, 5), (3, True, None), (3, False, (2, 1))],
                         ids=["decode", "decode-window", "prefill-causal", "prefill-window"])
def test_paged_equals_contiguous(Lq, causal, window, backend):
    lens = [7, 13, 3, 16] if backend == "auto" else [7, 70, 2, 16]       # 70: two key tiles of the kernel
    q, kp, vp, table, seqlens = paged_setup(lens, Lq=Lq)
    if backend == "triton":
        assert "reads the key/value pages in place" in str(effattn.explain(q, kp, vp, block_table=table,
                                                                            seqlens=seqlens, backend="triton"))
    out, lse = effattn.attention(q, kp, vp, block_table=table, seqlens=seqlens, causal=causal, window=window,
                                 return_lse=True, backend=backend)
    for b, n in enumerate(lens):
        k, v = contiguous(kp, table[b], n, 4), contiguous(vp, table[b], n, 4)
        ref, ref_lse = effattn.attention(q[b:b + 1].double(), k.double(), v.double(), causal=causal, window=window,
                                         return_lse=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Lq, causal, window", [(1, True, None), (1, True, 100), (3, True, None), (2, False, (150, 0)),
                                                (20, True, None)],
                         ids=["decode", "decode-window", "chunk-causal", "chunk-window", "chunk20-unpacked"])
def test_split_kv_paged_decode_equals_contiguous(Lq, causal, window):
    """The split-KV paged decode (key range cut into splits of 64 keys, merged by lse) against the float64
    contiguous call on the same keys: an empty sequence, a last page partly filled (131 = 8 pages of 16
    + 3), a sequence shorter than one split, and splits past a sequence's end (left empty); the 2 query
    heads of each KV head packed into one tile (Lq <= 16), or not (Lq = 20)."""
    from effattn.backends.triton.paged.launch import paged_forward, split_plan
    lens = [0, 131, 40, 256]
    q, kp, vp, table, seqlens = paged_setup(lens, page_size=16, num_pages=40, Lq=Lq)
    table = table.clamp_min(0)
    left, right = effattn.visibility.normalize_window(window, causal)
    bound = 17 * 16 if left < 0 else Lq + left + 63                   # 17 pages of 16 slots; a window's reach
    assert split_plan(q, kp, table, left, keys_per_split=64)[0] == -(-bound // 64) > 2
    out, lse = paged_forward(q, kp, vp, table, seqlens, left, right, 8 ** -0.5, keys_per_split=64)
    one, one_lse = paged_forward(q, kp, vp, table, seqlens, left, right, 8 ** -0.5, keys_per_split=2048)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
    for b, n in enumerate(lens[1:], 1):
        k, v = contiguous(kp, table[b], n, 16), contiguous(vp, table[b], n, 16)
        ref, ref_lse = effattn.attention(q[b:b + 1].double(), k.double(), v.double(), causal=causal, window=window,
                                         return_lse=True)
        for o, l in ((out, lse), (one, one_lse)):
            torch.testing.assert_close(o[b:b + 1].double(), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(l[b:b + 1].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_split_plan_reuses_the_decode_rule():
    """Splits from shapes only: a decode over a table of >= DECODE_MIN_KEYS slots on the nominal H100
    fills two waves (`plan_splits`); a shorter table, a longer chunk of queries or a narrow left window
    run one program per query tile and head; explain names the split."""
    from effattn.backends.triton.paged.launch import packs, split_plan
    from effattn.splits import DECODE_MIN_KEYS, plan_splits
    assert packs(4, 2, 1) and packs(32, 8, 16) and not packs(4, 4, 1) and not packs(4, 2, 17) and not packs(8, 1, 9)
    q, kp, vp, table, seqlens = paged_setup([5], page_size=16, num_pages=4)
    wide = torch.zeros(1, 4096 // 16, dtype=torch.int32)
    assert split_plan(q, kp, wide, -1) == plan_splits(2, 4096, 132, 64) and split_plan(q, kp, wide, -1)[0] > 1  # B * Hkv
    assert split_plan(q, kp, wide[:, :DECODE_MIN_KEYS // 16 - 1], -1)[0] == 1
    assert split_plan(q.expand(1, 4, 17, 8), kp, wide, -1)[0] == 1
    assert split_plan(q, kp, wide, 512)[0] == 1 and split_plan(q, kp, wide, 2048)[0] > 1
    rep = effattn.explain(q, kp, vp, block_table=wide, seqlens=seqlens, backend="triton")
    assert "split-KV decode" in rep.paths["triton"]


def test_paged_kv_cache_decoding_loop_matches_contiguous():
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    cache = PagedKVCache(32, 4, Hkv, D)
    seqs = [cache.new_sequence() for _ in range(2)]
    ks, vs = torch.randn(2, Hkv, 11, D), torch.randn(2, Hkv, 11, D)
    qs = torch.randn(2, H, 11, D)
    cache.append(seqs, ks[:, :, :6], vs[:, :, :6])                     # prefill 6 tokens
    out = cache.attention(qs[:, :, :6], seqs, causal=True)
    torch.testing.assert_close(out, effattn.attention(qs[:, :, :6], ks[:, :, :6], vs[:, :, :6], causal=True))
    for t in range(6, 11):                                               # decode 5 tokens
        cache.append(seqs, ks[:, :, t:t + 1], vs[:, :, t:t + 1])
        out = cache.attention(qs[:, :, t:t + 1], seqs, causal=True)
        ref = effattn.attention(qs[:, :, t:t + 1], ks[:, :, :t + 1], vs[:, :, :t + 1], causal=True)
        torch.testing.assert_close(out, ref)
    assert cache.seqlens(seqs).tolist() == [11, 11]
    assert cache.block_table(seqs).shape == (2, 3)
    free = cache.num_free_pages
    cache.free(seqs[0])
    assert cache.num_free_pages == free + 3


def test_paged_errors_name_the_argument():
    q, kp, vp, table, seqlens = paged_setup([5, 9])
    bad = table.clone()
    bad[1, 1] = 60
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 60 points past the pool"):
        effattn.attention(q, kp, vp, block_table=bad, seqlens=seqlens)
    with pytest.raises(ValueError, match="seqlens must lie in"):
        effattn.attention(q, kp, vp, block_table=table, seqlens=torch.tensor([5, 99], dtype=torch.int32))
    with pytest.raises(ValueError, match="forward only"):
        effattn.attention(q.requires_grad_(), kp, vp, block_table=table, seqlens=seqlens)
    with pytest.raises(ValueError, match="block_table must be an int32/int64"):
        effattn.attention(q.detach(), kp, vp, block_table=table.float(), seqlens=seqlens)
    with pytest.raises(ValueError, match="a paged call .* only; got dropout_p"):
        effattn.attention(q.detach(), kp, vp, block_table=table, seqlens=seqlens, dropout_p=0.1)
    for name, value in [("softcap", 3.0), ("sinks", torch.zeros(q.shape[1])), ("bias", torch.zeros(1))]:
        with pytest.raises(ValueError, match=f"a paged call .* only; got {name}"):   # were silently dropped
            effattn.attention(q.detach(), kp, vp, block_table=table, seqlens=seqlens, **{name: value})
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PagedKVCache(0, 4, 2, 8)
    q = q.detach()
    bad[1, 1] = -2
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -2 is negative of num_pages=60 pages"):
        effattn.attention(q, kp, vp, block_table=bad, seqlens=seqlens)
    table[1, 3] = 99                                  # past sequence 1's 3 pages: never read, not checked
    effattn.attention(q, kp, vp, block_table=table, seqlens=seqlens)
    with pytest.raises(ValueError, match=r"seqlens must lie in \[0, max_pages \* page_size = 4 \* 4 = 16\] "
                                         r"\(block_table holds 4 pages per sequence\), got \[5, 17\]"):
        effattn.attention(q, kp, vp, block_table=table, seqlens=torch.tensor([5, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqlens must lie in .* got \\[-1, 9\\]"):
        effattn.attention(q, kp, vp, block_table=table, seqlens=torch.tensor([-1, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seqlens must be an int32/int64 tensor \(B=2,\), got torch.float32"):
        effattn.attention(q, kp, vp, block_table=table, seqlens=seqlens.float())
    with pytest.raises(ValueError, match=r"block_table must be an int32/int64 tensor \(B=2, max_pages\)"):
        effattn.attention(q, kp, vp, block_table=table[0], seqlens=seqlens)
    with pytest.raises(TypeError, match="k_pages is torch.float64 but q is torch.float32"):
        effattn.attention(q, kp.double(), vp, block_table=table, seqlens=seqlens)
    with pytest.raises(TypeError, match="v_pages must be a floating-point tensor, got torch.int64"):
        effattn.attention(q, kp, vp.long(), block_table=table, seqlens=seqlens)
    with pytest.raises(ValueError, match="q's 3 heads must be a multiple of the 2 KV heads of k_pages"):
        effattn.attention(q[:, :3], kp, vp, block_table=table, seqlens=seqlens)
    with pytest.raises(ValueError, match=r"k_pages must be 4-D \(num_pages, page_size, Hkv, D\)"):
        effattn.attention(q, kp[0], vp, block_table=table, seqlens=seqlens)
    cache = PagedKVCache(2, 4, 2, 8)
    s = cache.new_sequence()
    with pytest.raises(RuntimeError, match="needs 3 more pages, 2 free"):
        cache.append([s], torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8))


def test_explain_paged_names_the_gather():
    q, kp, vp, table, seqlens = paged_setup([5, 9])
    rep = effattn.explain(q, kp, vp, block_table=table, seqlens=seqlens, causal=True)
    assert rep.chosen is not None
    assert "gathered into a contiguous" in str(rep) and "paged kernel not taken" in str(rep)
    # the op's rows first
    assert [r.path for r in rep.rows[:4]] == ["triton/paged", "cuda/paged-decode", "cuda/paged-prefill",
                                              "torch/paged-gather"]
    assert rep.chosen_path == "torch/paged-gather"
    inner = rep.row("torch/paged-gather").detail.split(": ")[-1]       # the contiguous call's pick
    assert inner in [r.path for r in rep.rows[4:] if not r.reasons]
    with pytest.raises(ValueError, match="paged_attention: backend 'triton' cannot serve this call: .*head dim 512"):
        big = [t.new_zeros(*t.shape[:-1], 512) for t in (q, kp, vp)]
        effattn.attention(*big, block_table=table, seqlens=seqlens, backend="triton")


# ---- the nn modules' decoding loop on a PagedKVCache ------------------------------------------------

def _stack(window=None, backend="auto", E=32, H=4):
    from effattn.nn import TransformerEncoder, TransformerEncoderLayer
    torch.manual_seed(3)
    layer = TransformerEncoderLayer(E, H, 48, dropout=0.0, batch_first=True, window=window, backend=backend)
    return TransformerEncoder(layer, 2).eval()


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window"])
def test_paged_decode_loop_equals_the_kv_cache_loop(window):
    """A 2-layer stack prefilled with 5 tokens then fed one token at a time: the same outputs on one
    PagedKVCache per layer (pages of 4, scattered by the free list) as on KVCache, and the caches hold
    the same keys; the stack's greedy 'tokens' (argmax of each output) agree."""
    from effattn.nn import KVCache
    model = _stack(window)
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        kv = [KVCache() for _ in model.layers]
        paged = [PagedKVCache(16, 4, 4, 8) for _ in model.layers]
        paged[0].new_sequence()                                   # sequence ids and pages not 0-based
        paged[0].append([0], torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8))
        outs = []
        for sl in [slice(0, 5)] + [slice(t, t + 1) for t in range(5, 12)]:
            a = model(x[:, sl], is_causal=True, caches=kv)
            b = model(x[:, sl], is_causal=True, caches=paged)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            outs.append((a[:, -1].argmax(-1), b[:, -1].argmax(-1)))
    assert all(torch.equal(i, j) for i, j in outs)
    assert paged[0].lengths.tolist() == [12, 12] and paged[0].rows == [1, 2]
    assert model.layers[0].self_attn.last_path == "fused"
    before = (paged[0].k_pages.clone(), paged[0].lengths.clone(), paged[0].num_free_pages)
    rep = model.layers[0].self_attn.explain(*(x[:, :4],) * 3, is_causal=True, need_weights=False, cache=paged[0])
    assert "paged_attention on (4, 16)" in str(rep) and "torch/paged-gather" in str(rep)   # 12 + 4 keys
    after = (paged[0].k_pages, paged[0].lengths, paged[0].num_free_pages)
    assert all(torch.equal(a, b) for a, b in zip(before[:2], after[:2])) and before[2] == after[2]   # untouched
    k0 = torch.stack([contiguous(paged[1].k_pages, paged[1].block_table([s])[0], 12, 4)[0] for s in paged[1].rows])
    torch.testing.assert_close(k0, kv[1].keys if window is None else k0)   # a windowed KVCache trims its keys


def test_paged_module_rows_of_different_lengths():
    """Sequences prefilled apart (3 and 6 tokens), then decoded as one batch with steps of one and of
    two tokens: each row continues at its own length and equals its own contiguous pass."""
    from effattn.nn import MultiheadAttention
    torch.manual_seed(4)
    mha = MultiheadAttention(16, 2, batch_first=True).eval()
    cache = PagedKVCache(20, 4, 2, 8)
    a, b = cache.new_sequence(), cache.new_sequence()
    xa, xb = torch.randn(1, 9, 16), torch.randn(1, 12, 16)
    with torch.no_grad():
        for s, x, n in ((a, xa, 3), (b, xb, 6)):
            cache.bind([s])
            mha(x[:, :n], x[:, :n], x[:, :n], is_causal=True, need_weights=False, cache=cache)
        cache.bind([a, b])
        got = []
        for step in (1, 2, 1):
            ia, ib = cache.held() - 6 + 3, cache.held()
            x = torch.cat([xa[:, ia:ia + step], xb[:, ib:ib + step]])
            got.append(mha(x, x, x, is_causal=True, need_weights=False, cache=cache)[0])
        ref_a = mha(xa[:, :7], xa[:, :7], xa[:, :7], is_causal=True, need_weights=False)[0]
        ref_b = mha(xb[:, :10], xb[:, :10], xb[:, :10], is_causal=True, need_weights=False)[0]
    out = torch.cat(got, 1)
    torch.testing.assert_close(out[0], ref_a[0, 3:7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref_b[0, 6:10], rtol=1e-5, atol=1e-5)
    assert cache.seqlens([a, b]).tolist() == cache.lengths.tolist() == [7, 10]


def test_paged_module_refuses_what_it_cannot_take():
    from effattn.nn import MultiheadAttention
    mha = MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="PagedKVCache runs the paged attention, which takes no need_weights"):
        mha(x, x, x, is_causal=True, cache=PagedKVCache(8, 4, 2, 8))
    with pytest.raises(ValueError, match="takes no key_padding_mask"):
        mha(x, x, x, is_causal=True, need_weights=False, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool),
            cache=PagedKVCache(8, 4, 2, 8))
    with pytest.raises(ValueError, match=r"k, v must be \(B=2, Hkv=4, T, D=4"):
        mha(x, x, x, is_causal=True, need_weights=False, cache=PagedKVCache(8, 4, 4, 4))
    lin = MultiheadAttention(16, 2, batch_first=True, linear="elu").eval()
    with pytest.raises(ValueError, match="linear module keeps its state"):
        lin(x, x, x, is_causal=True, need_weights=False, cache=PagedKVCache(8, 4, 2, 8))
    cache = PagedKVCache(3, 4, 2, 8)
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs 4 more pages, 3 free"):
        mha(x, x, x, is_causal=True, need_weights=False, cache=cache)
    assert cache.lengths.tolist() == [0, 0] and cache.num_free_pages == 3          # nothing written
    with pytest.raises(ValueError, match="no rows are bound"):
        PagedKVCache(3, 4, 2, 8).reserve(4)


def test_paged_token_step_reads_nothing_back(monkeypatch):
    """A single-token step of a layer stack on PagedKVCaches with the Triton paged kernel (split-KV
    forced, so the combine runs too) converts no tensor to a host value in the stack, the module, the
    cache, the paged call's checks and planning or the launcher: only the kernels' launches (Triton's
    interpreter reads its arguments on the host) run unguarded. Outputs equal the eager KVCache stack's."""
    import effattn.backends.triton.paged.launch as pt
    from effattn.nn import KVCache
    from tests.nn.test_cache import NoSync
    guard = NoSync()

    class Unguarded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append((self.kernel.__name__, tuple(grid)))

            def launch(*args, **kwargs):
                was = guard.active
                guard.off()
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    if was:
                        guard.on()
            return launch

    plan, launched = pt.split_plan, []
    monkeypatch.setattr(pt, "paged_fwd_kernel", Unguarded(pt.paged_fwd_kernel))
    monkeypatch.setattr(pt, "combine_kernel", Unguarded(pt.combine_kernel))
    monkeypatch.setattr(pt, "split_plan", lambda *a, **k: plan(*a[:4], keys_per_split=64))
    model, ref = _stack(window=4, backend="triton"), _stack(window=4)
    x = torch.randn(1, 8, 32)
    with torch.no_grad():
        caches = [PagedKVCache(40, 16, 4, 8) for _ in model.layers]
        kv = [KVCache() for _ in model.layers]
        model(x[:, :6], is_causal=True, caches=caches)
        ref(x[:, :6], is_causal=True, caches=kv)
        for c in caches:
            c.reserve(100)                                # 7 pages per row: the split-KV path, 2 splits
        launched.clear()
        guard.on()
        try:
            outs = [model(x[:, t:t + 1], is_causal=True, caches=caches) for t in (6, 7)]
            with pytest.raises(AssertionError, match="host sync"):     # the public call checks the values
                c = caches[0]
                effattn.attention(x.new_zeros(1, 4, 1, 8), c.k_pages, c.v_pages, block_table=c.block_table(c.rows),
                                  seqlens=c.lengths, backend="triton")
        finally:
            guard.off()
        for t, out in zip((6, 7), outs):
            torch.testing.assert_close(out, ref(x[:, t:t + 1], is_causal=True, caches=kv), rtol=1e-5, atol=1e-5)
    # per step and layer: the paged kernel over 2 splits of 64 keys (7 pages of 16), then the combine
    assert launched == [("paged_fwd_kernel", (1, 4, 2)), ("combine_kernel", (1,))] * 4
    assert caches[1].lengths.tolist() == [8]


@pytest.mark.gpu
def test_paged_decode_step_captured_in_a_cuda_graph_replays_like_eager():
    """A MultiheadAttention token step on a PagedKVCache (1100-token prompt, pages of 16: the split-KV
    paged decode) captured once in torch.cuda.CUDAGraph after `reserve`, replayed for six tokens: the
    same outputs and device lengths as the steps run eagerly on a second cache; `sync` then brings the
    host's counts to the replayed lengths."""
    from effattn.nn import MultiheadAttention
    from tests.conftest import capture_step
    torch.manual_seed(0)
    E, heads, B, dev = 512, 4, 2, torch.device("cuda")
    mha = MultiheadAttention(E, heads, batch_first=True, backend="triton").to(dev, torch.bfloat16).eval()
    prompt = torch.randn(B, 1100, E, device=dev, dtype=torch.bfloat16)
    tokens = torch.randn(B, 7, E, device=dev, dtype=torch.bfloat16)
    graphed, eager = (PagedKVCache(200, 16, heads, E // heads, dtype=torch.bfloat16, device=dev) for _ in range(2))

    def step(x, cache):
        return mha(x, x, x, is_causal=True, need_weights=False, cache=cache)[0]

    with torch.no_grad():
        for c in (graphed, eager):
            step(prompt, c)
        graphed.reserve(16)
        x = tokens[:, :1].clone()
        warm, graph, out = capture_step(lambda: step(x, graphed))   # the capture does not move the lengths
        torch.testing.assert_close(warm, step(x, eager), atol=2e-2, rtol=2e-2)   # tables of 70 and 69 pages
        for t in range(1, 7):
            x.copy_(tokens[:, t:t + 1])
            graph.replay()
            torch.testing.assert_close(out, step(tokens[:, t:t + 1], eager), atol=2e-2, rtol=2e-2)
            assert torch.equal(graphed.lengths, eager.lengths), t
        graphed.sync()
        assert graphed.seqlens(graphed.rows).tolist() == [1107, 1107]
    q = torch.randn(B, heads, 1, E // heads, device=dev, dtype=torch.bfloat16)
    assert "split-KV decode" in effattn.explain(q, graphed.k_pages, graphed.v_pages, block_table=graphed.block_table(
        graphed.rows), seqlens=graphed.lengths).paths["triton"]


@pytest.mark.gpu
@pytest.mark.toy
@pytest.mark.parametrize("B", [1, 4])
def test_paged_decode_at_real_sizes_within_the_naive_error_rule(B):
    """H=32 on Hkv=8 KV heads, D=128, bf16, rows of 16k / 9k+5 keys in pages of 16 shuffled over the pool
    (toy sizes in a smoke run): the automatic paged path (the split-KV paged kernel on a GPU) judged
    against float64 on the contiguous keys by the low-precision rule (2x the naive bf16 error + 8e-3)."""
    from effattn.testing.oracle import chunked_attention
    smoke = not torch.cuda.is_available()
    dev = torch.device("cpu" if smoke else "cuda")
    H, Hkv, D, n, ps = (4, 2, 32, 1100, 16) if smoke else (32, 8, 128, 16384, 16)
    dtype = torch.float32 if smoke else torch.bfloat16
    lens = [n, n * 9 // 16 + 5, n // 3, n][:B]
    g = torch.Generator(device=dev).manual_seed(B)
    per = -(-n // ps)
    kp, vp = (torch.randn(B * per, ps, Hkv, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
    table = torch.randperm(B * per, device=dev, generator=g).view(B, per).to(torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, 1, D, device=dev, dtype=dtype, generator=g)
    backend = "triton" if smoke else "auto"
    rep = effattn.explain(q, kp, vp, block_table=table, seqlens=seqlens, causal=True, backend="triton")
    assert "split-KV decode" in rep.paths["triton"]
    with torch.no_grad():
        out = effattn.attention(q, kp, vp, block_table=table, seqlens=seqlens, causal=True, backend=backend)
    for b, m in enumerate(lens):
        k, v = contiguous(kp, table[b], m, ps), contiguous(vp, table[b], m, ps)
        dout = torch.zeros_like(q[b:b + 1])
        ref = chunked_attention(q[b:b + 1], k, v, dout, causal=True)[0]
        low = chunked_attention(q[b:b + 1], k, v, dout, causal=True, dtype=torch.bfloat16)[0]
        err, nerr = (out[b:b + 1].double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
        assert not torch.isnan(out).any() and err <= 2 * nerr + 8e-3, (b, err, nerr)


def test_paged_kernels_compile_for_sm90_offline():
    """The interpreter skips Triton's compiler: compile the paged kernel and the split-KV combine for
    sm_90 as the launcher launches them (a split decode with grouped-query heads: packed rows, the
    fp32 partials) through Triton's binder, so a GPU-only compile error fails CI (the split store read
    a non-constexpr global, which triton 3.9's compiler refuses)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(effattn.__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "tools.triton.launch_resources", "--json", "--processes", "2",
                           "--dtypes", "bf16", "--cases", "paged-decode-split-gqa"], cwd=root, capture_output=True,
                          text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [(r["kernel"], r["override"]) for r in rows] == [("paged_fwd_kernel", ""), ("paged_fwd_kernel", "gpu"),
                                                            ("combine_kernel", "")], rows
    assert not [r for r in rows if "error" in r], rows
