"""`effattn.nn.RelPositionMultiheadAttention`: Transformer-XL's relative multi-head attention layer."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..relative import UNFUSED_NOTE, relative_attention


def sinusoid(positions: Tensor, dim: int) -> Tensor:
    """Transformer-XL's position embedding of ``positions (n,)``: ``[sin(p w), cos(p w)]`` with
    ``w_k = 10000^(-2k / dim)``: ``(n, dim)`` (``dim`` even)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=positions.device, dtype=positions.dtype) / dim))
    x = positions[:, None] * inv_freq[None, :]
    return torch.cat([x.sin(), x.cos()], dim=-1)


class RelPositionMultiheadAttention(nn.Module):
    r"""Transformer-XL's attention layer ("RelPartialLearnableMultiHeadAttn", Dai et al. 2019, Sec. 3.3),
    residual and layer norm included, with its parameter names, so its state dicts load as they are.

    ``score_ij = scale * ((q_i + u) . k_j + (q_i + v) . R_{pos(i) - j})``, ``R_m = W_r sinusoid(m)``,
    over the keys ``[memory, x]`` (causal, bottom-right: the queries are the last ``L`` positions).

    Args:
        embed_dim: model width ``d_model``.
        num_heads: heads H.
        head_dim: per-head width (default ``embed_dim // num_heads``).
        dropout: dropout on the layer output (TXL's ``drop``); dropatt: on the attention probabilities.
        pre_lnorm: layer norm on the input (pre-norm) instead of after the residual.
        causal: True (Transformer-XL's decoder). False: every key is visible and ``R`` also covers the
            negative distances of future keys (``sinusoid`` of ``-(L-1) .. Lk-1``, as XLNet).
        batch_first: ``(N, L, E)`` inputs (default); False: Transformer-XL's ``(L, N, E)``.

    Parameters (Transformer-XL's names): ``qkv_net`` (E -> 3 H Dh, no bias), ``r_net`` (E -> H Dh,
    no bias), ``o_net`` (H Dh -> E, no bias), ``layer_norm``, ``r_w_bias`` (u, ``(H, Dh)``) and
    ``r_r_bias`` (v). A checkpoint whose biases are shared by the layers (``untie_r=False``) has them
    once at model level: copy them into each layer's state dict.

    ``forward(x, memory=None, key_padding_mask=None)``: ``memory (N, M, E)`` is the previous segment
    (attended to, typically detached); ``key_padding_mask`` bool ``(N, M + L)``, True = padding.

    Path: :func:`effattn.relative_attention` (Triton kernels on CUDA, a torch path elsewhere; with
    ``dropatt`` the dense scores); `explain` says so.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: Optional[int] = None, dropout: float = 0.0,
                 dropatt: float = 0.0, pre_lnorm: bool = False, causal: bool = True, layer_norm_eps: float = 1e-5,
                 batch_first: bool = True, device=None, dtype=None):
        super().__init__()
        if embed_dim % 2:
            raise ValueError(f"RelPositionMultiheadAttention: embed_dim must be even (sinusoid), got {embed_dim}")
        head_dim = head_dim or embed_dim // num_heads
        if head_dim < 1:
            raise ValueError(f"RelPositionMultiheadAttention: head_dim must be >= 1 (num_heads={num_heads} > "
                             f"embed_dim={embed_dim}?)")
        kw = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.pre_lnorm, self.causal, self.batch_first, self.dropatt = pre_lnorm, causal, batch_first, dropatt
        self.qkv_net = nn.Linear(embed_dim, 3 * num_heads * head_dim, bias=False, **kw)
        self.r_net = nn.Linear(embed_dim, num_heads * head_dim, bias=False, **kw)
        self.o_net = nn.Linear(num_heads * head_dim, embed_dim, bias=False, **kw)
        self.layer_norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **kw)
        self.r_w_bias = nn.Parameter(torch.zeros(num_heads, head_dim, **kw))
        self.r_r_bias = nn.Parameter(torch.zeros(num_heads, head_dim, **kw))
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.r_w_bias, std=0.02)
        nn.init.normal_(self.r_r_bias, std=0.02)

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, pre_lnorm={self.pre_lnorm}"

    def relative_keys(self, distances: Tensor) -> Tensor:
        """``r (H, n, Dh)``: ``W_r sinusoid(m)`` for the ``n`` given distances."""
        pos = sinusoid(distances, self.embed_dim)
        return self.r_net(pos).view(len(distances), self.num_heads, self.head_dim).transpose(0, 1)

    def explain(self) -> str:
        return "RelPositionMultiheadAttention: " + UNFUSED_NOTE

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)
            memory = memory.transpose(0, 1) if memory is not None else None
        N, L, E = x.shape
        if E != self.embed_dim:
            raise ValueError(f"RelPositionMultiheadAttention: x has {E} features, expected embed_dim={self.embed_dim}")
        if memory is not None and (memory.dim() != 3 or memory.shape[0] != N or memory.shape[2] != E):
            raise ValueError(f"RelPositionMultiheadAttention: memory must be (N={N}, M, E={E}), got "
                             f"{tuple(memory.shape)}")
        cat = x if memory is None else torch.cat([memory, x], dim=1)
        Lk = cat.shape[1]
        H, Dh = self.num_heads, self.head_dim
        heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)
        q, k, v = heads.view(N, Lk, 3, H, Dh).permute(2, 0, 3, 1, 4)           # each (N, H, Lk, Dh)
        q = q[:, :, Lk - L:]
        # distances 0 .. Lk-1 (causal), or -(Lk-1) .. Lk-1 read with max_distance = Lk - 1
        M = None if self.causal else Lk - 1
        lo = 0 if self.causal else -(Lk - 1)
        r = self.relative_keys(torch.arange(lo, Lk, device=x.device, dtype=x.dtype))
        out = relative_attention(q + self.r_w_bias[:, None], k, v, r, query=q + self.r_r_bias[:, None],
                                 max_distance=M, causal=self.causal, key_padding_mask=key_padding_mask, scale=1 / math.sqrt(Dh),
                                 dropout_p=self.dropatt if self.training else 0.0)
        out = self.drop(self.o_net(out.transpose(1, 2).reshape(N, L, H * Dh)))
        out = x + out if self.pre_lnorm else self.layer_norm(x + out)
        return out if self.batch_first else out.transpose(0, 1)
