"""The public softmax-attention function and `explain`: validate, pick a backend, run."""
from __future__ import annotations

from typing import Dict, List

from ._call import ATTENTION_KEYWORDS, LINEAR_KEYWORDS, check_keywords, make_attn_call, make_linear_call
from .backends import base


def attention(q, k, v, *, causal=False, window=None, layout=None, key_padding_mask=None, scale=None,
              dropout_p=0.0, return_lse=False, cu_seqlens=None, max_seqlen=None, positions=None, out_dtype=None,
              backend="auto", **unknown):
    r"""Softmax attention ``softmax(q k^T * scale + mask) v`` with fused, O(L)-memory backends.

    Args:
        q: ``(B, H, Lq, D)`` queries.
        k: ``(B, Hkv, Lk, D)`` keys; ``H % Hkv == 0`` (grouped-query / multi-query attention, K and V
            are never expanded in memory).
        v: ``(B, Hkv, Lk, Dv)`` values. ``Dv`` may differ from ``D``; head dims 1..256.
            q, k, v share one dtype (float16, bfloat16, float32; float64 on the torch backend) and may
            be non-contiguous views, e.g. ``x.transpose(1, 2)`` of a ``(B, L, H, D)`` tensor.
        causal: query i sees keys ``j <= i + (Lk - Lq)`` (bottom-right alignment).
        window: ``(left, right)`` inclusive: ``pos(i) - left <= j <= pos(i) + right`` with
            ``pos(i) = i + Lk - Lq``. An int ``w`` means ``(w, 0)`` when causal, ``(w, w)`` otherwise.
        layout: an :class:`effattn.layouts.BlockLayout`; key j is visible to query i when
            ``layout.mask[h, i // bs, j // bs]``.
        key_padding_mask: bool ``(B, Lk)``, **True marks padding to ignore** (nn.MultiheadAttention's
            convention).
        scale: score scale, default ``1/sqrt(D)``.
        dropout_p: dropout on the attention probabilities (applied whenever > 0, as in SDPA; pass 0 in
            eval). Reproducible under ``torch.manual_seed``.
        return_lse: also return the log-sum-exp of the scaled scores, ``(B, H, Lq)`` float32 (float64
            for float64 inputs); ``-inf`` for a row that sees no key.
        cu_seqlens: packed variable-length sequences (see :mod:`effattn.packed`): int32 ``(N + 1,)``
            offsets (self-attention) or a ``(cu_seqlens_q, cu_seqlens_k)`` pair, with q, k, v packed as
            ``(1, H, T, D)``. Segment n is queries ``cu_q[n]:cu_q[n+1]`` against keys
            ``cu_k[n]:cu_k[n+1]``, bottom-right aligned inside it; nothing crosses a segment.
        max_seqlen: the longest segment (an int or a ``(max_q, max_k)`` pair), checked when given.
        positions: ``(q_start, k_start)``, the absolute positions of query 0 and key 0 (a chunk of a
            longer sequence, context parallelism): query i sits at ``q_start + i``, key j at
            ``k_start + j``, and causal / window compare those positions.
        out_dtype: ``torch.float32`` for an fp32 output (partial results merged with
            :func:`effattn.merge_attention` without a round trip through the input dtype).
        backend: ``"auto"`` (fastest that can serve; see :func:`explain`), ``"torch"``, ``"triton"``
            or ``"cuda"``.

    Every constraint given must allow a pair (logical AND). Alignment for ``Lq=2, Lk=4``::

        causal=True               window=(1, 0)
        q0 (pos 2):  1 1 1 .      . 1 1 .
        q1 (pos 3):  1 1 1 1      . . 1 1

    A row that sees no key outputs exactly 0 (its lse is -inf and its gradients are 0).

    Returns:
        ``out (B, H, Lq, Dv)`` in the input dtype, or ``(out, lse)`` with ``return_lse=True``.

    Examples::

        >>> q, k, v = (torch.randn(2, 8, 1024, 64) for _ in range(3))
        >>> out = effattn.attention(q, k, v, causal=True, window=256)
    """
    if unknown:
        check_keywords("attention", unknown, ATTENTION_KEYWORDS)
    call = make_attn_call(q, k, v, causal=causal, window=window, layout=layout,
                          key_padding_mask=key_padding_mask, scale=scale, dropout_p=dropout_p,
                          return_lse=return_lse, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, positions=positions,
                          out_dtype=out_dtype)
    out, lse = base.select("attention", call, backend).run(call)
    return (out, lse) if return_lse else out


