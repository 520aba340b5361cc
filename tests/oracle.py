"""An independent float64 attention, written from the conventions alone (docs/conventions.md): the
test oracle.

It builds an explicit token-level visibility mask and materializes the score matrix, so it shares no
code with any backend or with `effattn.visibility` (whose rule it checks). `naive_attention` holds
the whole (Lq, Lk) matrix: small shapes only. `chunked_attention` computes the same thing, with its
gradients, a block of query rows at a time: the reference of the GPU tests at real sizes.
"""
import math

import torch


def visible_rows(Lq, Lk, i0, i1, *, causal=False, window=None, layout=None, key_padding_mask=None, device="cpu"):
    """bool (B or 1, Hl or 1, i1 - i0, Lk): True where query i in [i0, i1) may see key j.

    Every given constraint must allow the pair (logical AND). Query i sits at position
    pos = i + Lk - Lq (bottom-right alignment); causal: j <= pos; window (left, right):
    pos - left <= j <= pos + right, an int w meaning (w, 0) when causal and (w, w) otherwise; layout:
    its block (i // bs, j // bs) is set; key padding (B, Lk): True = ignore."""
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    pos = i + (Lk - Lq)
    vis = torch.ones(i1 - i0, Lk, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= pos
    if window is not None:
        left, right = (window, 0 if causal else window) if isinstance(window, int) else window
        vis &= (j >= pos - left) & (j <= pos + right)
    vis = vis[None, None]
    if layout is not None:
        bs = layout.block_size
        m = layout.mask.to(device)
        vis = vis & m[:, i[:, 0] // bs][:, :, j[0] // bs][None]                 # (1, Hl, rows, Lk)
    if key_padding_mask is not None:
        vis = vis & ~key_padding_mask.to(device)[:, None, None, :]
    return vis


def visibility(Lq, Lk, *, causal=False, window=None, layout=None, key_padding_mask=None, B=1, H=1):
    """bool (B, H, Lq, Lk) on the CPU: True where query i may see key j (see `visible_rows`)."""
    vis = visible_rows(Lq, Lk, 0, Lq, causal=causal, window=window, layout=layout,
                       key_padding_mask=None if key_padding_mask is None else key_padding_mask.cpu())
    return vis.expand(B, H, Lq, Lk).clone()


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


def chunked_attention(q, k, v, dout, *, causal=False, window=None, layout=None, key_padding_mask=None,
                      scale=None, dtype=torch.float64, chunk=512):
    """Attention and its gradients computed naively in `dtype`, `chunk` query rows at a time, on the
    inputs' device: float64 is the reference at real sizes; fp16 / bf16 / fp32 give the error of
    the naive computation in that dtype (the low-precision rule's yardstick).

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), dout (B, H, Lq, Dv), H a multiple of
    Hkv. Returns out, dq in `dtype` and dk, dv accumulated in float32 (float64 for float64). Rows
    that see no key give 0 and contribute no gradient."""
    B, H, Lq, D = q.shape
    G = H // k.shape[1]
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kl, vl = k.detach().to(dtype).requires_grad_(), v.detach().to(dtype).requires_grad_()
    outs, dqs = [], []
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for i0 in range(0, Lq, chunk):
        i1 = min(i0 + chunk, Lq)
        qc = q[:, :, i0:i1].detach().to(dtype).requires_grad_()
        ke, ve = kl.repeat_interleave(G, 1), vl.repeat_interleave(G, 1)
        s = torch.matmul(qc, ke.transpose(-1, -2)) * scale
        vis = visible_rows(Lq, Lk, i0, i1, causal=causal, window=window, layout=layout,
                           key_padding_mask=key_padding_mask, device=q.device)
        s = s.masked_fill(~vis, -math.inf)
        p = torch.softmax(s.float() if dtype in (torch.float16, torch.bfloat16) else s, -1).to(dtype)
        p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros_like(p))      # empty rows: 0, not NaN
        o = torch.matmul(p, ve)
        gq, gk, gv = torch.autograd.grad(o, (qc, kl, vl), dout[:, :, i0:i1].to(dtype))
        outs.append(o.detach())
        dqs.append(gq)
        dk += gk.to(acc)
        dv += gv.to(acc)
    return torch.cat(outs, 2), torch.cat(dqs, 2), dk, dv
