"""The public softmax-attention function and `explain`: validate, pick a backend, run."""
from __future__ import annotations

from . import plans
from ._call import ATTENTION_KEYWORDS, LINEAR_KEYWORDS, check_keywords, make_attn_call, make_linear_call
from .backends import base
from .bias import RelativeKeys
from .explanation import Explanation, explain_call
from .packed import check_linear_packed
from .paged import GATHER_NOTE, contiguous_keys, make_paged_call, paged_attention, paged_row
from .paged import OP as PAGED_OP
from .relative import FN as RELATIVE_OP
from .relative import make_relative_call, relative_attention


def attention(q, k, v, *, causal=False, window=None, layout=None, key_padding_mask=None, scale=None,
              dropout_p=0.0, return_lse=False, softcap=None, sinks=None, bias=None, cu_seqlens=None,
              max_seqlen=None, positions=None, out_dtype=None, backend="auto", block_table=None, seqlens=None,
              **unknown):
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
        return_lse: also return the log-sum-exp of the scores (with every score term), ``(B, H, Lq)`` float32 (float64
            for float64 inputs); ``-inf`` for a row that sees no key.
        softcap: float > 0: scores become ``softcap * tanh(s / softcap)`` after the scale (Gemma 2).
        sinks: ``(H,)`` float tensor, one extra logit per query head that takes probability mass but
            has no value (gpt-oss); a row that sees no key then has ``lse = sinks[h]``. Differentiable.
        bias: additive score terms: an :mod:`effattn.bias` term (``ALiBi``, ``Relative``, ``Span``), a
            float tensor broadcastable to ``(B, H, Lq, Lk)``, or a list of them (summed), evaluated at
            the distance ``d = pos(i) - j`` (segment-local with ``cu_seqlens``, absolute with
            ``positions``; a dense tensor does not combine with ``cu_seqlens``). Any of their tensors
            that requires grad gets a deterministic gradient. Order of operations:
            docs/conventions.md, "Scores".
        cu_seqlens: packed variable-length sequences (see :mod:`effattn.packed`): int32 ``(N + 1,)``
            offsets (self-attention) or a ``(cu_seqlens_q, cu_seqlens_k)`` pair, with q, k, v packed as
            ``(1, H, T, D)``. Segment n is queries ``cu_q[n]:cu_q[n+1]`` against keys
            ``cu_k[n]:cu_k[n+1]``, bottom-right aligned inside it; nothing crosses a segment.
        max_seqlen: the longest segment (an int or a ``(max_q, max_k)`` pair), checked when given.
        positions: ``(q_start, k_start)``, the absolute positions of query 0 and key 0 (a chunk of a
            longer sequence, context parallelism): query i sits at ``q_start + i``, key j at
            ``k_start + j``; causal / window, the score terms' distances and dropout's draws use
            those positions.
        out_dtype: ``torch.float32`` for an fp32 output (partial results merged with
            :func:`effattn.merge_attention` without a round trip through the input dtype).
        backend: ``"auto"`` (fastest that can serve; see :func:`explain`), ``"torch"``, ``"triton"``
            or ``"cuda"``.
        block_table, seqlens: a paged KV cache (forward only): ``k``/``v`` are then page pools
            ``(num_pages, page_size, Hkv, D)``, ``block_table (B, max_pages)`` maps sequence b's key
            t to page ``block_table[b, t // page_size]`` and ``seqlens (B,)`` counts its keys; queries
            are aligned bottom-right per sequence. See :mod:`effattn.paged`.

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
    key = None
    if bias is None and softcap is None and sinks is None and cu_seqlens is None and max_seqlen is None and \
            positions is None and out_dtype is None and block_table is None and seqlens is None and not unknown:
        # a call a dispatch plan may serve (effattn.plans): first, as a short call's host time counts
        got, key = plans.lookup(q, k, v, causal, window, layout, key_padding_mask, scale, dropout_p, return_lse,
                                backend)
        if got is not None:                      # a plan served it; else `key`: to keep its plan under, or None
            return got if return_lse else got[0]
    if unknown:
        check_keywords("attention", unknown, ATTENTION_KEYWORDS)
    paged = block_table is not None or seqlens is not None
    if paged or bias is not None:             # (a plain call builds none of this)
        others = dict(layout=layout, key_padding_mask=key_padding_mask, dropout_p=dropout_p, softcap=softcap,
                      sinks=sinks, bias=bias, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, positions=positions,
                      out_dtype=out_dtype)
    if paged:
        _takes_only("a paged call (block_table=, seqlens=)", "causal, window, scale, return_lse and backend", others)
        return paged_attention(q, k, v, block_table=block_table, seqlens=seqlens, causal=causal, window=window,
                               scale=scale, return_lse=return_lse, backend=backend)
    if bias is not None and _relative_keys(bias):
        _takes_only("bias=RelativeKeys(...)", RELATIVE_TAKES, {n: others[n] for n in RELATIVE_REFUSED})
        return relative_attention(q, k, v, bias.r, query=bias.query, max_distance=bias.max_distance, causal=causal,
                                  window=window, key_padding_mask=key_padding_mask, scale=scale, dropout_p=dropout_p,
                                  return_lse=return_lse, backend=backend)
    call = make_attn_call(q, k, v, causal=causal, window=window, layout=layout,
                          key_padding_mask=key_padding_mask, scale=scale, dropout_p=dropout_p,
                          return_lse=return_lse, softcap=softcap, sinks=sinks, bias=bias, cu_seqlens=cu_seqlens,
                          max_seqlen=max_seqlen, positions=positions, out_dtype=out_dtype)
    path = base.select("attention", call, backend)
    plans.store(key, path, call)
    out, lse = path.run(call)
    return (out, lse) if return_lse else out


# what an `attention` call with bias=RelativeKeys(...) takes (relative_attention's arguments), and
# what it refuses by name
RELATIVE_TAKES = "causal, window, key_padding_mask, scale, dropout_p, return_lse and backend"
RELATIVE_REFUSED = ("layout", "softcap", "sinks", "cu_seqlens", "max_seqlen", "positions", "out_dtype")


def _takes_only(what: str, allowed: str, others: dict) -> None:
    """Raises ValueError naming the arguments in `others` given (not None, not 0) to a call that
    takes `allowed` only."""
    given = [name for name, x in others.items() if x is not None and not (name == "dropout_p" and x == 0)]
    if given:
        raise ValueError(f"attention: {what} takes {allowed} only; got {', '.join(given)}")


def _relative_keys(bias) -> bool:
    """Whether ``bias`` is a `RelativeKeys` term, which runs on the rows of ``relative_attention``
    (alone: a list holding one is refused, naming ``bias``)."""
    if isinstance(bias, (list, tuple)) and any(isinstance(x, RelativeKeys) for x in bias):
        raise ValueError("attention: bias=RelativeKeys(...) combines with no other bias term; pass it alone")
    return isinstance(bias, RelativeKeys)


def explain(q, k, v, op: str = "attention", **kwargs) -> Explanation:
    """Reports, for each registered path (one line each, in the order ``backend="auto"`` tries them),
    whether it can serve ``op(q, k, v, **kwargs)`` and why not, and which one ``"auto"`` takes.
    ``op`` is ``"attention"``, ``"linear_attention"``, ``"lsh_attention"`` (``k`` is ``q`` or None,
    kwargs as `effattn.lsh_attention`) or ``"relative_attention"`` (``r=`` and the kwargs of
    `effattn.relative_attention`); a paged call (``block_table=``, ``seqlens=``; ``op`` "attention"
    or "paged_attention") lists the rows of ``"paged_attention"``, then, when the gather serves it, those of the contiguous call.

    Examples::

        >>> print(effattn.explain(q, k, v, causal=True))
        effattn.attention: backend='auto' picks torch/cpu-flash
          [  5] cuda/decode          cannot serve: runs on cuda tensors, got cpu
          ...
          [ 90] torch/cpu-flash      can serve
          [100] torch/reference      can serve
    """
    if op == PAGED_OP or (op == "attention" and ("block_table" in kwargs or "seqlens" in kwargs)):
        check_keywords("explain(op='attention')", kwargs, ATTENTION_KEYWORDS)
        return explain_paged(q, k, v, **kwargs)
    if op in base.CALL_MAKERS:                       # the ops with kernels of their own (lsh, relative)
        return explain_call(op, base.CALL_MAKERS[op](q, k, v, **kwargs))
    backend = kwargs.pop("backend", "auto")
    if op in ("attention", "linear_attention"):
        check_keywords(f"explain(op={op!r})", kwargs, ATTENTION_KEYWORDS if op == "attention" else LINEAR_KEYWORDS)
    if op == "attention" and _relative_keys(kwargs.get("bias")):
        term = kwargs.pop("bias")
        _takes_only("bias=RelativeKeys(...)", RELATIVE_TAKES, {n: kwargs.pop(n) for n in RELATIVE_REFUSED if n in kwargs})
        return explain_call(RELATIVE_OP, make_relative_call(q, k, v, term.r, query=term.query,
                                                            max_distance=term.max_distance, backend=backend, **kwargs))
    if op == "attention":
        call = make_attn_call(q, k, v, **kwargs)
    elif op == "linear_attention":
        packed = {n: kwargs.pop(n) for n in ("cu_seqlens", "max_seqlen") if n in kwargs}
        if packed.get("cu_seqlens") is not None:    # each segment is one call of the same backend
            check_linear_packed(q, k, v, packed["cu_seqlens"], packed.get("max_seqlen"),
                                kwargs.get("initial_state"), kwargs.get("return_state", False))
        elif packed.get("max_seqlen") is not None:
            raise ValueError("linear_attention: max_seqlen is given without cu_seqlens")
        call = make_linear_call(q, k, v, **kwargs)
    else:
        ops = ", ".join(repr(o) for o in ("attention", "linear_attention", PAGED_OP, *base.CALL_MAKERS))
        raise ValueError(f"explain: op must be one of {ops}; got {op!r}")
    return explain_call(op, call)


def explain_paged(q, k_pages, v_pages, **kwargs) -> Explanation:
    """`explain` of a paged call: the rows of op ``"paged_attention"`` (``triton/paged``,
    ``cuda/paged-decode``, ``cuda/paged-prefill``, ``torch/paged-gather``) with their reasons; when the
    gather serves it, the rows of the contiguous call it makes follow, each that can serve noting the gather."""
    call = make_paged_call(q, k_pages, v_pages, **kwargs)
    report = explain_call(PAGED_OP, call)
    chosen = paged_row(call) if call.backend != "triton" else None
    if chosen is None or chosen.backend != "torch":           # an in-place kernel
        return report
    k, v, kpm = contiguous_keys(call, shapes_only=True)
    inner = explain(q, k, v, causal=call.causal, window=call.window, key_padding_mask=kpm, scale=call.scale,
                    return_lse=call.return_lse)
    paged = [r._replace(notes=["paged kernel not taken"] + r.notes) if r.backend != "torch" else
             r._replace(detail=f"then effattn.attention(backend={call.backend!r}) on the copy: "
                               f"{inner.chosen_path or 'no row can serve'}") if r.path == chosen.name else r
             for r in report.rows]
    rows = paged + [r._replace(notes=r.notes + [GATHER_NOTE]) if not r.reasons else r for r in inner.rows]
    groups = {name: report.groups.get(name, []) + inner.groups.get(name, [])
              for name in dict.fromkeys([*report.groups, *inner.groups])}
    out = Explanation("attention (paged)", rows, chosen.name, inner.missing, groups)
    return out