class Explanation:
    """What `explain` found: for each backend, whether it can serve the call and why not (`reasons`),
    where it runs only when named (`notes`), and which of its paths it would take (`paths`, e.g. the
    torch backend's CPU paths, with why a faster one is not taken)."""

    def __init__(self, op: str, chosen, reasons: Dict[str, List[str]], notes: Dict[str, str],
                 paths: Dict[str, str] = None, ranks: Dict[str, int] = None):
        self.op, self.chosen, self.reasons, self.notes = op, chosen, reasons, notes
        self.paths = paths or {}
        self.ranks = ranks or {}     # each backend's priority for this call (lower is tried first)

    def can_serve(self, name: str) -> bool:
        return name in self.reasons and not self.reasons[name]

    def __str__(self):
        lines = [f"effattn.{self.op}: backend='auto' picks {self.chosen or 'nothing (no backend can serve)'}"]
        for name, why in self.reasons.items():
            state = "can serve" if not why else "cannot serve: " + "; ".join(why)
            note = "".join(f" ({d[name]})" for d in (self.notes, self.paths) if name in d)
            rank = f"[{self.ranks[name]:>3}] " if name in self.ranks else "      "
            lines.append(f"  {rank}{name:7s} {state}{note}")
        return "\n".join(lines)

    __repr__ = __str__


def explain(q, k, v, op: str = "attention", **kwargs) -> Explanation:
    """Reports, for each backend, whether it can serve ``op(q, k, v, **kwargs)`` and why not, and
    which one ``backend="auto"`` takes. ``op`` is ``"attention"`` or ``"linear_attention"``.

    Examples::

        >>> print(effattn.explain(q, k, v, causal=True))
        effattn.attention: backend='auto' picks torch
          [ 10] triton  cannot serve: runs on cuda tensors, got cpu
          [100] torch   can serve
    """
    kwargs.pop("backend", None)
    if op in ("attention", "linear_attention"):
        check_keywords(f"explain(op={op!r})", kwargs, ATTENTION_KEYWORDS if op == "attention" else LINEAR_KEYWORDS)
    if op == "attention":
        call = make_attn_call(q, k, v, **kwargs)
    elif op == "linear_attention":
        packed = {n: kwargs.pop(n) for n in ("cu_seqlens", "max_seqlen") if n in kwargs}
        if packed.get("cu_seqlens") is not None:    # each segment is one call of the same backend
            from .packed import check_cu_seqlens
            check_cu_seqlens(packed["cu_seqlens"], packed.get("max_seqlen"), q.shape[2], k.shape[2], q.device,
                             "linear_attention")
        call = make_linear_call(q, k, v, **kwargs)
    else:
        raise ValueError(f"explain: op must be 'attention' or 'linear_attention', got {op!r}")
    reasons, notes, paths, ranks, chosen = {}, {}, {}, {}, None
    for b in base.backends_for(op, call):
        ranks[b.name] = b.rank(call)
        why = b.reasons(call)
        reasons[b.name] = why
        remarks = list(b.notes(call)) if not why else []
        if not why and call.q.device.type in b.explicit_only_devices:
            remarks.insert(0, f"on {call.q.device.type} only when asked for by name")
        elif not why and chosen is None:
            chosen = b.name
        if remarks:
            notes[b.name] = "; ".join(remarks)
        if not why and b.describe(call):
            paths[b.name] = b.describe(call)
    for name in base.BACKENDS:
        if name not in reasons:
            reasons[name] = [base.missing_reason(op, name)]
    return Explanation(op, chosen, reasons, notes, paths, ranks)
