"""effattn as a Hugging Face transformers attention implementation: ``attn_implementation="effattn"``.

    >>> import effattn.integrations.huggingface as hf_effattn
    >>> hf_effattn.register()
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="effattn")

How a call is served. transformers hands the attention function ``query (B, H, L, D)``, ``key`` /
``value (B, Hkv, S, D)`` (not repeated for grouped-query attention: effattn reads them as they are),
an ``attention_mask`` and keyword arguments (``scaling``, ``dropout``, ``is_causal``,
``sliding_window``, ``softcap``, ...). For ``attn_implementation="effattn"`` the mask is built by
transformers' own SDPA mask function (registered under the same name with ``AttentionMaskInterface``
where that exists): a 4-D bool mask, or ``None`` when a plain causal / bidirectional mask without
padding suffices. Then:

- ``None``: the fused kernel with ``causal`` (the module's ``is_causal`` unless the call overrides it)
  and ``window`` from ``sliding_window``, read as transformers reads that keyword for FlashAttention
  (``window_size = (sliding_window - 1, sliding_window - 1)``): keys ``i - sliding_window + 1 .. i``
  when causal (as transformers' sliding masks), ``|i - j| <= sliding_window - 1`` otherwise (ModernBERT,
  bidirectional Gemma 3).
- a mask: effattn reads it once. Trailing keys that no query may see (a static cache's unused slots)
  are cut off; of the rest, keys that no query may see are taken as padding. If the mask then equals
  "causal/window structure AND NOT padding" exactly (bottom-right aligned), the fused kernel runs with
  that key padding mask. Anything else (packed sequences, image-token bidirectional blocks,
  non-binary float masks, ...) takes the **dense fallback**: a softmax over the materialized ``(L, S)``
  scores, the same math as the eager implementation, O(L^2) memory; with score terms, the fused
  kernel with that mask as a dense additive bias instead.
- packed sequences (one row, ``position_ids`` restarting at 0 with ``use_cache=False``, as transformers'
  ``DataCollatorWithFlattening`` makes them, or the flash-attention keywords ``cu_seq_lens_q/k``): when the
  mask transformers built is exactly "same sequence AND causal/window", the fused kernel runs with
  ``cu_seqlens`` (``effattn.attention``'s packed sequences), in O(L) memory (with softcap, sinks, ALiBi and
  relative tables too; a dense position bias tensor takes the paths below).

Score terms run fused (``effattn.attention``'s ``softcap``, ``sinks``, ``bias``): ``softcap`` (Gemma 2 /
3), attention sinks ``s_aux`` (gpt-oss, differentiable), and T5's ``position_bias`` (T5, LongT5,
Pix2Struct: a dense ``(1, H, L, S)`` bias, whose gradient flows back to the relative-attention
embedding).

Which path ran is counted in :data:`stats` (``"fused"``, ``"dense: <why>"``) and each fallback reason
is logged once at DEBUG level on the ``effattn.integrations.huggingface`` logger. Reading the mask is
a device sync and, under ``torch.compile``, a graph break.

Keywords. Besides the ones above, transformers passes the model's own keyword arguments through. Each
keyword the installed transformers' attention call sites pass is one of three kinds (:data:`KEYWORDS`):
served (``softcap``, ``s_aux`` / ``sinks`` and ``position_bias``, the score terms above;
``position_ids`` and ``cu_seq_lens_q/k`` give packed sequences' segments); carried elsewhere (positions already applied to q/k,
packed-sequence metadata the mask already expresses, output flags: nothing for the attention to do);
or refused with an error naming it (sparse top-k indices, head masks). A keyword not in the table
with a value other than None raises TypeError instead of being dropped.

Paged KV cache: not used here. transformers' continuous batching hands an attention function a block
table (``block_table``, ``k_cache``, ``v_cache``) only in its decode fast path, which it enables for
Flash Attention 2/3 on CUDA alone (``ensure_decode_fast_path_is_available`` sets
``max_blocks_per_request = 0`` for any other implementation); for ``"effattn"`` its paged cache gathers
each request's keys and this function receives them contiguous and packed (``cu_seq_lens_q/k``).
Serving the block table needs transformers to let a registered function declare that support; the
layouts already match :func:`effattn.attention`'s paged call.

Differences from ``"eager"``: a query row that may see no key at all (a left-padding position in a
causal model) outputs 0 where eager outputs the mean of all values; such rows are padding, and no
real token reads them. Attention weights are never returned (``output_attentions`` gives ``None``,
as with ``"sdpa"``).
"""
from __future__ import annotations

