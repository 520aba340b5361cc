"""attn_implementation="effattn" in transformers: tiny randomly initialized models built from configs
(offline), batches with padding, outputs equal to the "eager" implementation's at real tokens."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import effattn  # noqa: E402
import effattn.integrations.huggingface as hf_effattn  # noqa: E402

hf_effattn.register()

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def _config(name):
    if name == "bert":
        return transformers.BertModel, transformers.BertConfig(**TINY)
    if name == "gpt2":
        return transformers.GPT2Model, transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4,
                                                               n_positions=64, bos_token_id=0, eos_token_id=0)
    if name == "gpt2-lm":
        return transformers.GPT2LMHeadModel, _config("gpt2")[1]
    if name == "mistral-sliding":                    # every layer a sliding window of 4, GQA 4 -> 2 heads
        return transformers.MistralForCausalLM, transformers.MistralConfig(
            **TINY, num_key_value_heads=2, head_dim=8, sliding_window=4)
    if name == "qwen2-alternating":                  # sliding and full layers alternate
        if not hasattr(transformers, "Qwen2Config"):
            pytest.skip("this transformers has no Qwen2")
        cfg = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2,
                                       use_sliding_window=True, sliding_window=4, max_window_layers=0)
        if getattr(cfg, "layer_types", None) is None:
            pytest.skip("this transformers' Qwen2 has no per-layer attention types")
        cfg.layer_types = ["sliding_attention", "full_attention"] * 2
        return transformers.Qwen2ForCausalLM, cfg
    if name == "modernbert-sliding":              # bidirectional: local layers see |i - j| <= local_attention / 2
        if not hasattr(transformers, "ModernBertConfig"):
            pytest.skip("this transformers has no ModernBERT")
        return transformers.ModernBertModel, transformers.ModernBertConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=3, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    if name == "gemma3-bidirectional":            # EmbeddingGemma-style: sliding layers see |i - j| < sliding_window
        if not hasattr(transformers, "Gemma3TextConfig"):
            pytest.skip("this transformers has no Gemma3")
        cfg = transformers.Gemma3TextConfig(**TINY, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                            layer_types=["sliding_attention", "full_attention"])
        if not hasattr(cfg, "use_bidirectional_attention"):
            pytest.skip("this transformers' Gemma3 has no bidirectional attention")
        cfg.use_bidirectional_attention = True
        return transformers.Gemma3TextModel, cfg
    if name == "gpt-oss-sinks":                      # attention sinks (s_aux), sliding and full layers, MoE
        if not hasattr(transformers, "GptOssConfig"):
            pytest.skip("this transformers has no gpt-oss")
        cfg = transformers.GptOssConfig(**TINY, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                        num_local_experts=2, num_experts_per_tok=1,
                                        layer_types=["sliding_attention", "full_attention"])
        return transformers.GptOssModel, cfg
    if name == "gemma2-softcap":                     # attention logit soft-capping
        if not hasattr(transformers, "Gemma2Config"):
            pytest.skip("this transformers has no Gemma2")
        return transformers.Gemma2Model, transformers.Gemma2Config(**TINY, num_key_value_heads=2, head_dim=8,
                                                                   sliding_window=4)
    raise KeyError(name)


def _pair(name):
    """The same random weights under attn_implementation 'eager' and 'effattn' (eval mode)."""
    cls, cfg = _config(name)
    torch.manual_seed(0)
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation="effattn").eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "effattn" and eager.config._attn_implementation == "eager"
    return eager, ours


def _batch(B=3, L=12, left=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    if left:
        mask[1, :4] = 0
        mask[2, :2] = 0
    else:
        mask[1, L - 4:] = 0
        mask[2, L - 1:] = 0
    return ids, mask


@pytest.mark.parametrize("padding", ["left", "right", "none"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "mistral-sliding", "qwen2-alternating", "modernbert-sliding",
                                  "gemma3-bidirectional", "gemma2-softcap", "gpt-oss-sinks"])
def test_same_outputs_as_eager(name, padding):
    eager, ours = _pair(name)
    if name == "gpt-oss-sinks":                      # random sinks: the default init leaves them empty
        for a, b in zip(eager.modules(), ours.modules()):
            if hasattr(a, "sinks"):
                with torch.no_grad():
                    a.sinks.copy_(torch.linspace(-1, 2, a.sinks.numel()))
                    b.sinks.copy_(a.sinks)
    ids, mask = _batch(left=padding == "left")
    if padding == "none":
        mask = torch.ones_like(mask)
    hf_effattn.stats.clear()
    with torch.no_grad():
        a = eager(input_ids=ids, attention_mask=mask)[0]
        b = ours(input_ids=ids, attention_mask=mask)[0]
    real = mask.bool()                   # padding positions are not compared (see the module docstring)
    assert not torch.isnan(b).any()
    torch.testing.assert_close(b[real], a[real], atol=2e-5, rtol=2e-5)
    n_layers = ours.config.num_hidden_layers
    assert hf_effattn.stats == {"fused": n_layers}, dict(hf_effattn.stats)


def test_sinks_and_softcap_training_gradients_match_eager():
    """gpt-oss's sinks and Gemma 2's soft-capping train on the fused path: every parameter's gradient,
    the sinks' included, equals eager's."""
    for name in ("gpt-oss-sinks", "gemma2-softcap"):
        eager, ours = _pair(name)
        ids, mask = _batch(left=False)
        for model in (eager, ours):
            model.train()
            for m in model.modules():
                if hasattr(m, "sinks"):
                    with torch.no_grad():
                        m.sinks.copy_(torch.linspace(-1, 2, m.sinks.numel()))
                if hasattr(m, "attention_dropout"):
                    m.attention_dropout = 0.0
            out = model(input_ids=ids, attention_mask=mask)[0]
            # a fixed random projection: not invariant under the final norm (sum(out^2) nearly is)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
            (out * w)[mask.bool()].sum().backward()
        for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
            if p.grad is None:
                assert q.grad is None, n
                continue
            # fp32 sums of large gradients (up to ~30 here): judged relative to the largest entry
            tol = 2e-5 * p.grad.abs().max().item() + 1e-6
            torch.testing.assert_close(q.grad, p.grad, atol=tol, rtol=1e-4, msg=n)


@pytest.mark.parametrize("padding", ["right", "none"])
def test_t5_relative_position_bias_is_fused(padding):
    """T5 (encoder self-attention with padding, causal decoder self-attention, cross-attention):
    its relative position bias is a dense bias of the fused kernel, forward and backward as eager."""
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    eager = transformers.T5Model._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = transformers.T5Model._from_config(copy.deepcopy(cfg), attn_implementation="effattn")
    ours.load_state_dict(eager.state_dict())
    ids, mask = _batch(left=False)
    if padding == "none":
        mask = torch.ones_like(mask)
    dec = ids[:, :7]
    hf_effattn.stats.clear()
    outs = []
    for model in (eager, ours):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state
        (out ** 2).sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4, msg=n)
    assert set(hf_effattn.stats) == {"fused"}, dict(hf_effattn.stats)


def test_fallback_for_masks_that_are_not_causal_plus_padding():
    """A custom 4-D mask (here: random blocked pairs) is served by the dense fallback, exactly."""
    eager, ours = _pair("mistral-sliding")
    ids, _ = _batch()
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(3, 1, 12, 12, generator=g) > 0.3
    keep |= torch.eye(12, dtype=torch.bool)
    module = ours.model.layers[0].self_attn
    q = torch.randn(3, 4, 12, 8)
    k, v = torch.randn(3, 2, 12, 8), torch.randn(3, 2, 12, 8)
    hf_effattn.stats.clear()
    out, w = hf_effattn.attention_forward(module, q, k, v, keep, scaling=0.3)
    assert w is None and out.shape == (3, 12, 4, 8)
    assert hf_effattn.stats == {"dense: mask is not causal/sliding-window + padding": 1}
    ref = transformers.models.mistral.modeling_mistral.eager_attention_forward
    neg = torch.finfo(torch.float32).min
    expected, _ = ref(module, q, k, v, torch.where(keep, 0.0, neg), scaling=0.3, dropout=0.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_incremental_decoding_with_cache():
    """Prefill then one token at a time through transformers' KV cache: the same logits as eager and
    as one full forward (bottom-right alignment with a sliding window)."""
    eager, ours = _pair("mistral-sliding")
    ids, mask = _batch()
    logits = []
    hf_effattn.stats.clear()
    with torch.no_grad():
        for model in (eager, ours):
            out = model(input_ids=ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
            steps = [out.logits]
            for t in range(7, ids.shape[1]):
                out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                            past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits)
            logits.append(torch.cat(steps, 1))
        full = ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[1][real], logits[0][real], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(logits[1][real], full[real], atol=2e-5, rtol=2e-5)
    assert set(hf_effattn.stats) == {"fused"}


@pytest.mark.parametrize("name", ["qwen2-alternating", "mistral-sliding"])
def test_static_cache_generate_is_fused(name):
    """A static cache hands attention all its slots, the unused ones masked for every query; they are
    cut off, so prefill and decoding stay on the fused kernel (and decoding reads only used slots)."""
    eager, ours = _pair(name)
    ids, mask = _batch()
    hf_effattn.stats.clear()
    with torch.no_grad():
        a = eager.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                           cache_implementation="static")
        b = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                          cache_implementation="static")
    assert torch.equal(a, b)
    assert set(hf_effattn.stats) == {"fused"}, dict(hf_effattn.stats)


def test_unused_trailing_keys_are_cut(monkeypatch):
    """Keys at the end of a 4-D mask that no query may see (a static cache's unused slots) do not
    reach the kernel, and the rest stays exact."""
    module = torch.nn.Module()
    module.is_causal = True
    B, H, Lq, Lk, D = 2, 4, 3, 10, 8
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, 2, Lk, D), torch.randn(B, 2, Lk, D)
    pos = torch.arange(Lq)[:, None] + 2                              # queries at positions 2, 3, 4
    keep = (torch.arange(Lk)[None, :] <= pos).expand(B, 1, Lq, Lk).clone()
    keep[1, ..., 0] = False                                          # and a padded key
    seen = []
    real = hf_effattn.attention
    monkeypatch.setattr(hf_effattn, "attention", lambda q, k, v, **kw: seen.append(k.shape[2]) or real(q, k, v, **kw))
    hf_effattn.stats.clear()
    out, _ = hf_effattn.attention_forward(module, q, k, v, keep)
    assert seen == [5] and hf_effattn.stats == {"fused": 1}
    expected, _ = hf_effattn.dense_attention(q, k, v, visible=keep)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_generate_matches_eager():
    eager, ours = _pair("gpt2-lm")
    ids, mask = _batch()
    with torch.no_grad():
        a = eager.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        b = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_training_step_gradients_match_eager():
    eager, ours = _pair("bert")
    ids, mask = _batch(left=False)
    for model in (eager, ours):
        model.train()
        for m in model.modules():                    # dropout off: compare deterministic gradients
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model.config.attention_probs_dropout_prob = 0.0
        out = model(input_ids=ids, attention_mask=mask)[0]
        (out[mask.bool()] ** 2).sum().backward()
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4, msg=n)


def test_register_is_idempotent_and_names_backend():
    assert hf_effattn.register() == "effattn"
    assert "effattn" in transformers.AttentionInterface._global_mapping
    with pytest.raises(ValueError, match="backend"):
        hf_effattn.register(backend="flash")


# ------------------------------------------------------------------ keywords (issue 27)

def _t5_pair():
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    cls = transformers.T5ForConditionalGeneration
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation="effattn").eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def test_t5_position_bias_served_not_dropped():
    """T5 passes its relative position bias as position_bias=; the integration ignored it and
    reported every call as fused (logits off by 0.2). The bias is now a fused score term (bias=);
    layers whose bias is all zeros (cross-attention) leave it out."""
    eager, ours = _t5_pair()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    dec = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    hf_effattn.stats.clear()
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the encoder's and decoder's self-attention (the bias as a fused score term) and cross-attention
    # (a zero bias): every call fused
    assert set(hf_effattn.stats) == {"fused"} and hf_effattn.stats["fused"] == 6


def test_swap_attention_upgrades_t5_bias_to_a_fused_term():
    """swap_attention makes T5's relative bias an effattn.bias.Relative term (no dense (1, H, L, L)
    tensor): logits, the bucket embedding's gradient and greedy generation (the cache offsets) as
    eager; a model on "eager" is left alone with a warning per module."""
    eager, ours = _t5_pair()
    eager_copy = copy.deepcopy(eager)
    _, changes = effattn.swap_attention(ours, return_changes=True)
    names = ["encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention"]
    assert [n for n, _ in changes] == names and all("effattn.bias.Relative" in c for _, c in changes)
    attn = ours.get_submodule(names[1])
    assert isinstance(attn.compute_bias(3, 7), effattn.bias.Relative)
    ids = torch.randint(1, 100, (2, 40), generator=torch.Generator().manual_seed(3))      # past max_distance
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 29:] = 0
    dec = torch.randint(1, 100, (2, 33), generator=torch.Generator().manual_seed(4))
    out = [m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=dec) for m in (eager, ours)]
    torch.testing.assert_close(out[1].logits, out[0].logits, rtol=1e-5, atol=1e-5)
    for o in out:
        o.loss.backward()
    for name in names:
        w = name + ".relative_attention_bias.weight"
        torch.testing.assert_close(ours.get_parameter(w).grad, eager.get_parameter(w).grad, rtol=1e-4, atol=1e-7)
    gen = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False) for m in (eager, ours)]
    assert torch.equal(gen[0], gen[1])
    with pytest.warns(UserWarning, match="T5 relative bias left dense: its attention implementation is 'eager'"):
        effattn.swap_attention(eager_copy)
    assert not isinstance(eager_copy.get_submodule(names[0]).compute_bias(3, 3), effattn.bias.Relative)


def test_upgrade_t5_bias_checks_the_bias_first():
    """A module whose compute_bias is not T5's bucketed bias is not upgraded (named, with why)."""
    _, ours = _t5_pair()
    attn = ours.get_submodule("encoder.block.0.layer.0.SelfAttention")

    class Scaled(type(attn)):
        def compute_bias(self, *args, **kwargs):
            return 2 * super().compute_bias(*args, **kwargs)
    attn.__class__ = Scaled
    got = hf_effattn.upgrade_t5_bias(ours)
    assert got["served"] == ["decoder.block.0.layer.0.SelfAttention"]
    assert "not T5's bucketed bias" in got["not served"]["encoder.block.0.layer.0.SelfAttention"]


