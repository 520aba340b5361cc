"""`effattn.nn.MultiheadAttention`: the interface of ``torch.nn.MultiheadAttention`` on effattn.

Same constructor, same ``forward``, same parameter names and initialization, so state dicts move
both ways between this module and torch's. Keyword-only extras pick a variant (``window``,
``layout``, ``linear``, ``backend``) and enable decoding (``cache=``) and segment memory
(``memory=``).

Every call takes one of three paths, recorded in ``module.last_path``:

- ``"fused"``: :func:`effattn.attention`, O(L) memory. Serves ``is_causal``, ``window``, ``layout``
  and a bool ``key_padding_mask``.
- ``"linear"``: :func:`effattn.linear_attention` (modules built with ``linear=``).
- ``"reference: <why>"``: a dense softmax over the full ``(Lq, Lk)`` score matrix, O(L^2) time and
  memory. Taken only for what the fused kernels cannot express: an explicit ``attn_mask``, a float
  ``key_padding_mask``, ``need_weights=True`` (the weights *are* the dense matrix), and
  ``add_bias_kv`` / ``add_zero_attn``. Each distinct reason is logged once per module at DEBUG level
  on the ``effattn.nn`` logger, so nothing is silently slow.

``module.explain(query, key, value, **forward_kwargs)`` says which path a call would take, what to
change to leave a reference path, and which backend would serve a fused one (:func:`effattn.explain`).
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..visibility import Rule, normalize_window
from ..feature_maps import FavorFeatures, NAMED_FEATURE_MAPS, resolve_feature_map
from ..functional import Explanation, attention, explain as explain_call
from ..layouts import BlockLayout
from ..linear import linear_attention
from .cache import KVCache

logger = logging.getLogger("effattn.nn")

VARIANT_KEYS = ("window", "layout", "linear", "backend")
BACKENDS = ("auto", "torch", "triton", "cuda")
MAX_FEATURES = 256    # linear attention's head-dim limit, met by precomputed features (padding path)


# ----------------------------------------------------------------------------------------------
# variant checks, shared with swap_attention

def check_variant(fn: str, *, window=None, layout=None, linear=None, backend="auto") -> None:
    """Raises a ValueError/TypeError naming ``fn`` for an impossible or malformed variant."""
    if window is not None:
        try:
            normalize_window(window, False)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{fn}: {str(e).split(': ', 1)[-1]}") from None
    if layout is not None and not (isinstance(layout, BlockLayout) or callable(layout)):
        raise TypeError(f"{fn}: layout must be an effattn.layouts.BlockLayout or a callable "
                        f"(Lq, Lk) -> BlockLayout, got {type(layout).__name__}")
    if linear is not None:
        if isinstance(linear, str) and linear not in NAMED_FEATURE_MAPS and linear != "favor":
            names = ", ".join(repr(n) for n in (*NAMED_FEATURE_MAPS, "favor"))
            raise ValueError(f"{fn}: unknown linear feature map {linear!r}; expected one of {names}, an "
                             "effattn.FavorFeatures or a callable (..., D) -> (..., F)")
        if not isinstance(linear, str) and not callable(linear):
            raise TypeError(f"{fn}: linear must be a feature-map name, an effattn.FavorFeatures or a callable, "
                            f"got {type(linear).__name__}")
        if window is not None or layout is not None:
            raise ValueError(f"{fn}: linear attention has no window or layout (it never forms the score "
                             "matrix a mask would cut); choose linear= or window=/layout=, not both")
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")


def _blocks_torch_fast_path(module, args):
    """A no-op forward pre-hook. ``torch.nn.TransformerEncoderLayer``'s fused inference path reads
    ``self_attn.in_proj_weight`` and never calls ``self_attn``; it is skipped when any submodule has a
    hook, so this keeps a variant (window, linear, ...) from being silently bypassed."""
    return None


# ----------------------------------------------------------------------------------------------
# the dense reference path

def dense_attention(q: Tensor, k: Tensor, v: Tensor, *, visible: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, scale: Optional[float] = None, dropout_p: float = 0.0,
                    softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention over the materialized ``(Lq, Lk)`` scores: the slow, general path.

    Args:
        q: ``(B, H, Lq, D)``; k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)``, ``H % Hkv == 0``.
        visible: bool, broadcastable to ``(B, H, Lq, Lk)``, True = may attend.
        bias: float, broadcastable to ``(B, H, Lq, Lk)``, added to the scores (``-inf`` = masked).
        scale: default ``1/sqrt(D)``.
        softcap: ``tanh(s / softcap) * softcap`` on the scaled scores before bias (Gemma 2).

    Computes in float32 (float64 for float64 inputs). A row with no visible key gives output 0 and
    weights 0 (torch's MultiheadAttention gives NaN there).

    Returns:
        ``out (B, H, Lq, Dv)`` in q's dtype, ``weights (B, H, Lq, Lk)`` in the compute dtype (after
        dropout, as torch returns them).
    """
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.to(cdt).reshape(B, Hkv, G * Lq, D)                # query heads of one kv head side by side
    s = torch.matmul(qg, k.to(cdt).transpose(-1, -2)).view(B, H, Lq, Lk) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(cdt)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # rows of -inf only: exp(-inf) = 0
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    if dropout_p > 0:
        p = F.dropout(p, p=dropout_p, training=True)
    out = torch.matmul(p.reshape(B, Hkv, G * Lq, Lk), v.to(cdt)).view(B, H, Lq, Dv)
    return out.to(q.dtype), p


