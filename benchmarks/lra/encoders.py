"""Encoders of the LRA variants that are not an `effattn.nn.TransformerEncoder`: Reformer (LSH
attention in reversible layers) and Transformer-XL (relative attention). Each maps ``x (B, L, d)``
and ``src_key_padding_mask`` (B, L) (True = padding) to ``(B, L, d)``, as the encoder stack does."""
from __future__ import annotations

from torch import Tensor, nn

import effattn


def feed_forward(cfg) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.ff), nn.GELU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.ff, cfg.d_model), nn.Dropout(cfg.dropout))


class PreNormLSH(nn.Module):
    """LayerNorm then `effattn.nn.LSHSelfAttention` (the f of a reversible block)."""

    def __init__(self, cfg, chunk_len: int, n_hashes: int):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.attn = effattn.nn.LSHSelfAttention(cfg.d_model, cfg.heads, n_hashes=n_hashes, chunk_len=chunk_len,
                                                dropout=cfg.dropout, hash_seed=0)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, key_padding_mask=None) -> Tensor:
        return self.drop(self.attn(self.norm(x), key_padding_mask=key_padding_mask))


class ReformerEncoder(nn.Module):
    """Reversible layers ``(LSH attention, feed-forward)``; the two streams averaged, then a LayerNorm."""

    def __init__(self, cfg, chunk_len: int = 64, n_hashes: int = 2):
        super().__init__()
        self.layers = effattn.nn.ReversibleSequence(
            [(PreNormLSH(cfg, chunk_len, n_hashes), feed_forward(cfg)) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: Tensor, src_key_padding_mask=None) -> Tensor:
        y1, y2 = self.layers(x, f_kwargs={"key_padding_mask": src_key_padding_mask})
        return self.norm((y1 + y2) / 2)


class TransformerXLEncoder(nn.Module):
    """Pre-norm layers of `effattn.nn.RelPositionMultiheadAttention` (bidirectional: the classifier
    sees the whole sequence) and a feed-forward block."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = nn.ModuleList([
            # no attention dropout (dropatt): with it the relative path differentiates dense (L, L) scores
            effattn.nn.RelPositionMultiheadAttention(cfg.d_model, cfg.heads, dropout=cfg.dropout, dropatt=0.0,
                                                     pre_lnorm=True, causal=False) for _ in range(cfg.layers)])
        self.ff = nn.ModuleList([feed_forward(cfg) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: Tensor, src_key_padding_mask=None) -> Tensor:
        for attn, ff in zip(self.attn, self.ff):
            x = attn(x, key_padding_mask=src_key_padding_mask)     # residual inside (Transformer-XL's layer)
            x = x + ff(x)
        return self.norm(x)