def _call_site_keywords():
    """Every keyword the installed transformers passes to an attention function: the keywords of its
    models' ``attention_interface(...)`` calls and the fields of the keyword dicts models forward."""
    import glob
    import os
    import re
    root = os.path.dirname(transformers.__file__)
    names = set()
    for f in glob.glob(os.path.join(root, "models", "**", "modeling_*.py"), recursive=True):
        src = open(f, encoding="utf-8").read()
        for m in re.finditer(r"attention_interface\(", src):
            depth, j = 1, m.end()
            while depth and j < len(src):
                depth += {"(": 1, ")": -1}.get(src[j], 0)
                j += 1
            names.update(re.findall(r"(?<![\w.=!<>])(\w+)\s*=(?!=)", src[m.end():j - 1]))
    from transformers.utils.generic import TransformersKwargs
    names.update(TransformersKwargs.__annotations__)
    try:
        from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
        names.update(FlashAttentionKwargs.__annotations__)
    except ImportError:
        pass
    return names - {"query", "key", "value", "attention_mask", "module"}


def test_every_call_site_keyword_is_served_or_refused():
    """A keyword the integration does not understand must be served or refused with an error naming
    it, never dropped: each keyword transformers' call sites pass is in the integration's table, and
    fed a value it is served (finite output) or refused (an error that names it)."""
    names = _call_site_keywords()
    assert len(names) > 15, sorted(names)
    known = set().union(*hf_effattn.KEYWORDS.values())
    assert names <= known, f"keywords transformers passes that the integration does not classify: {names - known}"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    values = {"dropout": 0.0, "scaling": 0.3, "is_causal": False, "sliding_window": 3, "softcap": 30.0,
              "position_bias": torch.randn(1, 2, 6, 6, generator=g), "s_aux": torch.zeros(2), "sinks": torch.zeros(2),
              # packed-sequence offsets of this call's 6 tokens (two sequences of 3)
              "cu_seq_lens_q": torch.tensor([0, 3, 6], dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor([0, 3, 6], dtype=torch.int32)}
    for name in sorted(names):
        value = values.get(name, torch.ones(3, dtype=torch.long))
        if name in hf_effattn.KEYWORDS["refused"]:
            with pytest.raises((NotImplementedError, TypeError), match=name):
                hf_effattn.attention_forward(module, q, k, v, None, **{name: value})
        else:
            out, _ = hf_effattn.attention_forward(module, q, k, v, None, **{name: value})
            assert torch.isfinite(out).all(), name
    with pytest.raises(TypeError, match="'made_up_keyword'"):
        hf_effattn.attention_forward(module, q, k, v, None, made_up_keyword=torch.ones(1))
    out, _ = hf_effattn.attention_forward(module, q, k, v, None, made_up_keyword=None)   # None carries nothing
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["mistral-sliding", "qwen2-alternating", "gemma2-softcap"])
def test_packed_sequences_run_fused_with_cu_seqlens(name, monkeypatch):
    """One row of three packed sequences (position_ids restarting at 0, no cache): the fused path with
    cu_seqlens, equal to running each sequence alone, forward and backward (Gemma 2's softcap included;
    transformers' gpt-oss does not read packed position_ids, under "eager" neither: its sinks with
    packing are checked through the flash keywords below)."""
    eager, ours = _pair(name)
    ids = torch.randint(1, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    bounds = [(0, 5), (5, 8), (8, 12)]
    pos = torch.cat([torch.arange(b - a) for a, b in bounds])[None]
    seen = []
    real = hf_effattn.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cu_seqlens"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_effattn, "attention", spy)
    hf_effattn.stats.clear()
    out = ours(input_ids=ids, position_ids=pos, use_cache=False)[0]
    assert hf_effattn.stats == {"fused": ours.config.num_hidden_layers}, dict(hf_effattn.stats)
    assert all(cu is not None and cu.tolist() == [0, 5, 8, 12] for cu in seen)
    alone = torch.cat([eager(input_ids=ids[:, a:b], use_cache=False)[0] for a, b in bounds], 1)
    torch.testing.assert_close(out, alone, atol=2e-5, rtol=2e-5)
    params = [p for p in ours.parameters() if p.requires_grad]
    # a fixed random projection: sum(out^2) is nearly invariant under a final norm (Gemma 2's), which leaves
    # gradients of float32 cancellation noise
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * w).sum(), params)
    ref = torch.autograd.grad((alone * w).sum(), [p for p in eager.parameters() if p.requires_grad])
    for g, r in zip(grads, ref):
        # fp32 sums of large gradients: judged relative to the largest entry
        torch.testing.assert_close(g, r, atol=max(1e-4, 2e-5 * r.abs().max().item()), rtol=1e-4)


