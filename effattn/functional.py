"""The public softmax-attention function and `explain`: validate, pick a backend, run."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

from ._call import ATTENTION_KEYWORDS, LINEAR_KEYWORDS, check_keywords, make_attn_call, make_linear_call
from .backends import base
from .packed import check_linear_packed
from .paged import GATHER_NOTE, contiguous_keys, make_paged_call, paged_attention, paged_row
from .paged import OP as PAGED_OP


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
            the distance ``d = pos(i) - j``. Any of their tensors that requires grad gets a
            deterministic gradient. Order of operations: docs/conventions.md, "Scores".
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
    if unknown:
        check_keywords("attention", unknown, ATTENTION_KEYWORDS)
    if block_table is not None or seqlens is not None:
        if (layout is not None or key_padding_mask is not None or dropout_p or cu_seqlens is not None
                or max_seqlen is not None or positions is not None or out_dtype is not None):
            raise ValueError("attention: a paged call (block_table=, seqlens=) takes causal, window, scale, "
                             "return_lse and backend only (no layout, key_padding_mask, dropout_p, cu_seqlens, "
                             "max_seqlen, positions or out_dtype)")
        return paged_attention(q, k, v, block_table=block_table, seqlens=seqlens, causal=causal, window=window,
                               scale=scale, return_lse=return_lse, backend=backend)
    call = make_attn_call(q, k, v, causal=causal, window=window, layout=layout,
                          key_padding_mask=key_padding_mask, scale=scale, dropout_p=dropout_p,
                          return_lse=return_lse, softcap=softcap, sinks=sinks, bias=bias, cu_seqlens=cu_seqlens,
                          max_seqlen=max_seqlen, positions=positions, out_dtype=out_dtype)
    out, lse = base.select("attention", call, backend).run(call)
    return (out, lse) if return_lse else out


class Row(NamedTuple):
    """One registry row as `explain` found it for a call."""
    path: str                 # "triton/decode"
    backend: str
    rank: int                 # the row's priority for this call (lower is tried first)
    reasons: List[str]        # why it cannot serve the call; empty: it can
    notes: List[str]          # what serving involves besides the kernels; "only when named" remarks
    detail: Optional[str]     # detail inside the path (splits, which forward kernel), or None


def _undeclared(why: List[str]) -> bool:
    """Whether a row's reasons say it does not declare some feature of the call (so the call is not
    for that row; `base.Backend.take` prefers the reasons of a row that declares them all)."""
    return any(w.startswith("does not support ") for w in why)


class Explanation:
    """What `explain` found: one `Row` per registered path (in the order "auto" tries them) with
    its reasons, and the pick. Per backend (``reasons``, ``notes``, ``paths``, ``ranks``, keyed by
    backend name): what naming that backend would do, i.e. its first row that admits the call (or
    the reasons of its last, most general row when none does)."""

    def __init__(self, op: str, rows: List[Row], chosen_path: Optional[str], missing: Dict[str, List[str]],
                 groups: Dict[str, List[str]]):
        self.op, self.rows, self.chosen_path = op, rows, chosen_path
        self.missing, self.groups = missing, groups
        self.chosen = chosen_path.split("/")[0] if chosen_path else None
        self.reasons: Dict[str, List[str]] = {}
        self.notes: Dict[str, str] = {}
        self.paths: Dict[str, str] = {}
        self.ranks: Dict[str, int] = {}
        by_name = {r.path: r for r in rows}
        for r in (by_name[n] for names in groups.values() for n in names):   # each backend's own order
            if r.backend in self.ranks and not self.reasons[r.backend]:
                continue                                   # the backend already takes an earlier row
            if (r.backend in self.ranks and r.reasons and _undeclared(r.reasons)
                    and not _undeclared(self.reasons[r.backend])):
                continue                                   # keep the reasons of the row the call is for
            self.reasons[r.backend], self.ranks[r.backend] = r.reasons, r.rank
            self.notes.pop(r.backend, None)
            if r.notes:
                self.notes[r.backend] = "; ".join(r.notes)
            self.paths[r.backend] = r.path + (f": {r.detail}" if r.detail else "")
        self.reasons.update(missing)

    def row(self, path: str) -> Row:
        return next(r for r in self.rows if r.path == path)

    def can_serve(self, name: str) -> bool:
        """Whether backend (or path) `name` can serve the call."""
        if "/" in name:
            return not self.row(name).reasons
        return name in self.reasons and not self.reasons[name]

    def __str__(self):
        lines = [f"effattn.{self.op}: backend='auto' picks {self.chosen_path or 'nothing (no backend can serve)'}"]
        width = max([len(r.path) for r in self.rows] + [7])
        for r in self.rows:
            state = "can serve" if not r.reasons else "cannot serve: " + "; ".join(r.reasons)
            extra = [x for x in r.notes + [r.detail] if x]
            note = "".join(f" ({x})" for x in extra)
            lines.append(f"  [{r.rank:>3}] {r.path:{width}s} {state}{note}")
        for name, why in self.reasons.items():
            if not any(r.backend == name for r in self.rows):
                lines.append(f"  {'':5s} {name:{width}s} {'; '.join(why)}")
        return "\n".join(lines)

    __repr__ = __str__


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
    kwargs.pop("backend", None)
    if op in ("attention", "linear_attention"):
        check_keywords(f"explain(op={op!r})", kwargs, ATTENTION_KEYWORDS if op == "attention" else LINEAR_KEYWORDS)
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


def explain_call(op: str, call) -> Explanation:
    """The `Explanation` of a call already built: every row of ``op`` with its reasons."""
    found, chosen = [], None
    for p in base.rows(op, call):
        why = p.reasons(call)
        notes = list(p.notes(call)) if not why else []
        if not why and call.q.device.type in p.explicit_only_devices:
            notes.insert(0, f"on {call.q.device.type} only when asked for by name")
        elif not why and chosen is None:
            chosen = p.name
        found.append(Row(p.name, p.backend, p.rank(call), why, notes, p.describe(call) if not why else None))
    missing = {name: [base.missing_reason(op, name)] for name in base.BACKENDS if name not in base._REGISTRY[op]}
    groups = {b.name: [p.name for p in b.ordered(call)] for b in base.backends_for(op)}
    return Explanation(op, found, chosen, missing, groups)


def explain_paged(q, k_pages, v_pages, **kwargs) -> Explanation:
    """`explain` of a paged call: the rows of op ``"paged_attention"`` (``triton/paged``,
    ``torch/paged-gather``) with their reasons; when the gather serves it, the rows of the contiguous
    call it makes follow, each that can serve noting the gather."""
    call = make_paged_call(q, k_pages, v_pages, **kwargs)
    report = explain_call(PAGED_OP, call)
    chosen = paged_row(call) if call.backend != "triton" else None
    if chosen is None or chosen.backend == "triton":
        return report
    k, v, kpm = contiguous_keys(call, shapes_only=True)
    inner = explain(q, k, v, causal=call.causal, window=call.window, key_padding_mask=kpm, scale=call.scale,
                    return_lse=call.return_lse)
    paged = [r._replace(notes=["paged kernel not taken"] + r.notes) if r.backend == "triton" else
             r._replace(detail=f"then effattn.attention(backend={call.backend!r}) on the copy: "
                               f"{inner.chosen_path or 'no row can serve'}") if r.path == chosen.name else r
             for r in report.rows]
    rows = paged + [r._replace(notes=r.notes + [GATHER_NOTE]) if not r.reasons else r for r in inner.rows]
    groups = {name: report.groups.get(name, []) + inner.groups.get(name, [])
              for name in dict.fromkeys([*report.groups, *inner.groups])}
    out = Explanation("attention (paged)", rows, chosen.name, inner.missing, groups)
    return out
