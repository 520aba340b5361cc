"""Modules that produce score terms for :func:`effattn.attention` (``bias=module()``): ALiBi, T5's
relative position bias, and adaptive attention span (Sukhbaatar et al. 2019)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import bias as _bias


class ALiBi(nn.Module):
    """``forward()`` -> :class:`effattn.bias.ALiBi` with the paper's slopes (a buffer), or learnable
    slopes initialized to them (``learnable=True``)."""

    def __init__(self, num_heads: int, learnable: bool = False):
        super().__init__()
        slopes = _bias.alibi_slopes(num_heads)
        if learnable:
            self.slopes = nn.Parameter(slopes)
        else:
            self.register_buffer("slopes", slopes)

    def forward(self) -> _bias.ALiBi:
        return _bias.ALiBi(self.slopes)


class T5RelativeBias(nn.Module):
    """T5's relative position bias as a score term: ``relative_attention_bias`` is an
    ``nn.Embedding(num_buckets, num_heads)`` like Hugging Face's T5Attention (state dicts load
    as they are); ``forward()`` -> :class:`effattn.bias.Relative` over the clipped distances, so the
    kernels read a (H, 2M+1) table instead of a materialized (Lq, Lk) bias. The table is the
    embedding times a fixed one-hot matrix (a matmul: the embedding's gradient is deterministic)."""

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        self.num_heads, self.max_distance, self.bidirectional = num_heads, max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        idx = _bias.t5_bucket_index(num_buckets, max_distance, bidirectional)
        self.register_buffer("one_hot", nn.functional.one_hot(idx, num_buckets).float(), persistent=False)

    def forward(self) -> _bias.Relative:
        w = self.relative_attention_bias.weight                        # (num_buckets, H)
        table = (self.one_hot.to(w.dtype) @ w).t()                      # (H, 2M+1 or M+1)
        return _bias.Relative(table, max_distance=self.max_distance, bidirectional=self.bidirectional)


class AdaptiveSpan(nn.Module):
    """Adaptive attention span (Sukhbaatar et al. 2019): a learnable span per head.

    ``ratio`` (num_heads,) in [0, 1] is the parameter; head h's span is ``z = ratio * max_span``
    tokens, followed by a soft ramp of ``ramp`` tokens; keys farther away are invisible and the
    kernels skip them. ``forward()`` -> :class:`effattn.bias.Span`; ``loss()`` is the paper's
    penalty ``loss_coeff * max_span * mean(ratio)``; call ``clamp_()`` after each optimizer step.
    ``bidirectional=True`` (encoders): the span is symmetric, keys farther than the span on either
    side are invisible (`effattn.bias.Span`'s ``bidirectional``).
    """

    def __init__(self, num_heads: int, max_span: int, ramp: int = 32, init: float = 0.0,
                 loss_coeff: float = 2e-6, bidirectional: bool = False):
        super().__init__()
        if not 0.0 <= init <= 1.0:
            raise ValueError(f"AdaptiveSpan: init must be a ratio in [0, 1], got {init!r}")
        if max_span < 0 or ramp <= 0:
            raise ValueError(f"AdaptiveSpan: max_span must be >= 0 and ramp > 0, got {max_span!r}, {ramp!r}")
        if not isinstance(bidirectional, bool):
            raise TypeError(f"AdaptiveSpan: bidirectional must be a bool, got {bidirectional!r}")
        self.max_span, self.ramp, self.loss_coeff = max_span, ramp, loss_coeff
        self.bidirectional = bidirectional
        self.ratio = nn.Parameter(torch.full((num_heads,), float(init)))

    @property
    def spans(self) -> Tensor:
        """The current spans in tokens (num_heads,), detached."""
        return self.ratio.detach().clamp(0, 1) * self.max_span

    def forward(self) -> _bias.Span:
        # the clamp keeps z in [0, max_span] between an optimizer step and clamp_()
        return _bias.Span(self.ratio.clamp(0, 1) * self.max_span, ramp=self.ramp, max_span=self.max_span,
                          bidirectional=self.bidirectional)

    def loss(self) -> Tensor:
        return self.loss_coeff * self.max_span * self.ratio.mean()

    @torch.no_grad()
    def clamp_(self) -> None:
        self.ratio.clamp_(0, 1)
