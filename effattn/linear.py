"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): the public function.

Softmax's ``exp(q . k)`` is replaced by a kernel ``phi(q) . phi(k)``, so the sum over keys can be
taken before the queries arrive:  ``out_i = phi(q_i) S / (phi(q_i) . z + eps)`` with
``S = sum_j phi(k_j)^T v_j`` (F x Dv) and ``z = sum_j phi(k_j)`` (F). Validation lives in
``effattn._call`` (``make_linear_call``); the torch reference in ``effattn.backends.torch.linear``.
"""
from __future__ import annotations

import torch

from ._call import LINEAR, LINEAR_KEYWORDS, LinearCall, check_keywords, make_linear_call  # noqa: F401
from .backends.base import select
from .packed import check_linear_packed


def linear_attention(q, k, v, *, causal=False, feature_map="elu", normalize=True, eps=1e-6,
                     initial_state=None, return_state=False, cu_seqlens=None, max_seqlen=None, backend="auto",
                     **unknown):
    r"""Linear attention ``out_i = phi(q_i) S / (phi(q_i) . z + eps)`` in O(L) time and memory.

    ``S = sum_j phi(k_j)^T v_j`` and ``z = sum_j phi(k_j)`` run over all keys, or over ``j <= i``
    when causal (Katharopoulos et al. 2020, eq. 4-6). ``normalize=False`` drops the denominator.

    Args:
        q: ``(B, H, Lq, D)`` queries.
        k: ``(B, Hkv, Lk, D)`` keys; ``H % Hkv == 0``: query head ``h`` uses key/value head
            ``h // (H / Hkv)`` (grouped-query attention; k and v are never expanded).
        v: ``(B, Hkv, Lk, Dv)`` values, ``Dv`` may differ from ``D``. q, k, v share one dtype
            (float16, bfloat16, float32, float64) and may be non-contiguous views.
        causal: query i sees keys ``j <= i + (Lk - Lq)`` (bottom-right alignment, as
            :func:`effattn.attention`). For ``Lq == Lk`` the usual lower triangle; for ``Lk > Lq`` the
            first ``Lk - Lq`` keys are seen by every query (a decoding step: ``Lq=1`` sees all keys);
            for ``Lk < Lq`` the first ``Lq - Lk`` queries see no key (only ``initial_state``)::

                Lq=2, Lk=4:  q0: 1 1 1 .      Lq=4, Lk=2:  q0: . .    q2: 1 .
                             q1: 1 1 1 1                   q1: . .    q3: 1 1
        feature_map: ``"elu"`` (elu(x)+1, default), ``"relu"``, ``"identity"``, an
            :class:`effattn.FavorFeatures` (softmax-kernel random features), or any callable
            ``(..., D) -> (..., F)``. It is applied to q and k upcast to float32 (float64 for float64
            inputs).
        normalize: divide by ``phi(q_i) . z + eps`` (default) or not.
        eps: ``>= 0``, added to the denominator. A query whose denominator is exactly 0 (possible only
            with ``eps=0``) outputs 0.
        initial_state: ``(S0 (B, H, F, Dv), z0 (B, H, F))``, the state returned for a previous segment;
            it is added to the sums of every query (causal: to every prefix). With ``causal=False`` a
            segment then attends to the keys of all previous segments plus all of its own.
        return_state: also return the final ``(S (B, H, F, Dv), z (B, H, F))``: ``S0``/``z0`` plus the
            sums over all keys of this call. So processing a sequence in segments, passing the state
            along, gives the same outputs (causal) and final state as one call. States are per query
            head (for GQA, heads of one group hold the same sums unless their ``S0`` differ) and are
            float32 (float64 for float64 inputs).
        cu_seqlens: int32 ``(N + 1,)`` offsets of packed sequences (q, k, v packed as ``(1, H, T, D)``):
            each segment is attended alone, its state starting from zero (see :mod:`effattn.packed`).
        max_seqlen: the longest segment, checked when given.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cuda"``.

    Returns:
        ``out (B, H, Lq, Dv)`` in the dtype of q, or ``(out, (S, z))`` with ``return_state=True``.

    Examples::

        >>> q, k, v = (torch.randn(2, 8, 4096, 64) for _ in range(3))
        >>> out = effattn.linear_attention(q, k, v, causal=True)
        >>> # recurrent decoding, one segment at a time
        >>> o1, state = effattn.linear_attention(q[:, :, :2048], k[:, :, :2048], v[:, :, :2048],
        ...                                      causal=True, return_state=True)
        >>> o2, state = effattn.linear_attention(q[:, :, 2048:], k[:, :, 2048:], v[:, :, 2048:],
        ...                                      causal=True, initial_state=state, return_state=True)
    """
    if unknown:
        check_keywords(LINEAR, unknown, LINEAR_KEYWORDS)
    if cu_seqlens is not None or max_seqlen is not None:
        if cu_seqlens is None:
            raise ValueError(f"{LINEAR}: max_seqlen is given without cu_seqlens")
        offs = check_linear_packed(q, k, v, cu_seqlens, max_seqlen, initial_state, return_state)
        # each segment is one call of the chosen backend, on views of q, k, v, its state from zero
        outs = [linear_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=causal, feature_map=feature_map,
                                 normalize=normalize, eps=eps, backend=backend)
                for a, b in zip(offs, offs[1:]) if b > a]
        return torch.cat(outs, dim=2) if outs else q.new_zeros(*q.shape[:3], v.shape[-1])
    call = make_linear_call(q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
                            initial_state=initial_state, return_state=return_state)
    out, state = select(LINEAR, call, backend).run(call)
    return (out, state) if call.return_state else out
