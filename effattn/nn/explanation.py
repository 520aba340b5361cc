"""What `effattn.nn.MultiheadAttention.explain` reports for one call: its path (fused, linear or a
reference path and why), what to change to leave a reference path, and :func:`effattn.explain`'s
report on the fused call."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ..explanation import Explanation

#: what a caller can change to leave each reference path (keyed by the reason in ``last_path``)
REFERENCE_HINTS = {
    "need_weights=True": "pass need_weights=False (the weights are the dense matrix)",
    "add_bias_kv/add_zero_attn": "the module was built with add_bias_kv / add_zero_attn",
    "float key_padding_mask": "pass a bool key_padding_mask (True = padding) or one of only 0 / -inf",
    "bool attn_mask": "express the mask as is_causal=True / window= / layout= / key_padding_mask",
    "float attn_mask": "express the mask as is_causal=True / window= / layout= / key_padding_mask",
}


class ForwardExplanation:
    """What :meth:`MultiheadAttention.explain` found for one call.

    Attributes:
        path: the ``last_path`` the call would record: ``"fused"``, ``"linear"`` or ``"reference: <why>"``.
        op: ``"attention"`` / ``"linear_attention"``: the effattn function the call would make; None on a
            reference path (the module computes a dense softmax itself).
        reasons: every reason the call leaves the fused path (empty on a fused or linear path).
        report: :func:`effattn.explain`'s :class:`~effattn.explanation.Explanation` for that call (which
            backend ``"auto"`` picks, why each other one cannot serve); None on a reference path.
        backend: the module's ``backend`` (a name other than ``"auto"`` is used as is).
        shape: ``(Lq, Lk)`` of the attention (``Lk`` includes cached keys and memory).
    """

    def __init__(self, path: str, op: Optional[str], report: Optional[Explanation], backend: str,
                 shape: Tuple[int, int], reasons: Sequence[str] = ()):
        self.path, self.op, self.report, self.backend, self.shape = path, op, report, backend, shape
        self.reasons = list(reasons)

    def __str__(self) -> str:
        Lq, Lk = self.shape
        if self.report is None:
            hints = "; ".join(REFERENCE_HINTS.get(why, why) for why in self.reasons)
            return (f"MultiheadAttention: {self.path} path: a dense softmax over the ({Lq}, {Lk}) score matrix in "
                    f"torch, O(Lq*Lk) memory. It leaves the fused kernels because of: {', '.join(self.reasons)}. "
                    f"To get the fused kernels: {hints}")
        head = f"MultiheadAttention: {self.path} path, effattn.{self.op} on ({Lq}, {Lk})"
        if self.backend != "auto":
            head += f" with backend={self.backend!r}"
        return head + "\n" + str(self.report)

    __repr__ = __str__