import collections
import logging
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import bias as _bias
from ..backends import base as backend_registry
from ..backends.torch.dense import dense_attention
from ..functional import attention
from ..packed import cu_seqlens_from_position_ids
from ..visibility import Rule

logger = logging.getLogger(__name__)

NAME = "effattn"
#: how many calls took each path since import: ``"fused"`` or ``"dense: <why>"``
stats: collections.Counter = collections.Counter()
_logged = set()


# What each keyword transformers passes to an attention function means here. "served": read by
# attention_forward; "carried": nothing to do (the information is in q, k, v or the mask, or concerns
# outputs or other implementations); "refused": an error naming the keyword when its value is not None.
KEYWORDS = {
    "served": frozenset({"dropout", "scaling", "is_causal", "sliding_window", "softcap", "position_bias", "s_aux",
                         "sinks", "alibi_slopes",
                         # packed sequences (one row): the fused path with cu_seqlens (`_packed_segments`)
                         "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"}),
    "carried": frozenset({
        "cache_position",                                    # positions: rotary embeddings already applied
        "max_length_q", "max_length_k", "seq_idx",           # packed sequences: the segments come from
        "max_seqlen_q", "max_seqlen_k", "cache_seqlens",     # cu_seq_lens_q/k or the mask
        "deterministic",                                     # effattn's kernels are always deterministic
        "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",  # output flags
        "num_items_in_batch", "use_cache", "past_key_values", "past_key_value", "layer_idx",
        "use_top_left_mask", "supports_mapping", "block_table", "query_length", "key_length",
        "softmax_scale"}),
    "refused": frozenset({"indices", "block_indices", "head_mask", "layer_head_mask"}),
}


def _check_keywords(kwargs) -> None:
    """NotImplementedError for a refused keyword given a value, TypeError for an unknown one."""
    for name, value in kwargs.items():
        if value is None or name in KEYWORDS["carried"] or name in KEYWORDS["served"]:
            continue
        if name in KEYWORDS["refused"]:
            raise NotImplementedError(f"effattn: this keyword ({name}=) is not supported; use attn_implementation='eager' "
                                      "or 'sdpa' for this model")
        raise TypeError(f"effattn (transformers): unknown attention keyword {name!r}; effattn does not know what "
                        "it means and refuses to ignore it (use attn_implementation='eager' for this model)")


def _record(path: str) -> None:
    if torch.compiler.is_compiling():
        return
    stats[path] += 1
    if path != "fused" and path not in _logged:
        _logged.add(path)
        logger.debug("effattn (transformers): %s path, O(L^2) dense softmax", path)


def _window(sliding_window: Optional[int], causal: bool):
    """transformers' ``sliding_window`` keyword -> effattn ``(left, right)``, inclusive.

    transformers' convention for the keyword is FlashAttention's ``window_size = (sw - 1, sw - 1)``
    (``modeling_flash_attention_utils``), causal folding the right side to 0: a causal query sees
    itself and ``sw - 1`` keys before it (``kv > q - sw``, ``sliding_window_overlay``), a bidirectional
    one ``|q - kv| <= sw - 1`` (ModernBERT passes ``local_attention // 2 + 1``, bidirectional Gemma 3
    masks ``|q - kv| < sw``)."""
    if not sliding_window:
        return None
    w = int(sliding_window) - 1
    return (w, 0) if causal else (w, w)


