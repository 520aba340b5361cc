"""effattn.nn.MultiheadAttention and the transformer layers against torch.nn's, weight for weight.

Small shapes (embed 32, 4 heads, L <= 16) on CPU; fresh random inputs per test.
"""
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effattn
from effattn import layouts
from effattn.nn import (
    KVCache,
    MultiheadAttention,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from effattn.testing.oracle import visibility

E, H = 32, 4


def pair(dtype=torch.float32, **kw):
    """A torch MHA and an effattn MHA with the same weights (in eval mode)."""
    ref = nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    ours = MultiheadAttention(E, H, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not torch.isnan(b).any()
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# parameters

@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"kdim": 24, "vdim": 16}, {"add_bias_kv": True},
                                {"batch_first": True, "add_zero_attn": True}],
                         ids=["plain", "nobias", "kdim-vdim", "bias_kv", "zero_attn"])
def test_same_parameters_and_init_as_torch(kw):
    torch.manual_seed(7)
    ref = nn.MultiheadAttention(E, H, **kw)
    torch.manual_seed(7)
    ours = MultiheadAttention(E, H, **kw)
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ref) == list(sd_ours)
    for name in sd_ref:
        assert torch.equal(sd_ref[name], sd_ours[name]), name
    # and both ways
    other = nn.MultiheadAttention(E, H, **kw)
    other.load_state_dict(ours.state_dict())
    ours.load_state_dict(nn.MultiheadAttention(E, H, **kw).state_dict())
    assert type(ours.out_proj) is type(ref.out_proj)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first",
                 "_qkv_same_embed_dim", "add_zero_attn"):
        assert getattr(ours, attr) == getattr(ref, attr), attr


def test_pickle_round_trip_and_older_pickles():
    """torch.save(model) / torch.load keep the module working (fast-path hook included); a pickle from
    before an attribute was added (here: the bookkeeping ones) still loads and runs."""
    import io
    torch.manual_seed(15)
    mha = MultiheadAttention(E, H, batch_first=True, window=2).eval()
    x = torch.randn(2, 6, E)
    buf = io.BytesIO()
    torch.save(mha, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    close(mha(x, x, x, need_weights=False)[0], again(x, x, x, need_weights=False)[0], 0)
    assert len(again._forward_pre_hooks) == 1
    state = dict(mha.__dict__)
    for name in ("_logged", "last_path"):
        state.pop(name)
    old = MultiheadAttention.__new__(MultiheadAttention)
    old.__setstate__(state)
    close(mha(x, x, x, need_weights=False)[0], old(x, x, x, need_weights=False)[0], 0)
    assert old.last_path == "fused"


# ---------------------------------------------------------------------------------------------
# forward equals torch's

def _masks(B, L, S, kind, dtype):
    """attn_mask / key_padding_mask in torch's conventions, every query keeping at least one key."""
    g = torch.Generator().manual_seed(sum(map(ord, kind)))
    kpm = attn = None
    if kind.startswith("kpm"):
        kpm = torch.zeros(B, S, dtype=torch.bool)
        kpm[0, S - 3:] = True
        if B > 1:
            kpm[1, :2] = True
        if kind == "kpm-float":
            kpm = torch.zeros(B, S, dtype=dtype).masked_fill(kpm, -math.inf)
            kpm[-1, 4] = -0.7                                         # arbitrary additive values too
    elif kind.startswith("attn"):
        shape = (L, S) if "2d" in kind else (B * H, L, S)
        blocked = torch.rand(shape, generator=g) < 0.4
        blocked[..., 0] = False
        if "bool" in kind:
            attn = blocked
        else:
            attn = torch.randn(shape, generator=g, dtype=dtype).masked_fill(blocked, -math.inf)
    return kpm, attn


def _sparse_kpm(B, S):
    """Isolated padded keys (never key 0, never two in a row): under causal or window masks every
    query still sees a key (torch outputs NaN for a query that sees none)."""
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, [5, 9]] = True
    kpm[-1, 2] = True
    return kpm


MASKS = ["none", "kpm-bool", "kpm-float", "attn-bool-2d", "attn-float-2d", "attn-bool-3d", "attn-float-3d"]


