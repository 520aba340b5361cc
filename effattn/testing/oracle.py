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


def visibility(Lq, Lk, *, causal=False, window=None, layout=None, key_padding_mask=None, B=1, H=1,
               positions=None, cu_seqlens=None):
    """bool (B, H, Lq, Lk) on the CPU: True where query i may see key j (see `visible_rows`).

    ``positions=(q_start, k_start)``: query i sits at key position ``i + q_start - k_start`` (the
    rows of a longer bottom-right call, cut to these keys). ``cu_seqlens`` (a tensor or a
    ``(cu_q, cu_k)`` pair, B = 1): segment n's queries see its keys only, bottom-right inside it."""
    kpm = None if key_padding_mask is None else key_padding_mask.cpu()
    if cu_seqlens is not None:
        cu_q, cu_k = cu_seqlens if isinstance(cu_seqlens, (tuple, list)) else (cu_seqlens, cu_seqlens)
        oq, ok = cu_q.tolist(), cu_k.tolist()
        vis = torch.zeros(1, 1, Lq, Lk, dtype=torch.bool)
        for a, b, c, d in zip(oq, oq[1:], ok, ok[1:]):
            vis[..., a:b, c:d] = visibility(b - a, d - c, causal=causal, window=window)
    elif positions is not None:
        off = positions[0] - positions[1]
        if off >= Lk - Lq:                 # a longer key range, cut after the call's keys
            vis = visible_rows(Lq, Lq + off, 0, Lq, causal=causal, window=window)[..., :Lk]
        else:                              # the first Lq of Lk - off queries (row i at i + off)
            vis = visible_rows(Lk - off, Lk, 0, Lq, causal=causal, window=window)
        if kpm is not None:
            vis = vis & ~kpm[:, None, None, :]
    else:
        vis = visible_rows(Lq, Lk, 0, Lq, causal=causal, window=window, layout=layout, key_padding_mask=kpm)
    return vis.expand(B, H, Lq, Lk).clone()


def naive_attention(q, k, v, *, causal=False, window=None, layout=None, key_padding_mask=None, scale=None,
                    dtype=torch.float64, dropout_keep=None, dropout_p=0.0, positions=None, cu_seqlens=None,
                    max_seqlen=None, out_dtype=None):
    """Dense attention computed in `dtype` (float64 for the oracle; fp16/bf16 for the 'naive
    low-precision' error the kernels are judged against). Returns (out, lse) in `dtype`.
    ``positions`` / ``cu_seqlens`` as `effattn.attention` takes them (see `visibility`);
    ``max_seqlen`` and ``out_dtype`` change no value and are accepted for the same keywords."""
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
                     B=B, H=H, positions=positions, cu_seqlens=cu_seqlens).to(dev)
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s.to(torch.float64), dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros_like(p))  # empty rows: 0, not NaN
    if dropout_keep is not None:
        p = p * dropout_keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, v), lse


def _by_row_chunks(q, k, v, dout, dtype, chunk, rows):
    """The chunked oracles' loop: ``rows(qc, ke, ve, i0, i1)`` -> output rows [i0, i1) in `dtype` from
    queries qc (B, H, rows, D) and keys / values expanded to H heads; gradients through autograd.
    Returns out, dq in `dtype` and dk, dv accumulated in float32 (float64 for float64)."""
    G = q.shape[1] // k.shape[1]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kl, vl = k.detach().to(dtype).requires_grad_(), v.detach().to(dtype).requires_grad_()
    outs, dqs = [], []
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for i0 in range(0, q.shape[2], chunk):
        i1 = min(i0 + chunk, q.shape[2])
        qc = q[:, :, i0:i1].detach().to(dtype).requires_grad_()
        o = rows(qc, kl.repeat_interleave(G, 1), vl.repeat_interleave(G, 1), i0, i1)
        gq, gk, gv = torch.autograd.grad(o, (qc, kl, vl), dout[:, :, i0:i1].to(dtype))
        outs.append(o.detach())
        dqs.append(gq)
        dk += gk.to(acc)
        dv += gv.to(acc)
    return torch.cat(outs, 2), torch.cat(dqs, 2), dk, dv


def chunked_attention(q, k, v, dout, *, causal=False, window=None, layout=None, key_padding_mask=None,
                      scale=None, dtype=torch.float64, chunk=512):
    """Attention and its gradients computed naively in `dtype`, `chunk` query rows at a time, on the
    inputs' device: float64 is the reference at real sizes; fp16 / bf16 / fp32 give the error of
    the naive computation in that dtype (the low-precision rule's yardstick).

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), dout (B, H, Lq, Dv), H a multiple of
    Hkv. Returns out, dq in `dtype` and dk, dv accumulated in float32 (float64 for float64). Rows
    that see no key give 0 and contribute no gradient."""
    Lq, D, Lk = q.shape[2], q.shape[3], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    def rows(qc, ke, ve, i0, i1):
        s = torch.matmul(qc, ke.transpose(-1, -2)) * scale
        vis = visible_rows(Lq, Lk, i0, i1, causal=causal, window=window, layout=layout,
                           key_padding_mask=key_padding_mask, device=q.device)
        s = s.masked_fill(~vis, -math.inf)
        p = torch.softmax(s.float() if dtype in (torch.float16, torch.bfloat16) else s, -1).to(dtype)
        p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros_like(p))      # empty rows: 0, not NaN
        return torch.matmul(p, ve)

    return _by_row_chunks(q, k, v, dout, dtype, chunk, rows)


