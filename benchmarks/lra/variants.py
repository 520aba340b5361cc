"""The attention variants the harness trains, as keyword arguments of the `effattn.nn` layers.

Block-sparse variants get a callable layout ``(Lq, Lk) -> BlockLayout``, since batches have
different lengths. The pattern is built once for the model's longest input and cropped to each
batch, so a sequence attends the same way however much padding its batch has (BigBird's random
blocks would otherwise be redrawn for every batch length).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Dict

from effattn import FavorFeatures, layouts

#: name -> (description for the tables, builder(block_size, window) -> layer keyword arguments)
VARIANTS: Dict[str, tuple] = {}


def _variant(name: str, about: str):
    def register(fn: Callable[[int, int], Dict]):
        VARIANTS[name] = (about, fn)
        return fn
    return register


def _layout(builder, max_length: int, **kw):
    full = builder(max_length, **kw)
    bs = kw["block_size"]

    @functools.lru_cache(maxsize=64)
    def crop(Lq: int, Lk: int) -> layouts.BlockLayout:
        if Lq != Lk or Lq > max_length:
            raise ValueError(f"layout: built for self-attention over at most {max_length} tokens, got ({Lq}, {Lk})")
        n = -(-Lq // bs)
        return layouts.BlockLayout(full.mask[:, :n, :n], bs)
    return crop


@_variant("softmax", "dense softmax attention (the Transformer baseline)")
def _softmax(bs, window, L):
    return {}


@_variant("local", "local sliding window, `window` keys on each side")
def _local(bs, window, L):
    return {"window": (window, window)}


@_variant("fixed", "Sparse Transformer fixed (Child et al. 2019): own window of 4 blocks + its last block as summary")
def _fixed(bs, window, L):
    return {"layout": _layout(layouts.fixed, L, block_size=bs, stride=4, summary=1, causal=False)}


@_variant("strided", "Sparse Transformer strided (Child et al. 2019): 4 neighbouring blocks + every 4th block")
def _strided(bs, window, L):
    return {"layout": _layout(layouts.strided, L, block_size=bs, stride=4, causal=False)}


@_variant("bigbird", "BigBird (Zaheer et al. 2020): 3 window + 2 global + 3 random blocks")
def _bigbird(bs, window, L):
    return {"layout": _layout(layouts.bigbird, L, block_size=bs, num_window_blocks=3, num_global_blocks=2,
                              num_random_blocks=3, seed=0)}


@_variant("longformer", "Longformer (Beltagy et al. 2020): window of 1 block each side + global first block")
def _longformer(bs, window, L):
    return {"layout": _layout(layouts.longformer, L, block_size=bs, window_blocks=1, global_blocks=(0,))}


@_variant("linear", "linear attention, elu(x)+1 feature map (Katharopoulos et al. 2020)")
def _linear(bs, window, L):
    return {"linear": "elu"}


@_variant("favor", "Performer FAVOR+ (Choromanski et al. 2021), positive orthogonal random features")
def _favor(bs, window, L, head_dim=64):
    # at most 256 features: effattn.nn masks padded keys by computing the features itself, which it
    # does for up to 256 (the default, d log d, is 266 for d = 64)
    features = min(256, max(head_dim, round(head_dim * math.log(head_dim))))
    return {"linear": FavorFeatures(head_dim, num_features=features, seed=0)}


@_variant("reformer", "Reformer (Kitaev et al. 2020): LSH attention, 2 hashes, chunks of `block_size`, reversible layers")
def _reformer(bs, window, L):
    from .encoders import ReformerEncoder
    return {"encoder": functools.partial(ReformerEncoder, chunk_len=bs, n_hashes=2)}


@_variant("transformer-xl", "Transformer-XL relative attention (Dai et al. 2019), bidirectional; Triton kernels on a GPU")
def _transformer_xl(bs, window, L):
    from .encoders import TransformerXLEncoder
    return {"encoder": TransformerXLEncoder}


@_variant("adaptive-span", "adaptive attention span (Sukhbaatar et al. 2019), bidirectional: a learned span per "
                           "head and layer, keys beyond it skipped; span loss added to the task's")
def _adaptive_span(bs, window, L):
    return {"encoder": functools.partial(span_encoder, max_span=L, init_span=window)}


def span_encoder(cfg, max_span: int, init_span: int, ramp: int = 32, backend: str = "auto"):
    """An `effattn.nn.TransformerEncoder` whose layers' attention adds a bidirectional
    `effattn.nn.AdaptiveSpan` (own spans per layer, starting at ``init_span`` tokens)."""
    import torch.nn as nn

    import effattn
    layer = effattn.nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, cfg.ff, cfg.dropout, activation="gelu",
                                               batch_first=True, norm_first=True, backend=backend)
    layer.self_attn.position_bias = effattn.nn.AdaptiveSpan(cfg.heads, max_span, ramp=ramp,
                                                            init=min(1.0, init_span / max(max_span, 1)),
                                                            bidirectional=True)
    return effattn.nn.TransformerEncoder(layer, cfg.layers, norm=nn.LayerNorm(cfg.d_model))


def span_loss(net):
    """The adaptive spans' penalty (`effattn.nn.AdaptiveSpan.loss`) summed over ``net``'s modules:
    the training loss adds it (0 for a model without spans)."""
    from effattn.nn import AdaptiveSpan
    return sum((m.loss() for m in net.modules() if isinstance(m, AdaptiveSpan)), 0.0)


def clamp_spans(net) -> None:
    """Keeps every adaptive span of ``net`` in [0, max_span] (after each optimizer step)."""
    from effattn.nn import AdaptiveSpan
    for m in net.modules():
        if isinstance(m, AdaptiveSpan):
            m.clamp_()


def layer_kwargs(variant: str, block_size: int = 64, window: int = 128, max_length: int = 4096,
                 head_dim: int = 64) -> Dict:
    """Keyword arguments for `effattn.nn.TransformerEncoderLayer` (``max_length``: the longest input,
    CLS included), or ``{"encoder": build(cfg)}`` for a variant with its own encoder (benchmarks.lra.encoders)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant == "favor":
        return _favor(block_size, window, max_length, head_dim)
    return VARIANTS[variant][1](block_size, window, max_length)


