"""The messages a new user meets first (issue 10): unknown keywords, misused caches, a backend with no
kernel for an op, and the benchmark report's footnotes."""
import pytest
import torch

import effattn


def qkv():
    return (torch.randn(1, 2, 8, 4) for _ in range(3))


@pytest.mark.parametrize("call,name,valid", [
    (lambda q, k, v: effattn.attention(q, k, v, windw=3), "windw", "window"),
    (lambda q, k, v: effattn.linear_attention(q, k, v, feature=3), "feature", "feature_map"),
    (lambda q, k, v: effattn.explain(q, k, v, windw=3), "windw", "key_padding_mask"),
    (lambda q, k, v: effattn.explain(q, k, v, op="linear_attention", window=3), "window", "initial_state"),
])
def test_unknown_keyword_is_a_type_error_naming_it_and_the_valid_ones(call, name, valid):
    with pytest.raises(TypeError) as e:
        call(*qkv())
    msg = str(e.value)
    assert repr(name) in msg and valid in msg and "make_attn_call" not in msg


def test_a_close_keyword_is_suggested():
    with pytest.raises(TypeError, match="did you mean 'window'"):
        effattn.attention(*qkv(), windw=3)


def test_caches_misuse_says_a_list_of_one_kvcache_per_layer_is_expected():
    model = effattn.nn.TransformerEncoder(effattn.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    x = torch.randn(1, 1, 8)
    with pytest.raises(TypeError, match=r"a list of one KVCache per layer \(2 layers\), e.g. caches=\[effattn.nn.KVCache\(\).*got a KVCache"):
        model(x, is_causal=True, caches=effattn.nn.KVCache())
    with pytest.raises(ValueError, match=r"one KVCache per layer \(2 layers\).*got a list of 1"):
        model(x, is_causal=True, caches=[effattn.nn.KVCache()])
    with pytest.raises(TypeError, match="it holds a str"):
        model(x, is_causal=True, caches=["a", "b"])
    model(x, is_causal=True, caches=[effattn.nn.KVCache() for _ in model.layers])


def test_an_installed_backend_without_a_kernel_for_the_op_says_so():
    from effattn.backends import base
    for name in base.BACKENDS:
        if name in base.UNAVAILABLE or name in {b.name for b in base.backends_for("linear_attention")}:
            continue
        with pytest.raises(RuntimeError, match=f"backend '{name}' has no linear_attention kernel in this version"):
            effattn.linear_attention(*qkv(), backend=name)
        assert "not available" not in str(effattn.explain(*qkv(), op="linear_attention").reasons[name])