def feature_map(name, favor=None, fn=None):
    """Linear attention's feature maps: elu + 1, relu, identity (in the input's dtype), FAVOR+ from
    a FavorFeatures module's projection W (F, D) and scale s, in float64:
    exp(sqrt(s) x W^T - s |x|^2 / 2) / sqrt(F); any other name: `fn`."""
    if name == "elu":
        return lambda x: torch.where(x > 0, x + 1, torch.exp(x))
    if name == "relu":
        return lambda x: x.clamp_min(0)
    if name == "identity":
        return lambda x: x
    if name == "favor":
        def phi(x):
            x = x.to(torch.float64)
            w = favor.projection.to(x.device, torch.float64)
            s = favor.scale
            return torch.exp(math.sqrt(s) * x @ w.T - 0.5 * s * (x * x).sum(-1, keepdim=True)) / math.sqrt(w.shape[0])
        return phi
    return fn


def chunked_linear_attention(q, k, v, dout, phi, *, causal=False, normalize=True, eps=1e-6, dtype=torch.float64,
                             chunk=512):
    """Linear attention in its quadratic form, A = phi(q) phi(k)^T masked by the visibility rule
    (causal, bottom-right), out = A v / (A.sum(-1) + eps) (or A v), computed naively in `dtype`
    `chunk` query rows at a time, with its gradients. Shapes and returns as `chunked_attention`."""
    Lq, Lk = q.shape[2], k.shape[2]

    def rows(qc, ke, ve, i0, i1):
        a = phi(qc).to(dtype) @ phi(ke).to(dtype).transpose(-1, -2)
        if causal:
            a = a * visible_rows(Lq, Lk, i0, i1, causal=True, device=q.device)
        o = a @ ve
        return o / (a.sum(-1, keepdim=True) + eps) if normalize else o

    return _by_row_chunks(q, k, v, dout, dtype, chunk, rows)


def distances(Lq, Lk, positions=None, cu_seqlens=None, device="cpu"):
    """int64 (Lq, Lk): the query-key distance d of every pair, ``(i + Lk - Lq) - j``; with
    ``positions=(q_start, k_start)`` ``(q_start + i) - (k_start + j)``; with ``cu_seqlens`` the same
    inside each segment, from the segment's own bottom-right positions (pairs across segments are
    invisible: their d is left at 0)."""
    i = torch.arange(Lq, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    if cu_seqlens is not None:
        cu_q, cu_k = cu_seqlens if isinstance(cu_seqlens, (tuple, list)) else (cu_seqlens, cu_seqlens)
        oq, ok = cu_q.tolist(), cu_k.tolist()
        d = torch.zeros(Lq, Lk, dtype=torch.long, device=device)
        for a, b, c, e in zip(oq, oq[1:], ok, ok[1:]):
            d[a:b, c:e] = distances(b - a, e - c, device=device)
        return d
    off = Lk - Lq if positions is None else positions[0] - positions[1]
    return (i + off) - j


def score_bias(B, H, Lq, Lk, bias, dtype, device="cpu", d=None):
    """The additive score terms of docs/conventions.md ("Scores") as a dense (B, H, Lq, Lk) tensor
    in `dtype`, and the adaptive-span weights m (or None): distance d = (i + Lk - Lq) - j (or the
    given `d`, see `distances`); ALiBi ``-slope * |d|``; Relative ``table[h, clamp(d, -M, M) + M]``
    (past only: ``clamp(d, 0, M)``); a dense tensor broadcast. Adaptive span is returned as its
    multiplicative mask ``m = clamp((ramp + z - d) / ramp, 0, 1)`` (``|d|`` for ``d`` when
    bidirectional), applied after the exponential (the paper's form)."""
    if d is None:
        d = distances(Lq, Lk, device=device)
    total = torch.zeros(B, H, Lq, Lk, dtype=dtype, device=device)
    span = None
    items = bias if isinstance(bias, (list, tuple)) else ([] if bias is None else [bias])
    for term in items:
        kind = type(term).__name__
        if isinstance(term, torch.Tensor):
            total = total + term.to(dtype)
        elif kind == "ALiBi":
            sl = term.slopes.to(dtype)
            sl = sl[None, :] if sl.dim() == 1 else sl
            total = total - sl[:, :, None, None] * d.abs().to(dtype)
        elif kind == "Relative":
            M = term.max_distance
            col = (torch.clamp(d, -M, M) + M) if term.bidirectional else torch.clamp(d, 0, M)
            total = total + term.table.to(dtype)[:, col][None]
        elif kind == "Span":
            dist = d.abs() if term.bidirectional else d          # a symmetric span reads |d|
            m = torch.clamp((term.ramp + term.z.to(dtype)[:, None, None] - dist.to(dtype)) / term.ramp, 0, 1)[None]
            span = m if span is None else span * m
        else:
            raise TypeError(kind)
    return total, span


def score_attention(q, k, v, *, causal=False, window=None, layout=None, key_padding_mask=None, scale=None,
                    softcap=None, sinks=None, bias=None, dtype=torch.float64, dropout_keep=None, dropout_p=0.0,
                    positions=None, cu_seqlens=None, max_seqlen=None, out_dtype=None):
    """Dense attention with the score terms, from docs/conventions.md ("Scores"), in `dtype`:
    ``s = scale q.k``; ``softcap tanh(s / softcap)``; ``+`` the bias terms; invisible pairs dropped;
    the weights ``exp(s)`` (times the adaptive-span mask) normalized together with ``exp(sinks[h])``.
    Returns (out, lse) in `dtype`; a row with no visible key gives 0 (lse -inf, or its sink logit).
    ``positions`` / ``cu_seqlens`` move the distances and the visibility (see `distances`,
    `visibility`); ``max_seqlen`` and ``out_dtype`` change no value."""
    dev = q.device
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    add, span = score_bias(B, H, Lq, Lk, bias, dtype, dev, d=distances(Lq, Lk, positions, cu_seqlens, dev))
    s = s + add
    vis = visibility(Lq, Lk, causal=causal, window=window, layout=layout, key_padding_mask=key_padding_mask,
                     B=B, H=H, positions=positions, cu_seqlens=cu_seqlens).to(dev)
    if span is not None:
        vis = vis & (span > 0)
    s = s.masked_fill(~vis, -math.inf)
    top = s.amax(-1, keepdim=True) if Lk else s.new_full((B, H, Lq, 1), -math.inf)     # no key at all
    if sinks is not None:
        sk = sinks.to(dtype)[None, :, None, None].expand(B, H, Lq, 1)
        top = torch.maximum(top, sk)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    w = torch.exp(s - top)
    if span is not None:
        w = w * torch.where(vis, span, torch.zeros_like(span))
    total = w.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sk - top)
    lse = (torch.log(total) + top).squeeze(-1)
    p = w / torch.where(total > 0, total, torch.ones_like(total))
    if dropout_keep is not None:
        p = p * dropout_keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, v), lse