@pytest.mark.parametrize("need_weights", [False, True], ids=["noweights", "weights"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", ["batch_first", "seq_first", "unbatched"])
def test_self_attention_matches_torch(layout, mask, need_weights):
    torch.manual_seed(0)
    ref, ours = pair(batch_first=layout == "batch_first")
    B, L = (1 if layout == "unbatched" else 3), 11
    x = torch.randn(B, L, E)
    kpm, attn = _masks(B, L, L, mask, torch.float32)
    if layout == "seq_first":
        x = x.transpose(0, 1)
    elif layout == "unbatched":
        x = x[0]
        kpm = kpm[0] if kpm is not None else None
    for avg in ([True, False] if need_weights else [True]):
        o_ref, w_ref = ref(x, x, x, key_padding_mask=kpm, attn_mask=attn, need_weights=need_weights,
                           average_attn_weights=avg)
        o, w = ours(x, x, x, key_padding_mask=kpm, attn_mask=attn, need_weights=need_weights,
                    average_attn_weights=avg)
        close(o_ref, o, 2e-5)
        assert o.is_contiguous() or not o_ref.is_contiguous()        # code that .view()s torch's output works
        if need_weights:
            close(w_ref, w, 2e-5)
        else:
            assert w is None
    fused = not need_weights and mask in ("none", "kpm-bool")
    assert (ours.last_path == "fused") == fused, ours.last_path


@pytest.mark.parametrize("kw", [{"kdim": 24, "vdim": 16}, {"add_bias_kv": True}, {"add_zero_attn": True},
                                {"bias": False}], ids=["kdim-vdim", "bias_kv", "zero_attn", "nobias"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["noweights", "weights"])
def test_cross_attention_matches_torch(kw, need_weights):
    torch.manual_seed(1)
    ref, ours = pair(batch_first=True, **kw)
    B, L, S = 2, 9, 13
    q = torch.randn(B, L, E)
    k = torch.randn(B, S, kw.get("kdim", E))
    v = torch.randn(B, S, kw.get("vdim", E))
    kpm, _ = _masks(B, L, S, "kpm-bool", torch.float32)
    o_ref, w_ref = ref(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    o, w = ours(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    close(o_ref, o, 2e-5)
    if need_weights:
        close(w_ref, w, 2e-5)


@pytest.mark.parametrize("with_kpm", [False, True], ids=["nokpm", "kpm"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["noweights", "weights"])
def test_is_causal_matches_torch(with_kpm, need_weights):
    torch.manual_seed(2)
    ref, ours = pair(batch_first=True)
    B, L = 2, 10
    x = torch.randn(B, L, E)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)       # bool, like the padding mask
    kpm = _sparse_kpm(B, L) if with_kpm else None
    # torch needs the mask along with the hint; effattn takes the hint (and needs no mask)
    o_ref, w_ref = ref(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=kpm, need_weights=need_weights)
    o, w = ours(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=kpm, need_weights=need_weights)
    close(o_ref, o, 2e-5)
    if not need_weights:
        assert ours.last_path == "fused"
        o2, _ = ours(x, x, x, is_causal=True, key_padding_mask=kpm, need_weights=False)
        close(o_ref, o2, 2e-5)
    else:
        close(w_ref, w, 2e-5)
        o2, w2 = ours(x, x, x, is_causal=True, key_padding_mask=kpm)        # no mask: causal applied
        close(o_ref, o2, 2e-5)
        close(w_ref, w2, 2e-5)


def test_float64_is_exact():
    torch.manual_seed(3)
    ref, ours = pair(dtype=torch.float64, batch_first=True)
    x = torch.randn(2, 16, E, dtype=torch.float64)
    kpm = _masks(2, 16, 16, "kpm-bool", torch.float64)[0]
    close(ref(x, x, x, key_padding_mask=kpm, need_weights=False)[0],
          ours(x, x, x, key_padding_mask=kpm, need_weights=False)[0], 1e-12)


def test_gradients_match_torch():
    torch.manual_seed(4)
    ref, ours = pair(batch_first=True)
    ref.train(), ours.train()                     # dropout 0: train mode is deterministic
    x = torch.randn(2, 12, E)
    kpm = _masks(2, 12, 12, "kpm-bool", torch.float32)[0]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(2, 12, E)
    (ref(x1, x1, x1, key_padding_mask=kpm, need_weights=False)[0] * g).sum().backward()
    (ours(x2, x2, x2, key_padding_mask=kpm, need_weights=False)[0] * g).sum().backward()
    close(x1.grad, x2.grad, 1e-5)
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n1 == n2
        close(p1.grad, p2.grad, 1e-5)


# ---------------------------------------------------------------------------------------------
# variants: the same as torch with the equivalent explicit mask

@pytest.mark.parametrize("case", ["window-causal", "window-sym", "window-pair", "layout", "layout-callable"])
def test_variant_equals_torch_with_explicit_mask(case):
    torch.manual_seed(5)
    B, L = 2, 16
    causal = case == "window-causal"
    if case.startswith("window"):
        window = {"window-causal": 3, "window-sym": 2, "window-pair": (1, 4)}[case]
        extra = {"window": window}
        vis = visibility(L, L, causal=causal, window=window)[0, 0]
    else:
        lay = layouts.local(L, 4, num_local_blocks=2, causal=False)
        extra = {"layout": lay if case == "layout" else (lambda Lq, Lk: layouts.local((Lq, Lk), 4, 2))}
        vis = visibility(L, L, layout=lay)[0, 0]
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = MultiheadAttention(E, H, batch_first=True, **extra).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E)
    kpm = _sparse_kpm(B, L)
    o_ref, w_ref = ref(x, x, x, attn_mask=~vis, key_padding_mask=kpm)
    o, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False, is_causal=causal)
    assert ours.last_path == "fused"
    close(o_ref, o, 2e-5)
    o, w = ours(x, x, x, key_padding_mask=kpm, is_causal=causal)        # weights: dense path, same mask
    assert ours.last_path.startswith("reference")
    close(o_ref, o, 2e-5)
    close(w_ref, w, 2e-5)


def test_layout_of_wrong_size_is_a_clear_error():
    lay = layouts.local(16, 4, num_local_blocks=2)
    mha = MultiheadAttention(E, H, batch_first=True, layout=lay)
    x = torch.randn(1, 16, E)
    mha(x, x, x, need_weights=False)
    y = torch.randn(1, 24, E)
    with pytest.raises(ValueError, match="layout .* does not fit this call"):
        mha(y, y, y, need_weights=False)
    with pytest.raises(ValueError, match="does not fit"):      # cross-attention, keys of another length
        mha(x, y, y, need_weights=False)


def _linear_reference(mha, x, causal, phi):
    """Linear attention written out on the module's own projections (float64)."""
    W, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q, k, v = F.linear(x.double(), W, b).chunk(3, -1)
    B, L, _ = x.shape
    q, k, v = (t.view(B, L, H, E // H).transpose(1, 2) for t in (q, k, v))
    fq, fk = phi(q), phi(k)
    s = fq @ fk.transpose(-1, -2)
    if causal:
        s = s.tril()
    out = (s @ v) / (s.sum(-1, keepdim=True) + 1e-6)
    out = out.transpose(1, 2).reshape(B, L, E)
    return F.linear(out, mha.out_proj.weight.double(), mha.out_proj.bias.double())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fmap", ["elu", "relu", "favor", "callable"])
def test_linear_variant(fmap, causal):
    torch.manual_seed(6)
    spec = (lambda t: F.softplus(t.float())) if fmap == "callable" else fmap
    mha = MultiheadAttention(E, H, batch_first=True, linear=spec).eval()
    if fmap == "favor":
        assert isinstance(mha.feature_map, effattn.FavorFeatures)
        assert "feature_map.projection" in mha.state_dict()
        phi = lambda t: mha.feature_map(t).double()
    else:
        phi = {"elu": lambda t: F.elu(t) + 1, "relu": F.relu, "callable": F.softplus}[fmap]
    x = torch.randn(2, 12, E)
    out, w = mha(x, x, x, need_weights=False, is_causal=causal)
    assert w is None and mha.last_path == "linear"
    close(_linear_reference(mha, x, causal, phi).float(), out, 1e-4)


def test_favor_module_loads_a_torch_state_dict():
    """A torch.nn.MultiheadAttention state dict has no FAVOR+ projection: it loads strictly into a
    linear="favor" module (also inside a model), which keeps its own projection."""
    torch.manual_seed(16)
    ref = nn.MultiheadAttention(E, H)
    mha = MultiheadAttention(E, H, linear="favor")
    proj = mha.feature_map.projection.clone()
    mha.load_state_dict(ref.state_dict())
    assert torch.equal(mha.in_proj_weight, ref.in_proj_weight) and torch.equal(mha.feature_map.projection, proj)
    layer = TransformerEncoderLayer(E, H, 48, linear="favor")
    layer.load_state_dict(nn.TransformerEncoderLayer(E, H, 48).state_dict())
    other = MultiheadAttention(E, H, linear="favor")                # and its own projection when there is one
    other.load_state_dict(mha.state_dict())
    assert torch.equal(other.feature_map.projection, proj)


def test_favor_projection_follows_device():
    """linear="favor" builds its FavorFeatures where the module's parameters are (device=)."""
    mha = MultiheadAttention(E, H, linear="favor", device="meta")
    assert mha.in_proj_weight.device.type == "meta"
    assert mha.feature_map.projection.device.type == "meta"


def test_linear_variant_key_padding():
    """Padded keys add nothing: a padded batch entry equals the same sequence without the padding."""
    torch.manual_seed(8)
    mha = MultiheadAttention(E, H, batch_first=True, linear="elu").eval()
    x = torch.randn(2, 10, E)
    kpm = torch.zeros(2, 10, dtype=torch.bool)
    kpm[1, 7:] = True
    out, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    alone, _ = mha(x[1:, :7], x[1:, :7], x[1:, :7], need_weights=False)
    close(alone[0], out[1, :7], 1e-5)
    close(mha(x[:1], x[:1], x[:1], need_weights=False)[0][0], out[0], 1e-5)


def test_linear_variant_errors():
    mha = MultiheadAttention(E, H, linear="elu")
    x = torch.randn(5, 1, E)
    with pytest.raises(ValueError, match="need_weights=False"):
        mha(x, x, x)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, need_weights=False, attn_mask=torch.zeros(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        MultiheadAttention(E, H, linear="elu", window=4)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiheadAttention(E, H, linear="elu", add_bias_kv=True)
    with pytest.raises(ValueError, match="unknown linear feature map"):
        MultiheadAttention(E, H, linear="softmax")
    with pytest.raises(ValueError, match="head_dim"):
        MultiheadAttention(E, H, linear=effattn.FavorFeatures(16))


def test_constructor_errors():
    with pytest.raises(ValueError, match="non-negative"):
        MultiheadAttention(E, H, window=-1)
    with pytest.raises(TypeError, match="window"):
        MultiheadAttention(E, H, window=1.5)
    with pytest.raises(ValueError, match="backend"):
        MultiheadAttention(E, H, backend="flash")
    with pytest.raises(TypeError, match="layout"):
        MultiheadAttention(E, H, layout="local")
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(30, 4)


# ---------------------------------------------------------------------------------------------
# dropout, visibility of the slow path

def test_dropout_only_in_training(monkeypatch):
    import effattn.nn.attention as mod
    seen = []
    real = mod.attention
    monkeypatch.setattr(mod, "attention", lambda *a, **k: seen.append(k["dropout_p"]) or real(*a, **k))
    mha = MultiheadAttention(E, H, dropout=0.25, batch_first=True)
    x = torch.randn(2, 8, E)
    mha.train()
    torch.manual_seed(0)
    a = mha(x, x, x, need_weights=False)[0]
    torch.manual_seed(0)
    b = mha(x, x, x, need_weights=False)[0]
    mha.eval()
    c = mha(x, x, x, need_weights=False)[0]
    assert seen == [0.25, 0.25, 0.0]
    torch.testing.assert_close(a, b)                  # reproducible under manual_seed
    assert (a - c).abs().max() > 1e-3                 # and actually dropping
    # unbiased: the mean over many draws (one batch of 300 copies) approaches the eval output
    mha.train()
    with torch.no_grad():
        xs = x.repeat(150, 1, 1)
        mean = mha(xs, xs, xs, need_weights=False)[0].view(150, 2, 8, E).mean(0)
    assert (mean - c).abs().mean() < 0.25 * (a - c).abs().mean()


def test_reference_path_is_recorded_and_logged_once(caplog):
    mha = MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(1, 6, E)
    mask = torch.randn(6, 6)
    with caplog.at_level(logging.DEBUG, logger="effattn.nn"):
        mha(x, x, x, attn_mask=mask, need_weights=False)
        mha(x, x, x, attn_mask=mask, need_weights=False)
    assert mha.last_path == "reference: float attn_mask"
    assert sum("float attn_mask" in r.getMessage() for r in caplog.records) == 1
    mha(x, x, x, need_weights=False)
    assert mha.last_path == "fused"


def test_explain_says_which_path_and_backend_without_running():
    mha = MultiheadAttention(E, H, batch_first=True, window=3).eval()
    x = torch.randn(2, 10, E)
    mha(x, x, x, need_weights=False)
    ex = mha.explain(x, x, x)                                     # need_weights defaults to True, as in torch
    assert ex.path == "reference: need_weights=True" and ex.report is None and ex.shape == (10, 10)
    assert ex.reasons == ["need_weights=True"] and "need_weights=False" in str(ex)
    # every reason is listed, each with what to change
    ex = mha.explain(x, x, x, attn_mask=torch.randn(10, 10), key_padding_mask=torch.rand(2, 10))
    assert ex.reasons == ["need_weights=True", "float key_padding_mask", "float attn_mask"], ex.reasons
    assert all(hint in str(ex) for hint in ("need_weights=False", "bool key_padding_mask", "is_causal=True"))
    ex = mha.explain(x, x, x, attn_mask=torch.zeros(10, 10, dtype=torch.bool), need_weights=False)
    assert ex.path == "reference: bool attn_mask" and "is_causal" in str(ex)
    ex = mha.explain(x, x, x, is_causal=True, need_weights=False)
    assert ex.path == "fused" and ex.op == "attention"
    assert ex.report.chosen is not None and ex.report.can_serve("torch")
    assert "effattn.attention: backend='auto' picks" in str(ex)
    assert mha.last_path == "fused"                              # explain records nothing
    # the call with a cache: the cache is not touched, Lk counts the cached keys
    cache = KVCache()
    with torch.no_grad():
        mha(x[:, :6], x[:, :6], x[:, :6], is_causal=True, need_weights=False, cache=cache)
    keys, seen = cache.keys, cache.seen
    ex = mha.explain(x[:, 6:7], x[:, 6:7], x[:, 6:7], is_causal=True, need_weights=False, cache=cache)
    assert ex.path == "fused" and ex.shape == (1, 4)
    assert cache.keys is keys and cache.seen == seen
    lin = MultiheadAttention(E, H, linear="elu", backend="torch")
    ex = lin.explain(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), need_weights=False)
    assert ex.path == "linear" and ex.op == "linear_attention" and "backend='torch'" in str(ex)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_input_keeps_its_layout(layout):
    """Ragged self-attention input comes back nested in the same layout, each sequence attended alone."""
    torch.manual_seed(14)
    mha = MultiheadAttention(E, H, batch_first=True).eval()
    seqs = [torch.randn(5, E), torch.randn(3, E)]
    nt = torch.nested.nested_tensor(seqs, layout=layout)
    with torch.no_grad():
        out, _ = mha(nt, nt, nt, need_weights=False, is_causal=True)
        assert out.is_nested and out.layout == layout
        for got, x in zip(out.unbind(), seqs):
            close(mha(x, x, x, need_weights=False, is_causal=True)[0], got, 1e-6)


# ---------------------------------------------------------------------------------------------
# transformer layers

def _layer_pair(kind, **kw):
    cls_ref = {"enc": nn.TransformerEncoderLayer, "dec": nn.TransformerDecoderLayer}[kind]
    cls = {"enc": TransformerEncoderLayer, "dec": TransformerDecoderLayer}[kind]
    ref = cls_ref(E, H, dim_feedforward=48, **kw).eval()
    ours = cls(E, H, dim_feedforward=48, **kw).eval()
    assert list(ref.state_dict()) == list(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    return ref, ours


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seqfirst", "batchfirst"])
def test_encoder_layer_matches_torch(batch_first, norm_first):
    torch.manual_seed(9)
    ref, ours = _layer_pair("enc", batch_first=batch_first, norm_first=norm_first, activation="gelu")
    B, L = 2, 12
    x = torch.randn(B, L, E) if batch_first else torch.randn(L, B, E)
    kpm = _masks(B, L, L, "kpm-bool", torch.float32)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    with torch.no_grad():
        close(ref(x, src_key_padding_mask=kpm), ours(x, src_key_padding_mask=kpm), 2e-5)
        close(ref(x, src_mask=causal, is_causal=True), ours(x, src_mask=causal, is_causal=True), 2e-5)
        assert ours.self_attn.last_path == "fused"
        close(ref(x, src_mask=causal, is_causal=True), ours(x, is_causal=True), 2e-5)


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
def test_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(10)
    ref, ours = _layer_pair("dec", batch_first=True, norm_first=norm_first)
    tgt, mem = torch.randn(2, 9, E), torch.randn(2, 14, E)
    mkpm = _masks(2, 9, 14, "kpm-bool", torch.float32)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(9)
    with torch.no_grad():
        a = ref(tgt, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mkpm)
        b = ours(tgt, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mkpm)
    close(a, b, 2e-5)
    assert ours.self_attn.last_path == "fused" and ours.multihead_attn.last_path == "fused"


def test_stacks_match_torch_and_detect_causal_masks():
    torch.manual_seed(11)
    enc_ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 48, dropout=0.0, batch_first=True), 2,
                                    norm=nn.LayerNorm(E), enable_nested_tensor=False).eval()
    enc = TransformerEncoder(TransformerEncoderLayer(E, H, 48, dropout=0.0, batch_first=True), 2,
                             norm=nn.LayerNorm(E)).eval()
    enc.load_state_dict(enc_ref.state_dict())
    dec_ref = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 48, dropout=0.0, batch_first=True), 2).eval()
    dec = TransformerDecoder(TransformerDecoderLayer(E, H, 48, dropout=0.0, batch_first=True), 2).eval()
    dec.load_state_dict(dec_ref.state_dict())
    src, tgt = torch.randn(2, 12, E), torch.randn(2, 7, E)
    kpm = _masks(2, 12, 12, "kpm-bool", torch.float32)[0]
    cm = nn.Transformer.generate_square_subsequent_mask(12)
    with torch.no_grad():
        close(enc_ref(src, src_key_padding_mask=kpm), enc(src, src_key_padding_mask=kpm), 2e-5)
        close(enc_ref(src, mask=cm), enc(src, mask=cm), 2e-5)
        assert enc.layers[1].self_attn.last_path == "fused"           # causal mask detected, fused
        mem = enc(src, src_key_padding_mask=kpm)
        tm = nn.Transformer.generate_square_subsequent_mask(7)
        close(dec_ref(tgt, mem, tgt_mask=tm, memory_key_padding_mask=kpm),
              dec(tgt, mem, tgt_mask=tm, memory_key_padding_mask=kpm), 2e-5)
        assert dec.layers[0].self_attn.last_path == "fused"


def test_layers_pass_the_variant_to_self_attention():
    layer = TransformerDecoderLayer(E, H, window=4, backend="torch")
    assert layer.self_attn.window == 4 and layer.self_attn.backend == "torch"
    assert layer.multihead_attn.window is None and layer.multihead_attn.backend == "torch"
    assert TransformerEncoderLayer(E, H, linear="relu").self_attn.linear == "relu"


# ---------------------------------------------------------------------------------------------
# torch.compile and autocast

def test_torch_compile():
    torch.manual_seed(12)
    torch._dynamo.reset()
    mha = MultiheadAttention(E, H, batch_first=True, window=3).eval()
    x = torch.randn(2, 10, E)
    kpm = _sparse_kpm(2, 10)
    with torch.no_grad():
        a = mha(x, x, x, key_padding_mask=kpm, need_weights=False, is_causal=True)[0]
        b = torch.compile(mha, backend="aot_eager")(x, x, x, key_padding_mask=kpm, need_weights=False,
                                                    is_causal=True)[0]
        close(a, b, 1e-5)
        layer = TransformerEncoderLayer(E, H, 48, dropout=0.0, batch_first=True, window=2).eval()
        close(layer(x, is_causal=True), torch.compile(layer, backend="aot_eager")(x, is_causal=True), 1e-5)


def test_torch_compile_backward():
    torch.manual_seed(12)
    torch._dynamo.reset()
    mha = MultiheadAttention(E, H, batch_first=True, window=3).train()
    compiled = torch.compile(mha, backend="aot_eager")
    x = torch.randn(2, 10, E)
    kpm = _sparse_kpm(2, 10)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a = mha(x1, x1, x1, key_padding_mask=kpm, need_weights=False, is_causal=True)[0]
    b = compiled(x2, x2, x2, key_padding_mask=kpm, need_weights=False, is_causal=True)[0]
    close(a, b, 1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    close(x1.grad, x2.grad, 1e-5)


def test_autocast_bfloat16():
    torch.manual_seed(13)
    ref, ours = pair(batch_first=True)
    x = torch.randn(2, 16, E)
    kpm = _masks(2, 16, 16, "kpm-bool", torch.float32)[0]
    with torch.no_grad():
        exact = ref(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = ref(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
            b = ours(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
            c = ours(x, x, x, key_padding_mask=kpm)[0]                 # dense path under autocast too
    assert b.dtype == a.dtype == torch.bfloat16 and c.dtype == torch.bfloat16
    err_ref = (a.float() - exact).abs().max()
    assert (b.float() - exact).abs().max() <= 2 * err_ref + 1e-2
    assert (c.float() - exact).abs().max() <= 2 * err_ref + 1e-2
