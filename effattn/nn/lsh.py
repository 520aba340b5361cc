"""`effattn.nn.LSHSelfAttention`: Reformer's self-attention layer on :func:`effattn.lsh_attention`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .._call import compute_dtype
from ..lsh import default_n_buckets, draw_rotations, lsh_attention


class LSHSelfAttention(nn.Module):
    r"""Multi-head LSH self-attention with shared queries and keys (Kitaev et al. 2020).

    Args:
        embed_dim: model width E; ``num_heads`` must divide it.
        num_heads: heads H.
        n_hashes, chunk_len, chunks_before, chunks_after, n_buckets, causal: see
            :func:`effattn.lsh_attention`. ``n_buckets=None`` picks one per call from the padded length.
        dropout: dropout on the attention probabilities (training mode only).
        bias: biases in the projections.
        batch_first: inputs ``(N, L, E)`` when True (default), ``(L, N, E)`` otherwise.
        backend: of :func:`effattn.lsh_attention` (``"auto"``, ``"torch"``, ``"triton"``).
        hash_seed: in eval mode, hash every call with rotations from a generator seeded with it, so
            evaluation is deterministic; None (default): fresh rotations from torch's default
            generator in every call, as in training (the Reformer's stochastic hashing).

    Parameters: ``qk_proj`` and ``v_proj`` (E -> E), ``out_proj`` (E -> E).

    ``forward(x, key_padding_mask=None, *, buckets=None, return_buckets=False)``: ``x (N, L, E)``,
    ``key_padding_mask`` bool ``(N, L)`` with True = padding. A length that ``chunk_len`` does not
    divide is padded internally (and masked); ``buckets`` / the returned buckets refer to the padded
    length ``ceil(L / chunk_len) * chunk_len``. Inside `effattn.nn.ReversibleSequence` the module
    records its buckets in the forward and reuses them in the backward's recomputation.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, n_hashes: int = 4, chunk_len: int = 64,
                 chunks_before: int = 1, chunks_after: int = 0, n_buckets: Optional[int] = None,
                 causal: bool = False, dropout: float = 0.0, bias: bool = True, batch_first: bool = True,
                 hash_seed: Optional[int] = None, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"LSHSelfAttention: num_heads={num_heads} must divide embed_dim={embed_dim}")
        if n_buckets is not None and (isinstance(n_buckets, bool) or not isinstance(n_buckets, int)
                                      or n_buckets < 2 or n_buckets % 2):
            raise ValueError(f"LSHSelfAttention: n_buckets must be an even int >= 2, got {n_buckets!r}")
        if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"LSHSelfAttention: chunk_len must be an int >= 1, got {chunk_len!r}")
        kw = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.n_hashes, self.chunk_len, self.n_buckets = n_hashes, chunk_len, n_buckets
        self.chunks_before, self.chunks_after, self.causal = chunks_before, chunks_after, causal
        self.dropout, self.batch_first, self.hash_seed, self.backend = dropout, batch_first, hash_seed, backend
        self.qk_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.reversible_record: Optional[list] = None    # see effattn.reversible
        self.reversible_replay: Optional[list] = None

    def extra_repr(self) -> str:
        return (f"{self.embed_dim}, num_heads={self.num_heads}, n_hashes={self.n_hashes}, chunk_len={self.chunk_len}, "
                f"chunks_before={self.chunks_before}, chunks_after={self.chunks_after}, causal={self.causal}")

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None, *, buckets: Optional[Tensor] = None,
                return_buckets: bool = False):
        if not self.batch_first:
            x = x.transpose(0, 1)
        N, L, E = x.shape
        if E != self.embed_dim:
            raise ValueError(f"LSHSelfAttention: x has {E} features, expected embed_dim={self.embed_dim}")
        Lp = -(-L // self.chunk_len) * self.chunk_len
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (N, L):
            raise ValueError(f"LSHSelfAttention: key_padding_mask must have shape (N, L)=({N}, {L}), got "
                             f"{tuple(key_padding_mask.shape)}")
        if Lp != L:
            x = nn.functional.pad(x, (0, 0, 0, Lp - L))
            pad = torch.zeros(N, Lp, dtype=torch.bool, device=x.device)
            pad[:, L:] = True
            if key_padding_mask is not None:
                pad[:, :L] = key_padding_mask
            key_padding_mask = pad
        H, Dh = self.num_heads, E // self.num_heads
        qk = self.qk_proj(x).view(N, Lp, H, Dh).transpose(1, 2)
        v = self.v_proj(x).view(N, Lp, H, Dh).transpose(1, 2)
        nb = self.n_buckets or default_n_buckets(Lp, self.chunk_len)
        if buckets is None and self.reversible_replay:
            buckets = self.reversible_replay.pop(0).to(torch.int64)
            # the forward drew its rotations before its dropout: draw them again so dropout replays
            draw_rotations(H, Dh, self.n_hashes, nb, None, x.device, compute_dtype(x.dtype))
        generator = None
        if buckets is None and not self.training and self.hash_seed is not None:
            generator = torch.Generator(device=x.device).manual_seed(self.hash_seed)
        out, used = lsh_attention(qk, v, n_hashes=self.n_hashes, chunk_len=self.chunk_len, generator=generator,
                                  chunks_before=self.chunks_before, chunks_after=self.chunks_after, n_buckets=nb,
                                  causal=self.causal, key_padding_mask=key_padding_mask, buckets=buckets,
                                  return_buckets=True, dropout_p=self.dropout if self.training else 0.0,
                                  backend=self.backend)
        if self.reversible_record is not None:
            # bucket ids < n_hashes * n_buckets: stored in the smallest integer type that holds them
            small = torch.int16 if self.n_hashes * nb < 2 ** 15 else torch.int32
            self.reversible_record.append(used.to(small))
        out = self.out_proj(out.transpose(1, 2).reshape(N, Lp, E)[:, :L])
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, used) if return_buckets else out