def _read_mask(mask: Tensor, B: int, Lq: int, Lk: int, causal: bool, window):
    """-> ("fused", key_padding_mask or None) when ``mask`` is exactly structure & ~padding, else
    ("dense", visible, bias, why)."""
    if mask.dtype == torch.bool:
        keep, bias = mask, None
    else:
        blocked = mask <= torch.finfo(mask.dtype).min / 2        # transformers' min value, or -inf
        if not bool(torch.all(blocked | (mask == 0))):
            return "dense", None, mask, "float mask with values other than 0 / min"
        keep, bias = ~blocked, None
    if keep.dim() != 4:
        return "dense", keep, bias, f"{keep.dim()}-D mask"
    pad = ~keep.any(dim=2).any(dim=1)                           # (B or 1, Lk): keys no query sees
    struct = Rule.of(Lq, Lk, causal=causal, window=window).materialize(device=keep.device)
    expected = ~pad[:, None, None, :]
    if struct is not None:
        expected = expected & struct
    if not bool(torch.all(keep == expected)):
        return "dense", keep, bias, "mask is not causal/sliding-window + padding"
    kpm = pad.expand(B, Lk) if bool(pad.any()) else None
    return "fused", kpm


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, position_bias: Optional[Tensor] = None, *,
                      backend: str = "auto", **kwargs) -> Tuple[Tensor, None]:
    """The function registered with transformers' ``AttentionInterface``.

    Args:
        query: ``(B, H, L, D)``; key, value ``(B, Hkv, S, D)`` / ``(B, Hkv, S, Dv)``.
        attention_mask: 4-D ``(B or 1, 1 or H, L, S)``, bool (True = attend) or float (added), or None.
        dropout, scaling, is_causal, sliding_window, softcap: as transformers passes them.
        position_bias: float, broadcastable to ``(B, H, L, S)``, added to the scaled scores (T5): a fused
            score term (``bias=``).
        kwargs: the other keywords transformers passes (see :data:`KEYWORDS`); unknown ones raise.

    Returns:
        ``(out (B, L, H, Dv), None)``.
    """
    _check_keywords(kwargs)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    if attention_mask is not None and not isinstance(attention_mask, Tensor):
        raise TypeError(f"effattn: attention_mask must be a tensor or None, got {type(attention_mask).__name__} "
                        "(a flex-attention BlockMask? use the 'effattn' mask function, see register())")
    if attention_mask is not None and attention_mask.shape[-1] > Lk:
        attention_mask = attention_mask[..., :Lk]
    window = _window(sliding_window, causal)

    if attention_mask is None and causal and 1 < Lq < Lk:
        # transformers' convention without a mask (a static cache's empty prefill): queries are the
        # first Lq positions and the keys after them are unused cache slots
        key, value, Lk = key[:, :, :Lq], value[:, :, :Lq], Lq
        position_bias = position_bias[..., :Lq] if isinstance(position_bias, Tensor) else position_bias

    if attention_mask is not None and attention_mask.dim() == 4:
        used = _used_keys(attention_mask, Lq)
        if used < Lk:
            # a static cache's unused slots: masked for every query, and in the way of the bottom-right
            # alignment the fused kernel's causal / window rule uses; cutting them changes nothing
            key, value, attention_mask, Lk = key[:, :, :used], value[:, :, :used], attention_mask[..., :used], used
            position_bias = position_bias[..., :used] if isinstance(position_bias, Tensor) else position_bias

    if isinstance(position_bias, Tensor):
        if not position_bias.requires_grad and not bool(position_bias.any()):
            position_bias = None                        # T5's zero bias of layers without one: adds nothing
        elif position_bias.shape[-1] > Lk:
            position_bias = position_bias[..., :Lk]
    elif position_bias is not None and not isinstance(position_bias, _bias.Relative):
        raise TypeError(f"effattn: position_bias must be a tensor or an effattn.bias.Relative term (upgrade_t5_bias), "
                        f"got {type(position_bias).__name__}")
    # ALiBi (BLOOM, MPT through `swap_alibi_attention`): the slopes as a fused term, O(L) memory
    slopes = kwargs.get("alibi_slopes")
    extra = [position_bias] if position_bias is not None else []
    if slopes is not None:
        extra.append(_bias.ALiBi(slopes))
    terms = dict(softcap=softcap, sinks=sinks, bias=extra or None)
    # packed sequences: the fused segment work list (with softcap, sinks, ALiBi, a relative table: segment-local
    # distances; a dense position_bias tensor takes the paths below)
    packed = (_packed_segments(attention_mask, kwargs, B, Lq, Lk, causal, window)
              if not any(isinstance(t, Tensor) for t in extra) else None)
    if packed is not None:
        out = attention(query, key, value, causal=causal, window=window, cu_seqlens=packed[0], max_seqlen=packed[1],
                        scale=scaling, dropout_p=float(dropout), backend=backend, **terms)
        _record("fused")
        return out.transpose(1, 2).contiguous(), None
    plan = ("fused", None) if attention_mask is None else _read_mask(attention_mask, B, Lq, Lk, causal, window)

    if plan[0] == "fused":
        out = attention(query, key, value, causal=causal, window=window, key_padding_mask=plan[1], scale=scaling,
                        dropout_p=float(dropout), backend=backend, **terms)
        _record("fused")
    elif softcap is not None or sinks is not None or extra:
        # a mask the visibility rule cannot express, with score terms: the fused kernel with the mask as a
        # dense additive bias (O(L^2) for the bias, as the mask itself; the attention stays fused)
        _, visible, bias, why = plan
        if bias is None:
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=query.device).masked_fill(~visible,
                                                                                                  float("-inf"))
        if isinstance(position_bias, Tensor):
            bias = bias + position_bias
        bias = [bias] + [t for t in extra if not isinstance(t, Tensor)]     # the terms (T5 Relative, ALiBi)
        out = attention(query, key, value, scale=scaling, dropout_p=float(dropout), backend=backend,
                        softcap=softcap, sinks=sinks, bias=bias)
        _record("fused, mask as a dense bias: " + why)
    else:
        _, visible, bias, why = plan
        out, _ = dense_attention(query, key, value, visible=visible, bias=bias, scale=scaling,
                                 dropout_p=float(dropout), softcap=softcap)
        _record("dense: " + why)
    return out.transpose(1, 2).contiguous(), None