def test_flash_attention_keywords_cu_seq_lens_take_the_packed_path():
    """transformers' flash-attention keywords (DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    without a mask: the segments are read from cu_seq_lens_q / cu_seq_lens_k."""
    module = _pair("mistral-sliding")[1].model.layers[0].self_attn
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    hf_effattn.stats.clear()
    out, _ = hf_effattn.attention_forward(module, q, k, v, None, scaling=0.3, is_causal=True, cu_seq_lens_q=cu,
                                          cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    ref = torch.cat([hf_effattn.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, scale=0.3)
                     for a, b in ((0, 4), (4, 9))], 2).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert hf_effattn.stats == {"fused": 1}
    # gpt-oss's sinks (s_aux) with the same keywords: each segment's rows normalized with its sink
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, _ = hf_effattn.attention_forward(module, q, k, v, None, scaling=0.3, is_causal=True, cu_seq_lens_q=cu,
                                          cu_seq_lens_k=cu, max_length_q=5, max_length_k=5, s_aux=sinks)
    ref = torch.cat([hf_effattn.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, scale=0.3,
                                          sinks=sinks) for a, b in ((0, 4), (4, 9))], 2).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert hf_effattn.stats == {"fused": 2}


def _alibi_model(name, impl):
    if name == "bloom":
        cfg = transformers.BloomConfig(vocab_size=100, hidden_size=40, n_layer=2, n_head=5, attention_dropout=0.0,
                                       hidden_dropout=0.0)
        return transformers.BloomModel._from_config(cfg, attn_implementation=impl)
    cfg = transformers.MptConfig(vocab_size=100, d_model=40, n_layers=2, n_heads=5, max_seq_len=32,
                                 attn_config={"alibi": True, "attn_pdrop": 0})
    return transformers.MptModel._from_config(cfg, attn_implementation=impl)