def backends_serving(variant: str, device: str = "cpu", length: int = 256, head_dim: int = 32) -> Dict[str, str]:
    """Which effattn backends can serve the variant's attention on ``device`` (``effattn.explain``
    on a probe of ``length`` tokens): ``{backend: "" if it can, else why not}``."""
    import torch

    import effattn
    kw = layer_kwargs(variant, 64, 128, length, head_dim)
    if "encoder" in kw:                  # Reformer: torch or its Triton kernels (effattn.explain_lsh); TXL: torch
        if variant == "reformer":
            cl = kw["encoder"].keywords["chunk_len"]
            probe = torch.zeros(1, 1, cl, head_dim, device=device)
            rep = effattn.explain(probe, probe, probe, op="lsh_attention", chunk_len=cl)
        elif variant == "adaptive-span":
            from effattn.bias import Span
            q = torch.zeros(1, 2, length, head_dim, device=device)
            span = Span(torch.zeros(2, device=device), ramp=32, max_span=length, bidirectional=True)
            rep = effattn.explain(q, q, q, key_padding_mask=torch.zeros(1, length, dtype=torch.bool, device=device),
                                  bias=span)
            return {name: "; ".join(why) for name, why in rep.reasons.items()}
        else:
            probe = torch.zeros(1, 1, 1, head_dim, device=device)
            rep = effattn.explain(probe, probe, probe, op="relative_attention", causal=True,
                                  r=probe.new_zeros(1, 1, head_dim))
        triton = [r for r in rep.rows if r.backend == "triton"]
        reasons = rep.reasons.get("triton", []) if not triton else \
            triton[0].reasons or [n for n in triton[0].notes if "only when asked for by name" in n]
        return {"torch": "", "cuda": "no CUDA C++ kernel for this variant",
                "triton": "; ".join(reasons)}
    q = torch.zeros(1, 2, length, head_dim, device=device)
    pad = torch.zeros(1, length, dtype=torch.bool, device=device)
    if "linear" in kw:
        rep = effattn.explain(q, q, q, op="linear_attention", feature_map=kw["linear"])
    else:
        if "layout" in kw:
            kw = {"layout": kw["layout"](length, length)}
        rep = effattn.explain(q, q, q, key_padding_mask=pad, **kw)
    return {name: "; ".join(why) for name, why in rep.reasons.items()}


def variants_markdown(device: str = "cpu") -> str:
    lines = ["| variant | what it is | backends that can serve it here |", "|---|---|---|"]
    for name, (about, _) in VARIANTS.items():
        can = [b for b, why in backends_serving(name, device).items() if not why]
        lines.append(f"| {name} | {about} | {', '.join(can) or 'none'} |")
    return "\n".join(lines) + "\n"
