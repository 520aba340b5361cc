"""The LRA classifier: token embedding + positions, an `effattn.nn.TransformerEncoder` (pre-norm)
with the chosen attention variant, CLS or mean pooling over the non-padding tokens, and an MLP head.
Retrieval encodes both documents with the same encoder (two towers, shared weights) and classifies
``[u, v, u * v, u - v]``.

Positions are learned (``pos="learned"``) or fixed sinusoids (``pos="sine"``, LRA's Pathfinder
Transformer). The per-task sizes are in `recipes`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor, nn

import effattn

from .tasks import CLS, PAD
from .variants import layer_kwargs


@dataclass
class ModelConfig:
    d_model: int = 64
    heads: int = 2
    layers: int = 2
    ff: int = 128
    dropout: float = 0.1
    pooling: str = "mean"          # "mean" or "cls"
    pos: str = "learned"           # "learned" or "sine"

    def as_dict(self):
        return asdict(self)


def sinusoids(n: int, d: int) -> Tensor:
    """``(n, d)`` fixed sine / cosine positions (Vaswani et al. 2017)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    out = torch.zeros(n, d, dtype=torch.float64)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    return out.float()


class Encoder(nn.Module):
    """tokens ``(B, L)`` int (0 = padding) -> pooled ``(B, d_model)``."""

    def __init__(self, vocab_size: int, max_length: int, cfg: ModelConfig, variant: str, block_size: int = 64,
                 window: int = 128, backend: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        if cfg.pos == "sine":
            self.register_buffer("pos", sinusoids(max_length + 1, cfg.d_model), persistent=False)
        elif cfg.pos == "learned":
            self.pos = nn.Parameter(torch.randn(max_length + 1, cfg.d_model) * 0.02)
        else:
            raise ValueError(f"ModelConfig.pos must be 'learned' or 'sine', got {cfg.pos!r}")
        kw = layer_kwargs(variant, block_size, window, max_length + 1, cfg.d_model // cfg.heads)
        if "encoder" in kw:                  # a variant with its own encoder (Reformer, Transformer-XL)
            self.encoder = kw["encoder"](cfg)
            return
        layer = effattn.nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, cfg.ff, cfg.dropout, activation="gelu",
                                                   batch_first=True, norm_first=True, backend=backend, **kw)
        self.encoder = effattn.nn.TransformerEncoder(layer, cfg.layers, norm=nn.LayerNorm(cfg.d_model))

    def forward(self, tokens: Tensor) -> Tensor:
        if self.cfg.pooling == "cls":
            tokens = torch.cat([torch.full_like(tokens[:, :1], CLS), tokens], dim=1)
        if tokens.shape[1] > self.pos.shape[0]:
            raise ValueError(f"Encoder: sequence of {tokens.shape[1]} tokens, the model was built for "
                             f"{self.pos.shape[0]} (max_length + CLS)")
        pad = tokens == PAD
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(x, src_key_padding_mask=pad)
        if self.cfg.pooling == "cls":
            return h[:, 0]
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return (h * keep).sum(1) / keep.sum(1).clamp(min=1)


class Classifier(nn.Module):
    """``forward(x, x2=None) -> logits (B, num_classes)``; ``x2`` (B, L2) for two-tower Retrieval."""

    def __init__(self, vocab_size: int, max_length: int, num_classes: int, cfg: ModelConfig, variant: str,
                 pair: bool = False, **encoder_kw):
        super().__init__()
        self.encoder = Encoder(vocab_size, max_length, cfg, variant, **encoder_kw)
        self.pair = pair
        d = cfg.d_model * (4 if pair else 1)
        self.head = nn.Sequential(nn.Linear(d, cfg.ff), nn.GELU(), nn.Linear(cfg.ff, num_classes))

    def forward(self, x: Tensor, x2: Optional[Tensor] = None) -> Tensor:
        u = self.encoder(x)
        if self.pair:
            if x2 is None:
                raise ValueError("Classifier: a two-tower model needs x2")
            v = self.encoder(x2)
            u = torch.cat([u, v, u * v, u - v], dim=-1)
        return self.head(u)