def positions_reference(q, k, v, layout_mask, layout_block, q_pos, k_pos, pos_causal, scale, keep=None,
                        dropout_p=0.0):
    """The block-sparse kernels' per-row positions rule, written out in float64 (a (Lq, Lk) matrix per
    head). ``q (B, H, Lq, D)``, ``k (B, H, Lk, D)``, ``v (B, H, Lk, Dv)``; ``layout_mask`` bool ``(Hl,
    nqb, nkb)`` of blocks of ``layout_block`` (Hl 1 or H) or None; ``q_pos`` int ``(B*H, Lq)``, ``k_pos``
    int ``(B*H, Lk)`` (per query head; k and v may have fewer heads, H a multiple). Key j is visible to query i when the layout allows the pair, ``k_pos[j] >= 0``
    and, with ``pos_causal``, ``k_pos[j] <= q_pos[i]``; where ``k_pos[j] == q_pos[i]`` the score is
    `effattn.lsh.SELF_SCORE` (not scaled; a constant, so no gradient to q or k). ``keep`` (bool ``(B*H,
    Lq, Lk)``): dropout of the normalized probabilities, kept ones scaled by ``1 / (1 - dropout_p)``.
    Returns (out ``(B, H, Lq, Dv)``, lse ``(B, H, Lq)``); a row that sees nothing gives 0 and -inf.
    Differentiable in q, k, v."""
    from ..lsh import SELF_SCORE
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    if k.shape[1] != H:                                      # grouped-query heads: H / Hkv query heads per key head
        k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    qp = q_pos.view(B, H, Lq, 1).to(torch.int64)
    kp = k_pos.view(B, H, 1, Lk).to(torch.int64)
    vis = (kp >= 0).expand(B, H, Lq, Lk)
    if pos_causal:
        vis = vis & (kp <= qp)
    if layout_mask is not None:
        rows = torch.arange(Lq) // layout_block
        cols = torch.arange(Lk) // layout_block
        vis = vis & layout_mask[:, rows][:, :, cols].to(vis.device).unsqueeze(0)
    s = torch.where(kp == qp, torch.full_like(s, SELF_SCORE), s).masked_fill(~vis, -math.inf)
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    seen = den > 0
    den = torch.where(seen, den, torch.ones_like(den))
    lse = torch.where(seen, m + torch.log(den), torch.full_like(den, -math.inf)).squeeze(-1)
    p = e / den
    if keep is not None:
        p = p * keep.view(B, H, Lq, Lk).to(p.dtype) / (1.0 - dropout_p)
    return p @ v, lse
