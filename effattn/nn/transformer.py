"""Transformer layers and stacks with torch's signatures, submodule names and math, on effattn.

`TransformerEncoderLayer`, `TransformerDecoderLayer`, `TransformerEncoder` and `TransformerDecoder`
take the arguments of their ``torch.nn`` namesakes and hold the same submodules (``self_attn``,
``multihead_attn``, ``linear1``, ``dropout``, ``linear2``, ``norm1``..``norm3``,
``dropout1``..``dropout3``, ``layers``, ``norm``), so state dicts interchange with torch's. The
variant extras (``window``, ``layout``, ``linear``, ``backend``) go to the self-attention; the
decoder's cross-attention (``multihead_attn``) is plain softmax attention on the same backend.

Differences from torch, all supersets: ``is_causal=True`` needs no ``mask`` (torch requires both);
there is no nested-tensor inference path (``enable_nested_tensor`` and ``mask_check`` are accepted
and ignored); layers take ``cache=`` and stacks ``caches=`` (one :class:`effattn.nn.KVCache`, or
:class:`effattn.nn.PagedKVCache`, per layer) for incremental decoding.
"""
from __future__ import annotations

import copy
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..paged import PagedKVCache
from .attention import MultiheadAttention
from .cache import KVCache


def _activation(activation: Union[str, Callable[[Tensor], Tensor]]) -> Callable[[Tensor], Tensor]:
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    if isinstance(activation, str) or not callable(activation):
        raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    return activation


def _is_causal_mask(mask: Optional[Tensor], is_causal: Optional[bool], size: int) -> bool:
    """torch's rule: an explicit ``is_causal`` wins; ``None`` means "causal iff ``mask`` is exactly the
    square subsequent mask" (``-inf`` / True strictly above the diagonal, 0 / False elsewhere)."""
    if is_causal is not None:
        return bool(is_causal)
    if mask is None or mask.dim() != 2 or tuple(mask.shape) != (size, size):
        return False
    above = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    return bool(torch.equal(mask == float("-inf"), above) and torch.all(mask[~above] == 0))


def _seq_len(x: Tensor, batch_first: bool) -> int:
    if x.dim() == 2:
        return x.shape[0]
    return x.shape[1] if batch_first else x.shape[0]


class TransformerEncoderLayer(nn.Module):
    r"""``torch.nn.TransformerEncoderLayer`` (self-attention + feed-forward, post- or pre-norm) whose
    self-attention is :class:`effattn.nn.MultiheadAttention` with the given variant.

    Args: as torch's (``d_model``, ``nhead``, ``dim_feedforward=2048``, ``dropout=0.1``,
    ``activation=relu``, ``layer_norm_eps=1e-5``, ``batch_first=False``, ``norm_first=False``,
    ``bias=True``, ``device``, ``dtype``), plus keyword-only ``window``, ``layout``, ``linear``,
    ``backend`` for the self-attention.

    Examples::

        >>> layer = effattn.nn.TransformerEncoderLayer(512, 8, batch_first=True, window=128)
        >>> y = layer(x, is_causal=True)            # x (B, L, 512): causal sliding window, O(L * 128)
    """

    __constants__ = ["norm_first"]

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable[[Tensor], Tensor]] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True, device=None, dtype=None,
                 *, window=None, layout=None, linear=None, backend="auto"):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first,
                                            **factory, window=window, layout=layout, linear=linear, backend=backend)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
                is_causal: bool = False, *, cache: Optional[KVCache] = None) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal, cache)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal, cache))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal, cache):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=is_causal, cache=cache)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerDecoderLayer(nn.Module):
    r"""``torch.nn.TransformerDecoderLayer`` (self-attention, cross-attention over ``memory``,
    feed-forward) on effattn. The variant applies to the self-attention ``self_attn``; the
    cross-attention ``multihead_attn`` is plain softmax attention (same ``backend``).

    Args: as torch's, plus keyword-only ``window``, ``layout``, ``linear``, ``backend``.
    ``forward(..., cache=)`` caches the self-attention's keys/values for decoding.
    """

    __constants__ = ["norm_first"]

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable[[Tensor], Tensor]] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True, device=None, dtype=None,
                 *, window=None, layout=None, linear=None, backend="auto"):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first, bias=bias,
                                            **factory, window=window, layout=layout, linear=linear, backend=backend)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first, bias=bias,
                                                 **factory, backend=backend)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False, *, cache: Optional[KVCache] = None) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal, cache)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal, cache))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal, cache):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
                           need_weights=False, cache=cache)[0]
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal):
        x = self.multihead_attn(x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                is_causal=is_causal, need_weights=False)[0]
        return self.dropout2(x)

    def _ff_block(self, x):
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))