@pytest.mark.parametrize("padding", ["left", "none"])
@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_alibi_models_swapped_match_eager(name, padding):
    """BLOOM and MPT (5 heads: the slopes' non-power-of-two rule) after `swap_alibi_attention`:
    every attention module runs fused with the ALiBi slopes as a score term (no dense bias), and the
    outputs equal eager's at real tokens; the parameters' gradients (ill-conditioned at this random
    init: eager's own fp32 gradients are off by up to 10% from float64) are as close to the float64
    gradients as eager's are."""
    torch.manual_seed(0)
    eager = _alibi_model(name, "eager")
    ours = _alibi_model(name, "eager")
    ours.load_state_dict(eager.state_dict())
    report = hf_effattn.swap_alibi_attention(ours, backend="torch")
    assert len(report["served"]) == 2 and not report["not served"], report
    ref = copy.deepcopy(ours).double()               # the fused path in float64 (the torch reference)
    ids, mask = _batch(left=True)
    if padding == "none":
        mask = torch.ones_like(mask)
    real = mask.bool()
    hf_effattn.stats.clear()
    outs = []
    for model in (eager, ours, ref):
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out[real] ** 2).sum().backward()
        outs.append(out)
    assert hf_effattn.stats == {"fused": 4}, dict(hf_effattn.stats)
    torch.testing.assert_close(outs[1][real], outs[0][real], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[2][real].float(), outs[0][real], atol=2e-5, rtol=2e-5)
    for (n, p), (_, q), (_, r) in zip(eager.named_parameters(), ours.named_parameters(), ref.named_parameters()):
        if p.grad is not None:
            e_eager = (p.grad.double() - r.grad).abs().max().item()
            e_ours = (q.grad.double() - r.grad).abs().max().item()
            assert e_ours <= 2 * e_eager + 1e-6 * r.grad.abs().max().item() + 1e-9, (n, e_ours, e_eager)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("heads", ["multi-query", "multi-head"])
