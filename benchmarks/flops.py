"""FLOPs of one benchmark configuration: counted here once, for every implementation alike.

Softmax attention counts only the *visible* score entries, the work a mask-aware kernel must do:

    forward          = 4 * B * D * visible_pairs          (QK^T and PV: 2 FLOPs per multiply-add each;
                                                            visible_pairs summed over the H heads)
    forward+backward = 3.5 * forward                      (backward = 2.5x forward: recompute QK^T,
                                                            then dV, dP, dQ, dK)

so dense attention is ``4*B*H*Lq*Lk*D``, causal with ``Lq == Lk`` counts ``L*(L+1)/2`` pairs, and a
block-sparse layout counts its visible fraction exactly. An implementation that computes masked
entries anyway (naive, SDPA with a dense mask) is charged the same useful work, so its TFLOP/s show
what that waste costs.

Linear attention (recurrent form, per token: state update ``S += phi(k)^T v`` and readout
``phi(q) S``, each ``2*F*Dv`` FLOPs; normalization is one more value column, ``z`` and ``phi(q).z``):

    forward          = 4 * B * H * L * F * (Dv + normalize)  +  feature-map projection
                       (FAVOR+: 2 * D * F per row of q and of k -> 4 * B * H * L * D * F; elu, relu and
                       identity are elementwise and count 0)
    forward+backward = 3 * forward                        (backward: dq, and dk, dv through the
                                                            state, about twice the forward's products)

Causal and non-causal linear attention are counted alike; the chunked algorithms' intra-chunk
``C x C`` products are an implementation detail, not charged.
"""
from __future__ import annotations

import functools
from fractions import Fraction

from effattn.visibility import Rule

FWD_BWD_FACTOR = Fraction(7, 2)      # softmax attention: forward + backward = 3.5 x forward
LINEAR_FWD_BWD_FACTOR = Fraction(3)  # linear attention


@functools.lru_cache(maxsize=64)     # the runner asks once per row; a 64k layout takes ~30 ms
def visible_pairs(Lq: int, Lk: int, *, causal: bool = False, window=None, layout=None, heads: int = 1) -> int:
    """Exact number of visible (query, key) pairs over ``heads`` heads (effattn.visibility's rule)."""
    return Rule.of(Lq, Lk, causal=causal, window=window, layout=layout).visible_pairs(heads)


def attention_flops(batch: int, heads: int, head_dim: int, Lq: int, Lk: int, *, causal: bool = False,
                    window=None, layout=None, mode: str = "fwd", value_dim=None) -> int:
    """FLOPs of softmax attention on ``(B, H, Lq, D)`` queries, counting visible pairs only.
    ``mode`` is ``"fwd"`` or ``"fwdbwd"``; ``value_dim`` (Dv) defaults to ``head_dim``."""
    dv = head_dim if value_dim is None else value_dim
    pairs = visible_pairs(Lq, Lk, causal=causal, window=window, layout=layout, heads=heads)
    fwd = 2 * batch * (head_dim + dv) * pairs          # = 4*B*D*pairs when Dv == D
    return _with_mode(fwd, mode, FWD_BWD_FACTOR)


def linear_attention_flops(batch: int, heads: int, head_dim: int, seq_len: int, *, num_features=None,
                           normalize: bool = True, favor: bool = False, mode: str = "fwd",
                           value_dim=None) -> int:
    """FLOPs of linear attention (formula in the module docstring). ``num_features`` (F) defaults to
    ``head_dim``; ``favor=True`` adds the random-feature projection of q and k."""
    F = head_dim if num_features is None else num_features
    dv = head_dim if value_dim is None else value_dim
    fwd = 4 * batch * heads * seq_len * F * (dv + int(normalize))
    if favor:
        fwd += 4 * batch * heads * seq_len * head_dim * F
    return _with_mode(fwd, mode, LINEAR_FWD_BWD_FACTOR)


def _with_mode(fwd: int, mode: str, factor: Fraction) -> int:
    if mode == "fwd":
        return fwd
    if mode == "fwdbwd":
        return int(fwd * factor)                       # exact: fwd is even
    raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")


def tflops(flops: int, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12