def _as_bool_padding(kpm: Tensor) -> Tensor:
    """A float key padding mask of only 0 and -inf as bool (True = padding), else unchanged.

    torch's transformer layers hand their attention a float mask even when the user gave a bool
    one (``F._canonical_mask``); reading it (one reduction over ``(B, S)``, a device sync) keeps
    those calls on the fused path. Any other additive value takes the reference path.
    """
    blocked = kpm == float("-inf")
    if bool(torch.all(blocked | (kpm == 0))):
        return blocked
    return kpm


# ----------------------------------------------------------------------------------------------
# MultiheadAttention.explain

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
        report: :func:`effattn.explain`'s :class:`~effattn.functional.Explanation` for that call (which
            backend ``"auto"`` picks, why each other one cannot serve); None on a reference path.
        backend: the module's ``backend`` (a name other than ``"auto"`` is used as is).
        shape: ``(Lq, Lk)`` of the attention (``Lk`` includes cached keys and memory).
    """

    def __init__(self, path: str, op: Optional[str], report: Optional[Explanation], backend: str,
                 shape: Tuple[int, int]):
        self.path, self.op, self.report, self.backend, self.shape = path, op, report, backend, shape

    def __str__(self) -> str:
        Lq, Lk = self.shape
        if self.report is None:
            why = self.path.split(": ", 1)[-1]
            return (f"MultiheadAttention: {self.path} path: a dense softmax over the ({Lq}, {Lk}) score matrix in "
                    f"torch, O(Lq*Lk) memory; to get the fused kernels, {REFERENCE_HINTS.get(why, why)}")
        head = f"MultiheadAttention: {self.path} path, effattn.{self.op} on ({Lq}, {Lk})"
        if self.backend != "auto":
            head += f" with backend={self.backend!r}"
        return head + "\n" + str(self.report)

    __repr__ = __str__


class _Explained(Exception):
    """Carries a ForwardExplanation out of ``forward`` (MultiheadAttention.explain stops the call there)."""

    def __init__(self, explanation: ForwardExplanation):
        super().__init__(explanation.path)
        self.explanation = explanation


# ----------------------------------------------------------------------------------------------

class MultiheadAttention(nn.Module):
    r"""Drop-in ``torch.nn.MultiheadAttention`` on effattn's fused kernels, with variants.

    Constructor arguments up to ``dtype`` and the ``forward`` arguments mean exactly what they mean
    for ``torch.nn.MultiheadAttention``; parameters have the same names, shapes and initialization
    (``in_proj_weight`` or ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` when ``kdim`` or
    ``vdim`` differ from ``embed_dim``, ``in_proj_bias``, ``out_proj``, ``bias_k``, ``bias_v``), so a
    state dict loads either way. With no extras the output equals torch's up to rounding.

    Keyword-only extras (the *variant*):
        window: int ``w`` or ``(left, right)``: query at position p sees keys ``p - left .. p + right``
            (an int means ``(w, 0)`` with ``is_causal=True``, ``(w, w)`` otherwise).
        layout: an :class:`effattn.layouts.BlockLayout` fixed to one ``(Lq, Lk)``, or a callable
            ``(Lq, Lk) -> BlockLayout`` for inputs of varying length.
        linear: a feature map for linear attention instead of softmax: ``"elu"``, ``"relu"``,
            ``"identity"``, ``"favor"`` (creates an :class:`effattn.FavorFeatures` submodule
            ``feature_map``, whose ``projection`` buffer then is an extra state-dict entry: torch's
            state dicts still load, the module keeping its own projection; the other way needs
            ``strict=False``), an
            ``effattn.FavorFeatures`` or any callable ``(..., D) -> (..., F)``. Linear attention forms
            no probability matrix: ``dropout`` does not apply to it, ``attn_mask`` and
            ``need_weights=True`` are errors.
        backend: ``"auto"`` (default), ``"torch"``, ``"triton"`` or ``"cuda"``.

    Positions are aligned bottom-right (query i sits at ``i + Lk - Lq``), as in
    :func:`effattn.attention`. For ``Lq == Lk`` that is torch's convention; for ``Lq != Lk`` torch
    has no ``is_causal`` without a mask, and here ``is_causal=True`` means "no key after the query's
    position", which is what decoding with a cache needs.

    ``is_causal=True`` with an ``attn_mask`` is taken as torch documents it, a hint that
    ``attn_mask`` *is* the causal mask: for ``Lq == Lk`` and ``need_weights=False`` the mask is not
    read and the fused causal kernel runs.

    ``last_path`` says which path the last call took (see the module docstring); ``"reference"``
    paths are O(L^2). :meth:`explain` says which path a call would take and which backend would serve
    it, without running it. ``need_weights`` defaults to True as in torch: pass ``need_weights=False`` to
    get the fused kernels.

    Extra ``forward`` keywords:
        cache: a :class:`effattn.nn.KVCache` for incremental decoding: this call's keys/values are
            appended to it and the queries attend to everything cached (linear modules carry their
            state ``(S, z)`` instead). ``key_padding_mask`` then covers this call's keys only.
        memory: Transformer-XL segment memory: the previous segment's inputs, shaped like ``key``.
            They are projected with the current weights and prepended to the keys and values, with no
            gradient flowing into ``memory`` itself. ``key_padding_mask`` may cover the keys only or
            memory + keys; ``attn_mask`` and a ``layout`` cover memory + keys.

    The module carries a no-op forward pre-hook: it keeps ``torch.nn.TransformerEncoderLayer``'s
    fused inference path (which bypasses ``self_attn.forward``) from skipping a variant.

    Examples::

        >>> mha = effattn.nn.MultiheadAttention(512, 8, batch_first=True, window=128)
        >>> out, _ = mha(x, x, x, is_causal=True, need_weights=False)      # x (B, L, 512)
        >>> mha.last_path
        'fused'
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *,
                 window=None, layout=None, linear=None, backend="auto"):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"MultiheadAttention: embed_dim and num_heads must be > 0, got embed_dim={embed_dim} "
                             f"and num_heads={num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"MultiheadAttention: embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        check_variant("MultiheadAttention", window=window, layout=layout, linear=linear, backend=backend)
        if isinstance(linear, FavorFeatures) and linear.head_dim != embed_dim // num_heads:
            raise ValueError(f"MultiheadAttention: linear=FavorFeatures(head_dim={linear.head_dim}) does not match "
                             f"head_dim = embed_dim // num_heads = {embed_dim // num_heads}")
        if linear is not None and (add_bias_kv or add_zero_attn):
            raise ValueError("MultiheadAttention: add_bias_kv / add_zero_attn are not defined for linear attention")
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads

        # parameters in torch's order, so that one seed gives both modules the same values
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

        self.window = window
        self.layout = layout
        self.backend = backend
        # a feature map with state (FavorFeatures' projection) is the submodule `feature_map`
        self._linear_spec = None if isinstance(linear, nn.Module) else linear
        if linear == "favor":
            # its projection buffer is float32 whatever dtype=, as FavorFeatures keeps it
            self.feature_map = FavorFeatures(self.head_dim).to(device=device)
        elif isinstance(linear, nn.Module):
            self.feature_map = linear
        if linear is not None and dropout > 0:
            logger.debug("MultiheadAttention: dropout=%s does not apply to linear attention (no attention "
                         "probabilities are formed)", dropout)
        self.last_path: Optional[str] = None
        self._logged = set()
        self._explaining = False           # set by explain(): forward stops before attending
        self.register_forward_pre_hook(_blocks_torch_fast_path)

    def __setstate__(self, state):
        # modules pickled (torch.save(model)) by an earlier effattn lack the attributes added since
        state.setdefault("last_path", None)
        state.setdefault("_logged", set())
        state.setdefault("_explaining", False)
        super().__setstate__(state)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a torch.nn.MultiheadAttention state dict has no FAVOR+ projection: the module keeps its own, so
        # that torch's state dicts load strictly (load_state_dict hands each module a copy of the dict)
        key = prefix + "feature_map.projection"
        if isinstance(self._modules.get("feature_map"), FavorFeatures) and key not in state_dict:
            state_dict[key] = self._modules["feature_map"].projection
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    @property
    def linear(self):
        """The ``linear=`` feature map this module was built with (None: softmax attention)."""
        if self._linear_spec is None and "feature_map" in self._modules:
            return self._modules["feature_map"]
        return self._linear_spec

    # ---- construction from torch ------------------------------------------------------------

    @classmethod
    def from_torch(cls, mha: nn.Module, *, share_parameters: bool = False, **variant) -> "MultiheadAttention":
        """An effattn module with the configuration, device, dtype, weights and train/eval mode of ``mha``
        (a ``torch.nn.MultiheadAttention`` or this class), and the given variant.

        Args:
            share_parameters: False (default): the weights are copied (``requires_grad`` too). True: the
                new module holds ``mha``'s own ``Parameter`` objects, so that an optimizer, a frozen
                (``requires_grad=False``) weight or a weight tied elsewhere stays as it is and nothing is
                copied; what :func:`effattn.swap_attention` does.
            **variant: ``window``, ``layout``, ``linear``, ``backend``.
        """
        unknown = sorted(set(variant) - set(VARIANT_KEYS))
        if unknown:
            raise TypeError(f"MultiheadAttention.from_torch: unknown variant keys {unknown}; expected "
                            f"{', '.join(VARIANT_KEYS)}")
        ref = mha.in_proj_weight if mha.in_proj_weight is not None else mha.q_proj_weight
        new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim,
                  vdim=mha.vdim, batch_first=mha.batch_first, device=ref.device, dtype=ref.dtype, **variant)
        state = mha.state_dict()
        # the attention's own parameters; a feature map's (FAVOR+ projection, a learned map) belongs to the
        # variant and is carried only when both modules have it
        own = [(name, p) for name, p in mha.named_parameters() if not name.startswith("feature_map.")]
        if share_parameters:
            for name, p in own:
                owner_name, _, attr = name.rpartition(".")
                owner = new.get_submodule(owner_name)
                if attr not in owner._parameters or owner._parameters[attr].shape != p.shape:
                    raise RuntimeError(f"MultiheadAttention.from_torch: no parameter {name} of shape "
                                       f"{tuple(p.shape)} in the new module")
                owner._parameters[attr] = p
                state.pop(name, None)
        missing, unexpected = new.load_state_dict(state, strict=False)
        shared = {name for name, _ in own} if share_parameters else set()
        missing = [m for m in missing if not m.startswith("feature_map.") and m not in shared]
        unexpected = [u for u in unexpected if not u.startswith("feature_map.")]
        if missing or unexpected:
            raise RuntimeError(f"MultiheadAttention.from_torch: state dict mismatch, missing {missing}, "
                               f"unexpected {unexpected}")
        if not share_parameters:
            new_params = dict(new.named_parameters())
            for name, p in own:
                new_params[name].requires_grad_(p.requires_grad)
        new.train(mha.training)
        return new

    def variant(self) -> dict:
        """The extras this module was built with (only those that differ from the defaults)."""
        out = {}
        for key, default in (("window", None), ("layout", None), ("linear", None), ("backend", "auto")):
            val = getattr(self, key)
            if val is not default and val != default:
                out[key] = val
        return out

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if not self._qkv_same_embed_dim:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        parts.append(f"batch_first={self.batch_first}")
        for key, val in self.variant().items():
            parts.append(f"{key}={val!r}" if isinstance(val, (str, int, tuple)) else f"{key}={type(val).__name__}")
        return ", ".join(parts)

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, cache: Optional[KVCache] = None,
                memory: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """``(L, E)`` unbatched, ``(L, N, E)`` or with ``batch_first`` ``(N, L, E)`` inputs, as in torch;
        returns ``(output, weights)`` with ``weights`` ``(N, L, S)`` (averaged over heads) or
        ``(N, H, L, S)``, or None when ``need_weights=False``. ``cache=`` and ``memory=``: see the
        class docstring."""
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal, cache, memory)
        fn = "MultiheadAttention"
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{fn}: query, key, value must all be 2-D (unbatched) or 3-D, got "
                             f"{query.dim()}-D, {key.dim()}-D, {value.dim()}-D")
        batched = query.dim() == 3
        same_input = query is key and key is value      # self-attention: one packed projection
        if memory is not None and memory.dim() != query.dim():
            raise ValueError(f"{fn}: memory must have the same layout as key ({query.dim()}-D), got "
                             f"{memory.dim()}-D")
        # everything below works on (B, L, E)
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            memory = memory.unsqueeze(0) if memory is not None else None
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:
                    raise ValueError(f"{fn}: for unbatched inputs key_padding_mask must be 1-D (S,), got shape "
                                     f"{tuple(key_padding_mask.shape)}")
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
            memory = memory.transpose(0, 1) if memory is not None else None
        B, Lq, E = query.shape
        if E != self.embed_dim:
            raise ValueError(f"{fn}: query has embedding dim {E}, expected embed_dim={self.embed_dim}")
        if key.shape[0] != B or value.shape[0] != B or key.shape[1] != value.shape[1]:
            raise ValueError(f"{fn}: key {tuple(key.shape)} and value {tuple(value.shape)} must share batch and "
                             f"sequence length with each other and the batch of query {tuple(query.shape)}")
        if key.shape[2] != self.kdim or value.shape[2] != self.vdim:
            raise ValueError(f"{fn}: key/value embedding dims must be kdim={self.kdim}, vdim={self.vdim}; got "
                             f"{key.shape[2]}, {value.shape[2]}")
        if cache is not None and memory is not None:
            raise ValueError(f"{fn}: pass cache= (decoding) or memory= (segment memory), not both")
        causal = bool(is_causal)
        kpm = key_padding_mask
        if kpm is not None and kpm.dtype != torch.bool:
            if not torch.is_floating_point(kpm):
                raise TypeError(f"{fn}: key_padding_mask must be bool (True = ignore) or float (additive), got "
                                f"{kpm.dtype}")
            kpm = _as_bool_padding(kpm)

        n_mem = 0
        if memory is not None:
            if self.kdim != self.vdim:
                raise ValueError(f"{fn}: memory= needs kdim == vdim (it stands for both key and value inputs)")
            memory = memory.detach()                   # Transformer-XL: no gradient into the memory
            if memory.shape[0] != B or memory.shape[2] != self.kdim:
                raise ValueError(f"{fn}: memory must be shaped like key, got {tuple(memory.shape)} (batch-first "
                                 f"view) for key {tuple(key.shape)}")
            n_mem = memory.shape[1]
            key, value = torch.cat([memory, key], dim=1), torch.cat([memory, value], dim=1)
            same_input = False
        S = key.shape[1]
        if kpm is not None:
            if kpm.dim() != 2 or kpm.shape[0] != B or kpm.shape[1] not in (S, S - n_mem):
                want = f"({B}, {S - n_mem})" + (f" or ({B}, {S})" if n_mem else "")
                raise ValueError(f"{fn}: key_padding_mask must have shape {want} (batch, keys), got "
                                 f"{tuple(kpm.shape)}")
            if kpm.shape[1] != S:                     # memory positions are never padding
                kpm = F.pad(kpm, (n_mem, 0), value=False if kpm.dtype == torch.bool else 0.0)

        q, k, v = self._project(query, key, value, same_input)
        H, D = self.num_heads, self.head_dim
        q = q.view(B, Lq, H, D).transpose(1, 2)                    # (B, H, Lq, D) views, no copy
        k = k.view(B, S, H, D).transpose(1, 2)
        v = v.view(B, S, H, D).transpose(1, 2)

        weights = None
        if self.linear is not None:
            out = self._linear_path(q, k, v, causal, kpm, attn_mask, need_weights, cache)
            path = "linear"
        else:
            if cache is not None:
                if attn_mask is not None:
                    raise ValueError(f"{fn}: attn_mask cannot be combined with cache= (its columns would have to "
                                     "follow the cache); use is_causal / window")
                if self.layout is not None:
                    raise ValueError(f"{fn}: a layout indexes the blocks of one call's queries and keys and does "
                                     "not follow positions across cached steps; it cannot be used with cache=")
                if self.bias_k is not None or self.add_zero_attn:
                    raise ValueError(f"{fn}: add_bias_kv / add_zero_attn cannot be used with cache=")
                if kpm is not None and kpm.dtype != torch.bool:
                    raise TypeError(f"{fn}: with cache= key_padding_mask must be bool")
                k, v, kpm = cache.append(k, v, kpm)
            Lk = k.shape[2]
            dropout_p = self.dropout if self.training else 0.0
            why = self._why_reference(attn_mask, kpm, need_weights, causal, Lq, Lk)
            layout = self._layout_for(Lq, Lk)
            if why is None:
                call = dict(causal=causal, window=self.window, layout=layout, key_padding_mask=kpm,
                            dropout_p=dropout_p)
                if self._explaining:
                    self._stop("fused", "attention", q, k, v, call)
                out = attention(q, k, v, **call, backend=self.backend)
                path = "fused"
            else:
                if self._explaining:
                    self._stop("reference: " + why, None, q, k, v, None)
                out, weights = self._reference_path(q, k, v, attn_mask, kpm, causal, layout, dropout_p)
                path = "reference: " + why
            if cache is not None:
                cache.seen += Lq
                left, _ = normalize_window(self.window, causal)
                if left >= 0:
                    cache.keep_last(left)
        if cache is not None and self.linear is not None:
            cache.seen += Lq
        self._record(path)

        if batched and not self.batch_first:   # (L, N, E) comes out contiguous, as torch's does
            out = self.out_proj(out.permute(2, 0, 1, 3).reshape(Lq, B, E))
        else:
            out = self.out_proj(out.transpose(1, 2).reshape(B, Lq, E))
        if weights is not None:
            weights = weights.to(out.dtype)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        if not batched:
            out = out.squeeze(0)
        return out, (weights if need_weights else None)

    def explain(self, query: Tensor, key: Tensor, value: Tensor, **forward_kwargs) -> ForwardExplanation:
        """Which path ``self(query, key, value, **forward_kwargs)`` would take and, for a fused or linear
        path, :func:`effattn.explain`'s report on the effattn call it would make (which backend
        ``"auto"`` picks and why the others cannot serve).

        Runs the input checks and projections (under ``no_grad``) but not the attention; a ``cache=``
        is left as it was and ``last_path`` is not changed.

        Examples::

            >>> print(mha.explain(x, x, x, attn_mask=mask))         # need_weights defaults to True
            MultiheadAttention: reference: need_weights=True path: a dense softmax over the (1024, 1024) score
            matrix in torch, O(Lq*Lk) memory; to get the fused kernels, pass need_weights=False (...)
            >>> print(mha.explain(x, x, x, is_causal=True, need_weights=False))
            MultiheadAttention: fused path, effattn.attention on (1024, 1024)
            effattn.attention: backend='auto' picks triton
            ...
        """
        cache = forward_kwargs.get("cache")
        if cache is not None:
            # a step rebinds the cache's tensors (torch.cat, slicing), never writes into them: a shallow copy
            # takes the step and the caller's cache stays as it was
            forward_kwargs["cache"] = copy.copy(cache)
        self._explaining = True
        try:
            with torch.no_grad():
                self.forward(query, key, value, **forward_kwargs)
        except _Explained as stop:
            return stop.explanation
        finally:
            self._explaining = False
        raise RuntimeError("MultiheadAttention.explain: forward returned without reaching attention")

    def _stop(self, path: str, op: Optional[str], q: Tensor, k: Tensor, v: Tensor, call: Optional[dict]):
        report = explain_call(q, k, v, op=op, **call) if op is not None else None
        raise _Explained(ForwardExplanation(path, op, report, self.backend, (q.shape[2], k.shape[2])))

    # ---- pieces of forward ------------------------------------------------------------------

    def _project(self, query, key, value, same_input: bool):
        """In-projections: (B, L, E) inputs -> q, k, v (B, L, E)."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if same_input:
                return F.linear(query, w, b).chunk(3, dim=-1)
            wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _why_reference(self, attn_mask, kpm, need_weights, causal, Lq, Lk) -> Optional[str]:
        """None when the fused kernel serves the call, else why it cannot (for last_path)."""
        if need_weights:
            return "need_weights=True"
        if self.bias_k is not None or self.add_zero_attn:
            return "add_bias_kv/add_zero_attn"
        if kpm is not None and kpm.dtype != torch.bool:
            return "float key_padding_mask"
        if attn_mask is not None and not (causal and Lq == Lk):
            return ("float" if torch.is_floating_point(attn_mask) else "bool") + " attn_mask"
        return None

    def _layout_for(self, Lq: int, Lk: int) -> Optional[BlockLayout]:
        lay = self.layout
        if lay is None:
            return None
        if not isinstance(lay, BlockLayout):
            lay = lay(Lq, Lk)
            if not isinstance(lay, BlockLayout):
                raise TypeError(f"MultiheadAttention: the layout callable returned {type(lay).__name__}, "
                                "expected an effattn.layouts.BlockLayout")
        bs = lay.block_size
        _, nqb, nkb = lay.shape
        if (nqb, nkb) != (-(-Lq // bs), -(-Lk // bs)) or lay.num_heads not in (1, self.num_heads):
            raise ValueError(f"MultiheadAttention: layout of shape {lay.shape} (block {bs}) does not fit this call "
                             f"with Lq={Lq} queries and Lk={Lk} keys and {self.num_heads} heads: it needs "
                             f"(1 or {self.num_heads}, {-(-Lq // bs)}, {-(-Lk // bs)}). For inputs of varying "
                             "length pass layout=lambda Lq, Lk: ... building one per call")
        return lay

    def _reference_path(self, q, k, v, attn_mask, kpm, causal, layout, dropout_p):
        """Dense softmax with torch's mask semantics (bool True = blocked, float = added), plus the
        module's window / layout, and bias_k / zero-attention keys that every query sees."""
        B, H, Lq, D = q.shape
        Lk = k.shape[2]
        fn = "MultiheadAttention"
        structural_causal = causal and attn_mask is None   # with a mask, the mask itself is used
        visible = Rule.of(Lq, Lk, causal=structural_causal, window=self.window,
                          layout=layout).materialize(device=q.device)         # (1, Hl, Lq, Lk)
        bias = None
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (Lq, Lk):
                    raise ValueError(f"{fn}: 2-D attn_mask must have shape (L, S)=({Lq}, {Lk}), got "
                                     f"{tuple(attn_mask.shape)}")
                am = attn_mask[None, None]
            elif attn_mask.dim() == 3:
                if tuple(attn_mask.shape) != (B * H, Lq, Lk):
                    raise ValueError(f"{fn}: 3-D attn_mask must have shape (N*num_heads, L, S)=({B * H}, {Lq}, "
                                     f"{Lk}), got {tuple(attn_mask.shape)}")
                am = attn_mask.view(B, H, Lq, Lk)
            else:
                raise ValueError(f"{fn}: attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
            if am.dtype == torch.bool:
                visible = ~am if visible is None else visible & ~am
            elif torch.is_floating_point(am):
                bias = am
            else:
                raise TypeError(f"{fn}: attn_mask must be bool (True = blocked) or float (additive), got {am.dtype}")
        if kpm is not None:
            if kpm.dtype == torch.bool:
                keep = ~kpm[:, None, None, :]
                visible = keep if visible is None else visible & keep
            else:
                add = kpm[:, None, None, :]
                bias = add if bias is None else bias + add
        extra = 0
        if self.bias_k is not None:                   # torch appends them after the keys, for every query
            k = torch.cat([k, self.bias_k.view(1, H, 1, D).expand(B, H, 1, D).to(k.dtype)], dim=2)
            v = torch.cat([v, self.bias_v.view(1, H, 1, D).expand(B, H, 1, D).to(v.dtype)], dim=2)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(B, H, 1, D)], dim=2)
            extra += 1
        if extra:
            if visible is not None:
                visible = F.pad(visible, (0, extra), value=True)
            if bias is not None:
                bias = F.pad(bias, (0, extra), value=0.0)
        return dense_attention(q, k, v, visible=visible, bias=bias, dropout_p=dropout_p)

    def _linear_path(self, q, k, v, causal, kpm, attn_mask, need_weights, cache):
        fn = "MultiheadAttention"
        if attn_mask is not None:
            raise ValueError(f"{fn}: linear attention cannot apply an arbitrary attn_mask (it never forms the score "
                             "matrix); use is_causal=True for causal masking")
        if need_weights:
            raise ValueError(f"{fn}: linear attention has no attention weights; call with need_weights=False")
        if kpm is not None and kpm.dtype != torch.bool:
            raise TypeError(f"{fn}: linear attention needs a bool key_padding_mask (True = padding), got {kpm.dtype}")
        phi = self._modules["feature_map"] if "feature_map" in self._modules else self._linear_spec
        if cache is not None and cache.keys is not None:
            raise ValueError(f"{fn}: this KVCache holds softmax keys/values; use one cache per module")
        state = cache.state if cache is not None else None
        out_dtype = q.dtype
        if kpm is not None:
            # padded keys must add nothing to the sums S and z: compute the features here, zero those of
            # padded keys, and hand linear_attention the features with the identity map
            fmap = resolve_feature_map(phi)
            fq, fk = fmap(q), fmap(k) * (~kpm)[:, None, :, None]
            if fq.shape[-1] > MAX_FEATURES:
                raise ValueError(f"{fn}: key_padding_mask with linear attention needs at most {MAX_FEATURES} "
                                 f"features, this feature map gives {fq.shape[-1]}")
            q, k, v, phi = fq, fk.to(fq.dtype), v.to(fq.dtype), "identity"
        if self._explaining:
            self._stop("linear", "linear_attention", q, k, v, dict(causal=causal, feature_map=phi, initial_state=state))
        res = linear_attention(q, k, v, causal=causal, feature_map=phi, initial_state=state,
                               return_state=cache is not None, backend=self.backend)
        if cache is not None:
            res, cache.state = res
        return res.to(out_dtype)

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                        is_causal, cache, memory):
        """Nested (ragged) self-attention input, as torch.nn.TransformerEncoder hands its layers in
        inference: padded, run with a key padding mask, and nested again."""
        if not (query is key and key is value) or key_padding_mask is not None or attn_mask is not None \
                or cache is not None or memory is not None:
            raise ValueError("MultiheadAttention: nested tensor input is supported for self-attention "
                             "(query is key is value) without masks, cache or memory only")
        if not self.batch_first:
            raise ValueError("MultiheadAttention: nested tensor input needs batch_first=True")
        lengths = [t.shape[0] for t in query.unbind()]
        x = torch.nested.to_padded_tensor(query, 0.0)
        kpm = torch.arange(x.shape[1], device=x.device)[None, :] >= torch.tensor(lengths, device=x.device)[:, None]
        out, weights = self.forward(x, x, x, key_padding_mask=kpm, need_weights=need_weights,
                                    average_attn_weights=average_attn_weights, is_causal=is_causal)
        out = torch.nested.as_nested_tensor([out[i, :n] for i, n in enumerate(lengths)], layout=query.layout)
        return out, weights

    def _record(self, path: str) -> None:
        if torch.compiler.is_compiling():
            return
        self.last_path = path
        if path.startswith("reference") and path not in self._logged:
            self._logged.add(path)
            logger.debug("effattn.nn.MultiheadAttention: dense O(L^2) %s path (fused kernels cannot serve this call)",
                         path)