def test_alibi_swap_serves_falcon_alibi(impl, heads):
    """Falcon with ALiBi after `swap_alibi_attention`: fused with one ALiBi slope per head (eager adds the
    bias twice, in the scores and in the mask the model builds; sdpa once), outputs equal to the model's
    own implementation at real tokens, left padding included, gradients close."""
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=True, new_decoder_architecture=False, multi_query=heads == "multi-query",
                                    attention_dropout=0.0, hidden_dropout=0.0)
    theirs = transformers.FalconModel._from_config(cfg, attn_implementation=impl)
    ours = transformers.FalconModel._from_config(cfg, attn_implementation=impl)
    ours.load_state_dict(theirs.state_dict())
    report = hf_effattn.swap_alibi_attention(ours, backend="torch")
    assert len(report["served"]) == 2 and not report["not served"], report
    ids, mask = _batch(left=True)
    real = mask.bool()
    hf_effattn.stats.clear()
    outs = []
    for model in (theirs, ours):
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out[real] ** 2).sum().backward()
        outs.append(out)
    assert hf_effattn.stats == {"fused": 2}, dict(hf_effattn.stats)
    torch.testing.assert_close(outs[1][real], outs[0][real], atol=2e-5, rtol=2e-5)
    for (n, p), (_, q) in zip(theirs.named_parameters(), ours.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=n)