def _check_caches(caches, layers, fn):
    if caches is None:
        return
    want = (f"a list of one KVCache per layer ({len(layers)} layers), e.g. "
            "caches=[effattn.nn.KVCache() for _ in model.layers] (or one effattn.nn.PagedKVCache per layer)")
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"{fn}: caches must be {want}; got a {type(caches).__name__}")
    bad = [type(c).__name__ for c in caches if not isinstance(c, (KVCache, PagedKVCache))]
    if bad:
        raise TypeError(f"{fn}: caches must be {want}; it holds a {bad[0]}")
    if len(caches) != len(layers):
        raise ValueError(f"{fn}: caches must be {want}; got a list of {len(caches)}")


class TransformerEncoder(nn.Module):
    r"""``torch.nn.TransformerEncoder``: ``num_layers`` deep copies of ``encoder_layer`` and an
    optional final ``norm``. ``is_causal=None`` detects a causal ``mask`` as torch does, which then
    runs on the fused causal kernel.

    ``caches``: a list of one :class:`effattn.nn.KVCache` per layer, for token-by-token decoding of a
    decoder-only stack (call with ``is_causal=True``).
    """

    __constants__ = ["norm"]

    def __init__(self, encoder_layer: nn.Module, num_layers: int, norm: Optional[nn.Module] = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True):
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor   # accepted for torch's signature; no nested path here
        self.use_nested_tensor = False
        self.mask_check = mask_check

    def forward(self, src: Tensor, mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
                is_causal: Optional[bool] = None, *, caches: Optional[List[KVCache]] = None) -> Tensor:
        _check_caches(caches, self.layers, "TransformerEncoder")
        is_causal = _is_causal_mask(mask, is_causal, _seq_len(src, self.layers[0].self_attn.batch_first))
        out = src
        for i, layer in enumerate(self.layers):
            extra = {"cache": caches[i]} if caches is not None else {}
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal, **extra)
        return self.norm(out) if self.norm is not None else out


class TransformerDecoder(nn.Module):
    r"""``torch.nn.TransformerDecoder``: ``num_layers`` deep copies of ``decoder_layer`` and an
    optional final ``norm``; ``tgt_is_causal=None`` detects a causal ``tgt_mask`` as torch does.
    ``caches``: one :class:`effattn.nn.KVCache` per layer (self-attention) for decoding.
    """

    __constants__ = ["norm"]

    def __init__(self, decoder_layer: nn.Module, num_layers: int, norm: Optional[nn.Module] = None):
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, tgt_is_causal: Optional[bool] = None,
                memory_is_causal: bool = False, *, caches: Optional[List[KVCache]] = None) -> Tensor:
        _check_caches(caches, self.layers, "TransformerDecoder")
        tgt_is_causal = _is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(tgt, self.layers[0].self_attn.batch_first))
        out = tgt
        for i, layer in enumerate(self.layers):
            extra = {"cache": caches[i]} if caches is not None else {}
            out = layer(out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                        tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                        tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal, **extra)
        return self.norm(out) if self.norm is not None else out
