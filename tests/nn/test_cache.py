"""Incremental decoding (KVCache), Transformer-XL segment memory and linear-attention state: processed
piece by piece, a sequence gives the same outputs as one full forward."""
import pytest
import torch
from torch import nn

from effattn.nn import (
    KVCache,
    MultiheadAttention,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

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


# ------------------------------------------------------------------------- preallocated storage

def decode_tokens(mha, x, cache, kpm=None, steps=None):
    """Feeds x (B, L, E) one token per step (after an optional prefill of `steps[0]` tokens)."""
    outs, s = [], 0
    for e in (steps or []) + list(range((steps or [0])[-1] + 1 if steps else 1, x.shape[1] + 1)):
        xs = x[:, s:e]
        outs.append(mha(xs, xs, xs, is_causal=True, need_weights=False, cache=cache,
                        key_padding_mask=None if kpm is None else kpm[:, s:e])[0])
        s = e
    return torch.cat(outs, 1)


@pytest.mark.parametrize("variant", ["causal", "window-pair"])
@pytest.mark.parametrize("capacity", [None, 24], ids=["growing", "fixed"])
def test_preallocated_cache_writes_in_place(variant, capacity):
    """Steps write into the buffers (the same storage from step to step while it fits; a growing
    cache doubles, a fixed one never moves) and decode exactly; a fixed capacity masks the window
    instead of trimming."""
    torch.manual_seed(10)
    mha = MultiheadAttention(E, H, batch_first=True, **VARIANTS[variant]).eval()
    x = torch.randn(2, 20, E)
    kpm = torch.zeros(2, 20, dtype=torch.bool)
    kpm[1, :2] = True                                          # left padding stays, masked
    with torch.no_grad():
        full, _ = mha(x, x, x, is_causal=True, need_weights=False, key_padding_mask=kpm)
        cache = KVCache(capacity=capacity)
        outs = [mha(x[:, :6], x[:, :6], x[:, :6], is_causal=True, need_weights=False, cache=cache,
                    key_padding_mask=kpm[:, :6])[0]]
        storage = cache._k.data_ptr()
        for t in range(6, 20):
            outs.append(mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], is_causal=True, need_weights=False,
                            cache=cache)[0])
            assert cache._k.data_ptr() == storage
    close(full, torch.cat(outs, 1), 1e-5)
    assert mha.last_path == "fused" and cache.lengths.tolist() == [20, 20] and cache.seen == 20
    if capacity is None:
        assert cache._k.shape[2] == 64 and len(cache) == (20 if variant == "causal" else
                                                          {"window": 3, "window-pair": 4}[variant])
    else:
        assert cache._k.shape[2] == 24 and len(cache) == 20


def test_growing_cache_doubles_and_compacts_a_window():
    torch.manual_seed(11)
    mha = MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(1, 150, E)
    win = MultiheadAttention(E, H, batch_first=True, window=5).eval()
    win.load_state_dict(mha.state_dict())
    with torch.no_grad():
        cache, wcache, caps = KVCache(), KVCache(), []
        for t in range(150):
            xs = x[:, t:t + 1]
            mha(xs, xs, xs, is_causal=True, need_weights=False, cache=cache)
            out = win(xs, xs, xs, is_causal=True, need_weights=False, cache=wcache)[0]
            caps.append(cache._k.shape[2])
        full = win(x, x, x, is_causal=True, need_weights=False)[0]
    assert sorted(set(caps)) == [64, 128, 256]
    assert wcache._k.shape[2] == 64 and len(wcache) == 5       # compacted when full, never grown
    close(full[:, -1:], out, 1e-5)


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window3"])
@pytest.mark.parametrize("capacity", [None, 16], ids=["growing", "fixed"])
def test_ragged_prompts_then_token_steps(window, capacity):
    """A right-padded batch of prompts of lengths 7 and 4: each row's length counts its real keys,
    its next tokens go right after them (over the padding), and every row decodes as if alone."""
    torch.manual_seed(12)
    mha = MultiheadAttention(E, H, batch_first=True, window=window).eval()
    lens, new = [7, 4], 3
    prompt = torch.randn(2, 7, E)
    kpm = torch.arange(7)[None, :] >= torch.tensor(lens)[:, None]       # trailing padding
    gen = torch.randn(2, new, E)
    with torch.no_grad():
        cache = KVCache(capacity=capacity)
        mha(prompt, prompt, prompt, is_causal=True, need_weights=False, cache=cache, key_padding_mask=kpm)
        assert cache.lengths.tolist() == lens
        steps = torch.cat([mha(gen[:, t:t + 1], gen[:, t:t + 1], gen[:, t:t + 1], is_causal=True,
                               need_weights=False, cache=cache)[0] for t in range(new)], 1)
        for b, n in enumerate(lens):
            seq = torch.cat([prompt[b:b + 1, :n], gen[b:b + 1]], 1)
            alone, _ = mha(seq, seq, seq, is_causal=True, need_weights=False)
            close(alone[:, n:], steps[b:b + 1], 1e-5)
        assert cache.lengths.tolist() == [n + new for n in lens]
        with pytest.raises(ValueError, match="different numbers of keys"):
            mha(gen, gen, gen, is_causal=True, need_weights=False, cache=cache)


