"""effattn.nn.swap_attention on torch's own models: outputs unchanged without a variant, the variant
really applied with one (also through torch's fused inference paths), clear errors, weights kept."""
import copy

import pytest
import torch
from torch import nn

from effattn.nn import MultiheadAttention, swap_attention
from effattn.testing.oracle import visibility

E, H, FF = 32, 4, 48


def encoder(batch_first=True, dropout=0.0, layers=2):
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=dropout, batch_first=batch_first),
                                 layers, enable_nested_tensor=batch_first)


def right_padding(B, L):
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, L - 4:] = True
    kpm[-1, L - 1:] = True
    return kpm


def close(a, b, tol=2e-5):
    if a.is_nested:
        a, b = a.to_padded_tensor(0.0), b.to_padded_tensor(0.0)
    assert not torch.isnan(b).any()
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)


def test_report_and_weights():
    torch.manual_seed(0)
    model = encoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, report = swap_attention(model, return_changes=True)
    assert [name for name, _ in report] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert report[0][1] == ("torch.nn.MultiheadAttention(32, 4, batch_first=True) -> "
                            "effattn.nn.MultiheadAttention(32, 4, batch_first=True)")
    assert all(isinstance(layer.self_attn, MultiheadAttention) for layer in model.layers)
    after = model.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the attributes torch's layers read from self_attn are there
    sa = model.layers[0].self_attn
    for attr in ("batch_first", "_qkv_same_embed_dim", "in_proj_weight", "in_proj_bias", "out_proj", "num_heads",
                 "embed_dim"):
        assert hasattr(sa, attr), attr
    # a second call changes the variant of the effattn modules
    _, report = swap_attention(model, window=3, return_changes=True)
    assert report[1][1].endswith("-> effattn.nn.MultiheadAttention(32, 4, batch_first=True, window=3)")
    assert model.layers[1].self_attn.window == 3


def test_returns_the_model_and_verbose_prints_the_changes(capsys):
    """`model = swap_attention(model)` keeps a working model (issue 10); verbose prints the changes."""
    model = encoder()
    x = torch.randn(2, 6, 32)
    same = swap_attention(model, window=2, verbose=True)
    assert same is model and isinstance(model.layers[0].self_attn, MultiheadAttention)
    assert model(x).shape == x.shape
    printed = capsys.readouterr().out.splitlines()
    _, changes = swap_attention(encoder(), window=2, return_changes=True)
    assert printed == [f"{name}: {change}" for name, change in changes] and len(printed) == 2


@pytest.mark.parametrize("batch_first", [True, False], ids=["batchfirst", "seqfirst"])
@pytest.mark.parametrize("mode", ["eval-nograd", "eval-grad", "train"])
def test_encoder_outputs_unchanged(mode, batch_first):
    """eval + no_grad + padding is where torch takes its own fused paths (nested tensors, the fused
    encoder layer); the swapped model must give the same result through them."""
    torch.manual_seed(1)
    ref = encoder(batch_first=batch_first)
    model = copy.deepcopy(ref)
    swap_attention(model)
    B, L = 3, 12
    x = torch.randn(B, L, E) if batch_first else torch.randn(L, B, E)
    kpm = right_padding(B, L)
    for m in (ref, model):
        m.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval-nograd"):
        a = ref(x, src_key_padding_mask=kpm)
        b = model(x, src_key_padding_mask=kpm)
        close(a, b)
        cm = nn.Transformer.generate_square_subsequent_mask(L)
        close(ref(x, mask=cm), model(x, mask=cm))
    if mode == "train":
        a.sum().backward()
        b.sum().backward()
        for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            close(p.grad, q.grad, 1e-4)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_transformer_outputs_unchanged(mode):
    torch.manual_seed(2)
    ref = nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF, dropout=0.0,
                         batch_first=True)
    model = copy.deepcopy(ref)
    _, report = swap_attention(model, return_changes=True)
    assert len(report) == 2 + 2 * 2          # encoder self, decoder self + cross
    ref.train(mode == "train"), model.train(mode == "train")
    src, tgt = torch.randn(2, 11, E), torch.randn(2, 7, E)
    skpm = right_padding(2, 11)
    tm = nn.Transformer.generate_square_subsequent_mask(7)
    kw = dict(tgt_mask=tm, src_key_padding_mask=skpm, memory_key_padding_mask=skpm, tgt_is_causal=True)
    with torch.set_grad_enabled(mode == "train"):
        close(ref(src, tgt, **kw), model(src, tgt, **kw))
    for name, m in model.named_modules():
        if isinstance(m, MultiheadAttention):
            assert m.last_path == "fused", (name, m.last_path)


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
def test_variant_is_applied_even_through_torch_fast_paths(grad):
    """window=3 after the swap equals the torch model run with the window's explicit mask."""
    torch.manual_seed(3)
    ref = encoder().eval()
    model = copy.deepcopy(ref)
    swap_attention(model, window=3)
    B, L = 3, 12
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, L - 2:] = True               # fewer pads than the window: torch gives NaN for queries that see none
    vis = visibility(L, L, causal=True, window=3)[0, 0]
    with torch.set_grad_enabled(grad):
        a = ref(x, mask=~vis, src_key_padding_mask=kpm)
        b = model(x, src_key_padding_mask=kpm, is_causal=True)
    keep = ~kpm
    close(a[keep], b[keep])
    # and a torch layer alone, in the conditions of its fused inference path
    layer_ref = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True).eval()
    wrapper = nn.Sequential(copy.deepcopy(layer_ref))
    swap_attention(wrapper, window=(1, 1))
    with torch.no_grad():
        vis = visibility(L, L, window=(1, 1))[0, 0]
        close(layer_ref(x, src_mask=~vis), wrapper[0](x))


