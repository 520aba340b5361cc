"""Incremental decoding (KVCache), Transformer-XL segment memory and linear-attention state: processed
piece by piece, a sequence gives the same outputs as one full forward."""
import pytest
import torch
from torch import nn

from effattn.nn import KVCache, MultiheadAttention, TransformerDecoder, TransformerDecoderLayer, \
    TransformerEncoder, TransformerEncoderLayer

E, H = 32, 4


def close(a, b, tol=2e-5):
    assert a.shape == b.shape and not torch.isnan(b).any()
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)


def pieces(L, sizes):
    """[(start, end)] covering 0..L with the given piece sizes (the last repeated)."""
    out, s, i = [], 0, 0
    while s < L:
        n = sizes[min(i, len(sizes) - 1)]
        out.append((s, min(L, s + n)))
        s, i = s + n, i + 1
    return out


VARIANTS = {"causal": {}, "window": {"window": 3}, "window-pair": {"window": (4, 0)}, "linear": {"linear": "elu"},
            "favor": {"linear": "favor"}}


@pytest.mark.parametrize("steps", [[1], [5, 3], [4, 1, 7]], ids=["token", "prefill5-chunk3", "mixed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decoding_equals_full_forward(variant, steps):
    torch.manual_seed(0)
    mha = MultiheadAttention(E, H, batch_first=True, **VARIANTS[variant]).eval()
    B, L = 2, 14
    x = torch.randn(B, L, E)
    with torch.no_grad():
        full, _ = mha(x, x, x, is_causal=True, need_weights=False)
        cache, outs = KVCache(), []
        for s, e in pieces(L, steps):
            xs = x[:, s:e]
            outs.append(mha(xs, xs, xs, is_causal=True, need_weights=False, cache=cache)[0])
    close(full, torch.cat(outs, 1), 1e-5)
    assert cache.seen == L
    if variant.startswith("window"):
        # a rolling buffer of exactly the keys the next query can see besides its own: `left` of them
        assert len(cache) == {"window": 3, "window-pair": 4}[variant]
    if variant in ("linear", "favor"):
        assert cache.state is not None and cache.keys is None
    else:
        assert mha.last_path == "fused"


def test_decoding_with_left_padding():
    torch.manual_seed(1)
    mha = MultiheadAttention(E, H, batch_first=True, window=5).eval()
    B, L = 3, 12
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, :3] = True
    kpm[2, :1] = True
    with torch.no_grad():
        full, _ = mha(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
        cache, outs = KVCache(), []
        for s, e in pieces(L, [6, 1]):
            xs = x[:, s:e]
            outs.append(mha(xs, xs, xs, key_padding_mask=kpm[:, s:e], is_causal=True, need_weights=False,
                            cache=cache)[0])
    close(full, torch.cat(outs, 1), 1e-5)


def test_need_weights_with_cache_covers_cached_keys():
    torch.manual_seed(2)
    mha = MultiheadAttention(E, H).eval()
    x = torch.randn(6, 2, E)                             # (L, N, E): sequence first
    with torch.no_grad():
        _, w_full = mha(x, x, x, is_causal=True)
        cache = KVCache()
        mha(x[:5], x[:5], x[:5], is_causal=True, cache=cache, need_weights=False)
        _, w = mha(x[5:], x[5:], x[5:], is_causal=True, cache=cache)
    close(w_full[:, 5:], w, 1e-6)


def test_encoder_stack_decoding():
    """A decoder-only stack (encoder layers + is_causal) decoded token by token."""
    torch.manual_seed(3)
    model = TransformerEncoder(TransformerEncoderLayer(E, H, 48, dropout=0.0, batch_first=True, window=4), 2,
                               norm=nn.LayerNorm(E)).eval()
    x = torch.randn(2, 10, E)
    with torch.no_grad():
        full = model(x, is_causal=True)
        caches = [KVCache() for _ in model.layers]
        steps = [model(x[:, t:t + 1], is_causal=True, caches=caches) for t in range(10)]
    close(full, torch.cat(steps, 1), 1e-5)
    with pytest.raises(ValueError, match="one KVCache per layer"):
        model(x, is_causal=True, caches=[KVCache()])


def test_decoder_stack_decoding():
    torch.manual_seed(4)
    model = TransformerDecoder(TransformerDecoderLayer(E, H, 48, dropout=0.0, batch_first=True), 2).eval()
    tgt, mem = torch.randn(2, 8, E), torch.randn(2, 11, E)
    mkpm = torch.zeros(2, 11, dtype=torch.bool)
    mkpm[0, 8:] = True
    tm = nn.Transformer.generate_square_subsequent_mask(8)
    with torch.no_grad():
        full = model(tgt, mem, tgt_mask=tm, memory_key_padding_mask=mkpm)
        caches = [KVCache() for _ in model.layers]
        steps = [model(tgt[:, t:t + 1], mem, memory_key_padding_mask=mkpm, tgt_is_causal=True, caches=caches)
                 for t in range(8)]
    close(full, torch.cat(steps, 1), 1e-5)


@pytest.mark.parametrize("seq_first", [False, True], ids=["batchfirst", "seqfirst"])
def test_segment_memory_equals_full_forward(seq_first):
    """Transformer-XL: with window w <= segment length, segment s attending to [segment s-1; s]
    sees exactly what it sees in one pass over the whole sequence."""
    torch.manual_seed(5)
    Lseg, nseg, w = 5, 4, 4
    mha = MultiheadAttention(E, H, batch_first=not seq_first, window=w).eval()
    x = torch.randn(2, Lseg * nseg, E)
    if seq_first:
        x = x.transpose(0, 1)
    seg = (lambda t, i: t[i * Lseg:(i + 1) * Lseg]) if seq_first else (lambda t, i: t[:, i * Lseg:(i + 1) * Lseg])
    cat = 0 if seq_first else 1
    with torch.no_grad():
        full, _ = mha(x, x, x, is_causal=True, need_weights=False)
        outs, mem = [], None
        for i in range(nseg):
            xs = seg(x, i)
            outs.append(mha(xs, xs, xs, is_causal=True, need_weights=False, memory=mem)[0])
            mem = xs
    close(full, torch.cat(outs, cat), 1e-5)


def test_segment_memory_gets_no_gradient():
    torch.manual_seed(6)
    mha = MultiheadAttention(E, H, batch_first=True, window=4)
    mem = torch.randn(2, 5, E, requires_grad=True)
    x = torch.randn(2, 5, E, requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, 4] = True                                     # covers this segment's keys only: memory is never padding
    out, _ = mha(x, x, x, is_causal=True, need_weights=False, memory=mem, key_padding_mask=kpm)
    out.sum().backward()
    assert mem.grad is None
    assert x.grad is not None and mha.in_proj_weight.grad.abs().sum() > 0


def test_linear_segments_with_state():
    """Causal linear attention over segments, passing the (S, z) state in the cache."""
    torch.manual_seed(7)
    mha = MultiheadAttention(E, H, batch_first=True, linear="relu").eval()
    x = torch.randn(2, 20, E)
    with torch.no_grad():
        full, _ = mha(x, x, x, is_causal=True, need_weights=False)
        cache = KVCache()
        outs = [mha(x[:, s:e], x[:, s:e], x[:, s:e], is_causal=True, need_weights=False, cache=cache)[0]
                for s, e in pieces(20, [7])]
    close(full, torch.cat(outs, 1), 1e-5)
    S, z = cache.state
    assert S.shape == (2, H, E // H, E // H) and z.shape == (2, H, E // H)


def test_reorder_and_reset():
    torch.manual_seed(8)
    mha = MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(3, 6, E)
    with torch.no_grad():
        cache = KVCache()
        mha(x[:, :5], x[:, :5], x[:, :5], is_causal=True, need_weights=False, cache=cache)
        cache.reorder(torch.tensor([2, 0]))
        step = mha(x[[2, 0], 5:], x[[2, 0], 5:], x[[2, 0], 5:], is_causal=True, need_weights=False, cache=cache)[0]
        full = mha(x[[2, 0]], x[[2, 0]], x[[2, 0]], is_causal=True, need_weights=False)[0]
    close(full[:, 5:], step, 1e-5)
    cache.reset()
    assert len(cache) == 0 and cache.seen == 0 and cache.state is None


def test_cache_errors():
    from effattn import layouts
    mha = MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(1, 4, E)
    with pytest.raises(ValueError, match="attn_mask cannot be combined with cache"):
        mha(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool), need_weights=False, cache=KVCache())
    with pytest.raises(ValueError, match="not both"):
        mha(x, x, x, need_weights=False, cache=KVCache(), memory=x)
    lay = MultiheadAttention(E, H, batch_first=True, layout=layouts.local(4, 2, 1))
    with pytest.raises(ValueError, match="cannot be used with cache"):
        lay(x, x, x, need_weights=False, cache=KVCache())
    cache = KVCache()
    mha(x, x, x, need_weights=False, cache=cache)
    with pytest.raises(ValueError, match="one cache per module"):
        mha(torch.randn(2, 1, E), torch.randn(2, 1, E), torch.randn(2, 1, E), need_weights=False, cache=cache)