def _packed_segments(mask: Optional[Tensor], kwargs, B: int, Lq: int, Lk: int, causal: bool, window):
    """``(cu_seqlens, max_seqlen)`` when the call is a packed batch that the segment work list serves
    exactly, else None. The segments come from the flash-attention keywords ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` when given, else from ``position_ids`` restarting (transformers' packing); a given
    mask must then equal "same segment AND causal/window inside it" (as transformers builds it when it
    detects packing), otherwise the usual mask reading decides."""
    if B != 1 or Lq != Lk:
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and (cu_k is None or torch.equal(cu_k, cu_q)):
        cu = cu_q.to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    elif kwargs.get("position_ids") is not None and mask is not None:
        pos = kwargs["position_ids"]
        if pos.dim() != 2 or pos.shape[-1] != Lq or pos.shape[0] != 1:
            return None
        cu, longest = cu_seqlens_from_position_ids(pos.to(mask.device))
    else:
        return None
    if cu.numel() <= 2 and mask is None:
        return None
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        if keep.dim() != 4 or keep.shape[-2:] != (Lq, Lk):
            return None
        seg = torch.searchsorted(cu[1:].to(keep.device), torch.arange(Lq, device=keep.device, dtype=torch.int32),
                                 right=True)                          # segment of each token
        expected = (seg[:, None] == seg[None, :])[None, None]
        struct = Rule.of(Lq, Lk, causal=causal, window=window).materialize(device=keep.device)
        if struct is not None:
            expected = expected & struct
        if not bool(torch.all(keep == expected)):
            return None
    return cu.to(mask.device if mask is not None else cu.device), longest