def test_shared_modules_stay_shared_and_select_filters():
    shared = nn.MultiheadAttention(E, H)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = shared, shared
            self.cross = nn.MultiheadAttention(E, H, kdim=16, vdim=16)

    model = Model()
    _, report = swap_attention(model, select=lambda name, m: m._qkv_same_embed_dim, return_changes=True)
    assert [n for n, _ in report] == ["a"]
    assert model.a is model.b and isinstance(model.a, MultiheadAttention)
    assert type(model.cross) is nn.MultiheadAttention


def test_subclasses_are_left_alone_with_a_warning():
    class Custom(nn.MultiheadAttention):
        pass

    model = nn.Sequential(Custom(E, H), nn.MultiheadAttention(E, H))
    with pytest.warns(UserWarning, match="subclass"):
        _, report = swap_attention(model, return_changes=True)
    assert [n for n, _ in report] == ["1"]
    assert type(model[0]) is Custom


def test_errors_leave_the_model_unchanged():
    model = nn.Sequential(nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(TypeError, match="unknown variant keys"):
        swap_attention(model, windw=4)
    with pytest.raises(ValueError, match="non-negative"):
        swap_attention(model, window=-2)
    with pytest.raises(ValueError, match="not both"):
        swap_attention(model, linear="elu", window=4)
    with pytest.raises(ValueError, match=r"cannot swap 1: .*add_bias_kv"):
        swap_attention(model, linear="elu")
    assert all(type(m) is nn.MultiheadAttention for m in model)        # nothing swapped
    with pytest.raises(ValueError, match="from_torch"):
        swap_attention(nn.MultiheadAttention(E, H))


def test_linear_swap_and_call_time_errors():
    torch.manual_seed(4)
    model = encoder()
    swap_attention(model, linear="favor")
    x = torch.randn(2, 10, E)
    y = model(x, is_causal=True)                 # torch's layers call with need_weights=False: fine
    assert y.shape == x.shape and model.layers[0].self_attn.last_path == "linear"
    assert "layers.0.self_attn.feature_map.projection" in model.state_dict()
    # a model that asks for the attention weights of a linear module gets a clear error
    bare = nn.Sequential(nn.Identity())
    bare.attn = nn.MultiheadAttention(E, H, batch_first=True)
    swap_attention(bare, linear="elu")
    with pytest.raises(ValueError, match="need_weights=False"):
        bare.attn(x, x, x)
    # a fixed layout on cross-attention whose lengths differ at call time
    from effattn import layouts
    cross = nn.Sequential(nn.Identity())
    cross.attn = nn.MultiheadAttention(E, H, batch_first=True, kdim=16, vdim=16)
    swap_attention(cross, layout=layouts.local(10, 5, 1))
    with pytest.raises(ValueError, match="does not fit this call"):
        cross.attn(x, torch.randn(2, 30, 16), torch.randn(2, 30, 16), need_weights=False)


def test_parameters_are_carried_not_copied():
    """The swapped module holds the very Parameter objects of the old one: frozen weights stay frozen,
    an optimizer made before the swap still trains the model, and no weight is copied."""
    torch.manual_seed(5)
    model = encoder(layers=1)
    attn = model.layers[0].self_attn
    attn.in_proj_weight.requires_grad_(False)                       # e.g. a partly frozen fine-tune
    params = {name: p for name, p in attn.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    swap_attention(model, window=2)
    new = model.layers[0].self_attn
    assert isinstance(new, MultiheadAttention)
    for name, p in new.named_parameters():
        assert p is params[name], name
    assert not new.in_proj_weight.requires_grad and new.in_proj_bias.requires_grad
    before = new.out_proj.weight.detach().clone()
    model(torch.randn(2, 6, E), is_causal=True).square().sum().backward()
    opt.step()
    assert not torch.equal(before, new.out_proj.weight)


def test_from_torch_copies_and_keeps_requires_grad():
    mha = nn.MultiheadAttention(E, H, kdim=16, vdim=16)
    mha.k_proj_weight.requires_grad_(False)
    new = MultiheadAttention.from_torch(mha, window=3)
    assert new.q_proj_weight is not mha.q_proj_weight and torch.equal(new.q_proj_weight, mha.q_proj_weight)
    assert [p.requires_grad for p in new.parameters()] == [p.requires_grad for p in mha.parameters()]


def test_nothing_to_swap_warns():
    """A model without torch.nn.MultiheadAttention (a Hugging Face model, say) is not silently 'swapped'."""
    with pytest.warns(UserWarning, match="no torch.nn.MultiheadAttention"):
        assert swap_attention(nn.Sequential(nn.Linear(E, E)), return_changes=True)[1] == []
