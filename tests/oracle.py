"""An independent float64 dense attention, written from SPEC.md alone: the test oracle.

It materializes the full (Lq, Lk) score matrix and an explicit token-level visibility mask, so it is
only for small shapes; it shares no code with any backend.
"""
import math

import torch


def visibility(Lq, Lk, *, causal=False, window=None, layout=None, key_padding_mask=None, B=1, H=1):
    """bool (B, H, Lq, Lk): True where query i may see key j (SPEC.md: logical AND of constraints)."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    pos = i + (Lk - Lq)                               # bottom-right alignment
    vis = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        vis &= j <= pos
    if window is not None:
        left, right = (window, 0 if causal else window) if isinstance(window, int) else window
        vis &= (j >= pos - left) & (j <= pos + right)
    vis = vis[None, None].expand(B, H, Lq, Lk).clone()
    if layout is not None:
        bs = layout.block_size
        m = layout.mask.cpu()
        blk = m[:, (i // bs).squeeze(1)][:, :, (j // bs).squeeze(0)]   # (Hl, Lq, Lk)
        vis &= blk[None]
    if key_padding_mask is not None:
        vis &= ~key_padding_mask.cpu()[:, None, None, :]
    return vis


def naive_attention(q, k, v, *, causal=False, window=None, layout=None, key_padding_mask=None, scale=None,
                    dtype=torch.float64, dropout_keep=None, dropout_p=0.0):
    """Dense attention computed in `dtype` (float64 for the oracle; fp16/bf16 for the 'naive
    low-precision' error the kernels are judged against). Returns (out, lse) in `dtype`."""
    dev = q.device
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    vis = visibility(Lq, Lk, causal=causal, window=window, layout=layout, key_padding_mask=key_padding_mask,
                     B=B, H=H).to(dev)
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s.to(torch.float64), dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros_like(p))  # empty rows: 0, not NaN
    if dropout_keep is not None:
        p = p * dropout_keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, v), lse