def _used_keys(mask: Tensor, Lq: int) -> int:
    """1 + the last key index some query may see under the 4-D ``mask`` (bool keep or float additive),
    but at least ``min(Lq, Lk)``, so that a causal call keeps its queries' own keys."""
    Lk = mask.shape[-1]
    seen = mask.any(dim=2) if mask.dtype == torch.bool else (mask > torch.finfo(mask.dtype).min / 2).any(dim=2)
    seen = seen.flatten(0, -2).any(dim=0)                      # (Lk,)
    idx = torch.nonzero(seen)
    last = int(idx[-1]) + 1 if idx.numel() else 0
    return max(last, min(Lq, Lk))


def register(name: str = NAME, *, backend: str = "auto") -> str:
    """Registers effattn with transformers under ``name`` (default ``"effattn"``), so that
    ``from_pretrained(..., attn_implementation=name)`` / ``from_config(...)`` use it.

    Registers the attention function with ``transformers.AttentionInterface`` and, where the installed
    transformers has ``AttentionMaskInterface`` (4.53+), transformers' SDPA mask builder under the same
    name (without it transformers 5 would build no mask at all for an unknown name). ``backend`` is
    passed to :func:`effattn.attention`. Returns ``name``.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("effattn.integrations.huggingface.register needs the transformers package "
                          "(pip install transformers)") from e
    names = ("auto",) + tuple(backend_registry.BACKENDS)
    if backend not in names:
        raise ValueError(f"register: backend must be one of {', '.join(map(repr, names))}, got {backend!r}")

    def effattn_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    effattn_attention.effattn = True           # what upgrade_t5_bias checks a model's implementation by

    transformers.AttentionInterface.register(name, effattn_attention)
    try:                                   # 4.53+; before, models build their own (float) masks
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return name
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# ------------------------------------------------------------------------------ ALiBi models (swapped)
#
# BLOOM and MPT compute attention inside their own modules (not through transformers' attention
# interface), with ALiBi as a dense bias built by the model: `attn_implementation` does not reach
# them. `swap_alibi_attention` replaces those modules' forward with one that computes q, k, v with
# the module's own weights and calls `attention_forward` with the ALiBi slopes as a fused score term.
# Both models' biases are the paper's -slope * (i - j) up to a constant per row (BLOOM: slope * key
# position, MPT: slope * (key position - max_seq_len + 1)), which the softmax ignores.

def _bloom_slopes(module, device):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    return _get_alibi_slopes(module.num_heads, device)


def _bloom_forward(backend):
    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        from transformers.models.bloom.modeling_bloom import dropout_add
        B, L, _ = hidden_states.shape
        q, k, v = self._reshape(self.query_key_value(hidden_states))
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        out, _ = attention_forward(self, q, k, v, attention_mask, dropout=self.attention_dropout.p if self.training
                                   else 0.0, scaling=self.inv_norm_factor, is_causal=True,
                                   alibi_slopes=_bloom_slopes(self, q.device), backend=backend)
        out = self.dense(out.reshape(B, L, self.num_heads * self.head_dim))
        return dropout_add(out, residual, self.hidden_dropout, self.training), None
    return forward


def _mpt_forward(backend, mask_blocks: bool):
    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        B, L = hidden_states.shape[:2]
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (t.reshape(B, L, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # MPT's bias (H, 1, max_seq_len) is slope * (j - max_seq_len + 1): the next-to-last entry is -slope
        slopes = -position_bias[:, 0, -2].float()
        mask = attention_mask
        if mask is not None and mask.dtype == torch.bool and mask_blocks:
            mask = ~mask                                  # MPT's eager masks: True = blocked
        out, _ = attention_forward(self, q, k, v, mask, dropout=self.attn_dropout_p if self.training else 0.0,
                                   scaling=self.softmax_scale, is_causal=True, alibi_slopes=slopes, backend=backend)
        return self.out_proj(out.reshape(B, L, -1)), None
    return forward


# Falcon with ALiBi adds the bias slope[h] * (key position) scaled by 1 / sqrt(head_dim) once inside the
# 4-D mask FalconModel builds (the mask then holds it where a key is visible, the dtype's min where
# not) and, in its eager form, once more in the scores: twice in eager, once with "sdpa". The swapped
# forward reads the mask's visibility and sends that sum as one ALiBi slope, with the slopes rounded
# to bfloat16 as transformers' `build_alibi_tensor` rounds them.

def _falcon_slopes(module, device):
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor
    return build_alibi_tensor(torch.ones(1, 2, device=device), module.num_heads, torch.float32).view(-1, 2)[:, 1]


def _falcon_forward(backend):
    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        B, L, _ = hidden_states.shape
        q, k, v = self._split_heads(self.query_key_value(hidden_states))
        hkv = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        q = q.transpose(1, 2).reshape(B, self.num_heads, L, self.head_dim)
        k, v = (t.transpose(1, 2).reshape(B, hkv, L, self.head_dim) for t in (k, v))
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        mask, times = attention_mask, 0
        if mask is not None and mask.dim() == 4 and mask.is_floating_point():
            mask, times = mask > torch.finfo(mask.dtype).min / 2, 1       # its ALiBi part: the slope term
        times += self.config._attn_implementation != "sdpa"               # eager: once more in the scores
        slopes = times * self.inv_norm_factor * _falcon_slopes(self, q.device)
        out, _ = attention_forward(self, q, k, v, mask, dropout=self.attention_dropout.p if self.training else 0.0,
                                   scaling=self.inv_norm_factor, is_causal=True, alibi_slopes=slopes, backend=backend)
        return self.dense(out.reshape(B, L, self.num_heads * self.head_dim)), None
    return forward


def swap_alibi_attention(model: torch.nn.Module, *, backend: str = "auto"):
    """Serves the ALiBi attention of a loaded BLOOM, MPT or Falcon (``alibi=True``) model with effattn,
    in place, weights kept: each ``BloomAttention`` / ``MptAttention`` / ``FalconAttention`` gets a
    forward that runs :func:`attention_forward`
    with the ALiBi slopes as a fused score term (``effattn.bias.ALiBi``, O(L) memory, no dense bias)
    and the model's mask read as for ``attn_implementation="effattn"``. Attention weights are not
    returned (``None``). Works with the model loaded with ``"eager"`` (BLOOM's and MPT's only
    attention) or ``"effattn"``; Falcon with ``"eager"`` or ``"sdpa"``, reproducing each: its eager
    attention adds the ALiBi bias twice (in the scores and in the mask the model builds), its sdpa
    attention once.

    Returns ``{"served": [module names], "not served": {module name: why}}``: modules computing
    attention that effattn does not serve are named with the reason.
    """
    names = ("auto",) + tuple(backend_registry.BACKENDS)
    if backend not in names:
        raise ValueError(f"swap_alibi_attention: backend must be one of {', '.join(map(repr, names))}, got "
                         f"{backend!r}")
    import types
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    served, not_served = [], {}
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind == "BloomAttention":
            if getattr(m, "pretraining_tp", 1) > 1 and getattr(m, "slow_but_exact", False):
                not_served[name] = "BLOOM with pretraining_tp > 1 and slow_but_exact (a sliced output projection)"
                continue
            m.forward = types.MethodType(_bloom_forward(backend), m)
        elif kind == "MptAttention":
            m.forward = types.MethodType(_mpt_forward(backend, mask_blocks=impl in (None, "eager")), m)
        elif kind == "FalconAttention" and getattr(getattr(model, "config", None), "alibi", False):
            if impl not in ("eager", "sdpa"):
                not_served[name] = f"Falcon with ALiBi loaded with attn_implementation={impl!r} (eager or sdpa are)"
                continue
            m.forward = types.MethodType(_falcon_forward(backend), m)
        else:
            continue
        served.append(name)
    return {"served": served, "not served": not_served}


# ------------------------------------------------------------------------ T5 relative bias (upgraded)
#
# T5-style attention (T5, mT5, UMT5, LongT5's full attention, Pix2Struct, ...) builds its relative
# position bias as a dense (1, H, Lq, Lk) tensor in `compute_bias` and passes it to the attention
# function as `position_bias` (the first layer's to every layer). `upgrade_t5_bias` makes
# `compute_bias` return the same bias as a fused score term instead: `effattn.bias.Relative` over the
# bucket of each clipped distance (`t5_bucket_index`), O(H * max_distance) memory, gradient into the
# bucket embedding. Only a model whose attention function is effattn's can read the term.

def _t5_like(module) -> bool:
    return (getattr(module, "has_relative_attention_bias", False) and hasattr(module, "compute_bias")
            and isinstance(getattr(module, "relative_attention_bias", None), torch.nn.Embedding)
            and all(hasattr(module, a) for a in ("relative_attention_num_buckets", "relative_attention_max_distance",
                                                 "is_decoder")))


def _t5_term(module) -> "_bias.Relative":
    """The module's relative bias as a `Relative` term: T5's bucket embedding read at each clipped
    distance (its bucket is constant beyond ``relative_attention_max_distance``)."""
    M, bidirectional = module.relative_attention_max_distance, not module.is_decoder
    weight = module.relative_attention_bias.weight                       # (num_buckets, H)
    idx = _bias.t5_bucket_index(module.relative_attention_num_buckets, M, bidirectional).to(weight.device)
    return _bias.Relative(weight.t()[:, idx], max_distance=M, bidirectional=bidirectional)


def _t5_compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
    # effattn's bottom-right positions put query i at key_length - query_length + i, which is T5's
    # past_seen_tokens + i whenever the keys are the cache plus the new tokens (what T5 passes)
    return _t5_term(self)


def upgrade_t5_bias(model: torch.nn.Module, select=None):
    """Makes the T5-style relative position bias of ``model`` a fused score term (O(L) memory instead
    of a dense ``(1, H, Lq, Lk)`` tensor), in place, weights kept: each attention module with a
    relative bias (``relative_attention_bias``, ``compute_bias``) returns `effattn.bias.Relative` from
    ``compute_bias``. The model must run effattn's attention function (``attn_implementation=
    "effattn"`` after :func:`register`): ``"eager"`` / ``"sdpa"`` cannot read the term. Each module is
    checked first: its bias is computed both ways at a small size and must agree exactly.
    `effattn.swap_attention` calls this for the models it finds such modules in.

    ``select``: optional ``(qualified_name, module) -> bool``; only modules it accepts are upgraded.

    Returns ``{"served": [module names], "not served": {module name: why}}``.
    """
    import types
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    served, not_served = [], {}
    for name, m in model.named_modules():
        if not _t5_like(m) or (select is not None and not select(name, m)):
            continue
        own = getattr(getattr(m, "config", None), "_attn_implementation", impl)
        if not _effattn_impl(own):
            not_served[name] = (f"its attention implementation is {own!r}, which cannot read a score term: load the "
                                "model with attn_implementation='effattn' (effattn.integrations.huggingface.register())")
            continue
        why = _t5_mismatch(m)
        if why:
            not_served[name] = why
            continue
        m.compute_bias = types.MethodType(_t5_compute_bias, m)
        served.append(name)
    return {"served": served, "not served": not_served}


def _effattn_impl(name) -> bool:
    """Whether transformers' attention function registered under ``name`` is effattn's."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    fn = AttentionInterface().get(name) if isinstance(name, str) else None
    return getattr(fn, "effattn", False)


def _t5_mismatch(module) -> Optional[str]:
    """Why the module's own ``compute_bias`` and the `Relative` term differ (None: they agree exactly),
    compared at a size past ``max_distance`` with a cache offset."""
    from ..score import dense_values
    M = module.relative_attention_max_distance
    Lq, Lk = M + 5, 2 * M + 9
    with torch.no_grad():
        dense = type(module).compute_bias(module, Lq, Lk, past_seen_tokens=Lk - Lq)
        term = _t5_term(module)
        ours = dense_values(term, 1, term.table.shape[0], Lq, Lk, term.table.device)
    if dense.shape != ours.shape or not torch.equal(dense.to(ours.dtype), ours):
        return "its compute_bias is not T5's bucketed bias (the fused term would differ)"
    return None
