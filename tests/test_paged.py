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
    t = torch.arange(n)
    return pages[table[t // page_size].long(), t % page_size].permute(1, 0, 2)[None]


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


@pytest.mark.parametrize("Lq, causal, window", [(1, True, None), (1, True, 100), (3, True, None), (2, False, (150, 0))],
                         ids=["decode", "decode-window", "chunk-causal", "chunk-window"])
def test_split_kv_paged_decode_equals_contiguous(Lq, causal, window):
    """The split-KV paged decode (key range cut into splits of 64 keys, merged by lse) against the float64
    contiguous call on the same keys: an empty sequence, a last page partly filled (131 = 8 pages of 16
    + 3), a sequence shorter than one split, and splits past a sequence's end (left empty)."""
    from effattn.paged_triton import paged_forward, split_plan
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
    from effattn.paged_triton import split_plan
    from effattn.splits import DECODE_MIN_KEYS, plan_splits
    q, kp, vp, table, seqlens = paged_setup([5], page_size=16, num_pages=4)
    wide = torch.zeros(1, 4096 // 16, dtype=torch.int32)
    assert split_plan(q, kp, wide, -1) == plan_splits(4, 4096, 132, 64) and split_plan(q, kp, wide, -1)[0] > 1
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
    with pytest.raises(ValueError, match="no layout, key_padding_mask, dropout_p"):
        effattn.attention(q.detach(), kp, vp, block_table=table, seqlens=seqlens, dropout_p=0.1)
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PagedKVCache(0, 4, 2, 8)
    cache = PagedKVCache(2, 4, 2, 8)
    s = cache.new_sequence()
    with pytest.raises(RuntimeError, match="needs 3 more pages, 2 free"):
        cache.append([s], torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8))


def test_explain_paged_names_the_gather():
    q, kp, vp, table, seqlens = paged_setup([5, 9])
    rep = effattn.explain(q, kp, vp, block_table=table, seqlens=seqlens, causal=True)
    assert rep.chosen is not None
    assert "gathered into a contiguous" in str(rep) and "paged kernel not taken" in str(rep)
    assert [r.path for r in rep.rows[:2]] == ["triton/paged", "torch/paged-gather"]   # the op's rows first
    assert rep.chosen_path == "torch/paged-gather"
    inner = rep.row("torch/paged-gather").detail.split(": ")[-1]       # the contiguous call's pick
    assert inner in [r.path for r in rep.rows[2:] if not r.reasons]
    with pytest.raises(ValueError, match="paged_attention: backend 'triton' cannot serve this call: .*head dim 512"):
        big = [t.new_zeros(*t.shape[:-1], 512) for t in (q, kp, vp)]
        effattn.attention(*big, block_table=table, seqlens=seqlens, backend="triton")