def test_fixed_capacity_errors_and_reorder_in_place():
    torch.manual_seed(13)
    mha = MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(3, 6, E)
    with pytest.raises(ValueError, match="capacity"):
        KVCache(capacity=0)
    with torch.no_grad():
        cache = KVCache(capacity=6)
        mha(x[:, :5], x[:, :5], x[:, :5], is_causal=True, need_weights=False, cache=cache)
        with pytest.raises(ValueError, match="does not fit"):
            mha(x[:, 3:5], x[:, 3:5], x[:, 3:5], is_causal=True, need_weights=False, cache=cache)
        storage = cache._k.data_ptr()
        idx = torch.tensor([2, 0, 0])
        cache.reorder(idx)                                    # same batch size: in place
        assert cache._k.data_ptr() == storage
        step = mha(x[idx, 5:], x[idx, 5:], x[idx, 5:], is_causal=True, need_weights=False, cache=cache)[0]
        full = mha(x[idx], x[idx], x[idx], is_causal=True, need_weights=False)[0]
    close(full[:, 5:], step, 1e-5)
    assert "capacity=6" in repr(cache) and "keys=(3, 4, 6, 8)" in repr(cache)


def test_step_keys_keep_their_gradient():
    """Without no_grad, the step's own keys and values reach the projections' gradient (the cached
    ones are constants), as with the former torch.cat."""
    torch.manual_seed(14)
    mha = MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(1, 5, E)
    for capacity in (None, 8):
        cache = KVCache(capacity=capacity)
        with torch.no_grad():
            mha(x[:, :4], x[:, :4], x[:, :4], is_causal=True, need_weights=False, cache=cache)
        xs = x[:, 4:].clone().requires_grad_()
        out = mha(xs, xs, xs, is_causal=True, need_weights=False, cache=cache)[0]
        ref_x = x.clone().requires_grad_()
        ref = mha(ref_x, ref_x, ref_x, is_causal=True, need_weights=False)[0][:, 4:]
        close(ref, out, 1e-5)
        g, = torch.autograd.grad(out.sum(), xs)
        rg, = torch.autograd.grad(ref.sum(), ref_x)
        close(rg[:, 4:], g, 1e-5)


class NoSync:
    """While on, every way a tensor reaches the host (item, tolist, bool/int/float conversion,
    numpy) raises."""
    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")

    def __init__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        self.active = False

    def on(self):
        self.active = True
        def fail(name):
            def f(self, *a, **k):
                raise AssertionError(f"host sync: Tensor.{name}")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, fail(n))

    def off(self):
        self.active = False
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("kw", [dict(window=3), {}], ids=["window", "causal"])
def test_fixed_capacity_token_step_reads_nothing_back(monkeypatch, kw):
    """A single-token step of a layer stack on fixed-capacity caches (the step a CUDA graph captures)
    converts no tensor to a host value in the stack, the module or the cache, even with a padding
    mask and rows of different lengths; the attention reads the whole buffer, the window in its mask.
    (The kernels' own path is the GPU test's: the torch backend's CPU paths plan on the host.)"""
    import effattn.nn.attention as attention_module
    torch.manual_seed(15)
    layer = TransformerEncoderLayer(E, H, 48, dropout=0.0, batch_first=True, backend="torch", **kw)
    model = TransformerEncoder(layer, 2).eval()
    x = torch.randn(2, 6, E)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True                                          # row 0: 4 real keys, row 1: 5
    guard, calls, real = NoSync(), [], attention_module.attention

    def attention_unchecked(q, k, v, **kwargs):
        calls.append((tuple(k.shape), kwargs["key_padding_mask"] is not None, kwargs["window"]))
        was = guard.active
        guard.off()
        try:
            return real(q, k, v, **kwargs)
        finally:
            if was:
                guard.on()

    monkeypatch.setattr(attention_module, "attention", attention_unchecked)
    with torch.no_grad():
        caches = [KVCache(capacity=16) for _ in model.layers]
        model(x[:, :5], is_causal=True, caches=caches, src_key_padding_mask=kpm[:, :5])
        outs = []
        guard.on()
        try:
            for t in range(5, 7):
                xs = x[:, 5:6] if t == 5 else torch.randn(2, 1, E)
                outs.append(model(xs, is_causal=True, caches=caches,
                                  src_key_padding_mask=torch.zeros(2, 1, dtype=torch.bool)))
        finally:
            guard.off()
    assert [tuple(o.shape) for o in outs] == [(2, 1, E)] * 2
    assert calls[2:] == [((2, H, 16, E // H), True, None)] * 4       # 2 steps x 2 layers
    assert caches[1].lengths.tolist() == [4 + 2, 5 + 2]
