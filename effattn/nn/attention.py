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
change to leave a reference path, and which backend would serve a fused one (:func:`effattn.explain`;
the report is `explanation.ForwardExplanation`). The variant arguments are checked by `variants`.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..backends.torch.dense import dense_attention
from ..feature_maps import FavorFeatures, resolve_feature_map
from ..functional import attention
from ..functional import explain as explain_call
from ..layouts import BlockLayout
from ..linear import linear_attention
from ..paged import PagedKVCache
from ..visibility import Rule, normalize_window
from .cache import KVCache
from .explanation import ForwardExplanation
from .variants import VARIANT_KEYS, check_variant

logger = logging.getLogger("effattn.nn")

MAX_FEATURES = 256    # linear attention's head-dim limit, met by precomputed features (padding path)


def _blocks_torch_fast_path(module, args):
    """A no-op forward pre-hook. ``torch.nn.TransformerEncoderLayer``'s fused inference path reads
    ``self_attn.in_proj_weight`` and never calls ``self_attn``; it is skipped when any submodule has a
    hook, so this keeps a variant (window, linear, ...) from being silently bypassed."""
    return None


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


@dataclass
class _Step:
    """One call's inputs after `_canonicalize`: batch-first ``(B, L, E)``, memory prepended to key and
    value, a 0/-inf float key padding mask turned bool (``kpm`` covers memory + keys)."""
    query: Tensor
    key: Tensor
    value: Tensor
    kpm: Optional[Tensor]
    attn_mask: Optional[Tensor]
    causal: bool
    batched: bool
    same_input: bool          # query is key is value: one packed in-projection


@dataclass
class _Plan:
    """The path a call takes (see the module docstring) and, for the reference path, every reason."""
    path: str                 # "fused" | "linear" | "reference: <first reason>"
    op: Optional[str]         # the effattn function called, None on the reference path
    reasons: List[str]
    Lq: int
    Lk: int                   # cached keys and memory included


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
        position_bias: a module whose ``forward()`` returns score terms for :func:`effattn.attention`'s
            ``bias`` (:class:`effattn.nn.ALiBi`, :class:`effattn.nn.T5RelativeBias`,
            :class:`effattn.nn.AdaptiveSpan`, or a list of them in an ``nn.ModuleList``), evaluated at
            each call; a submodule, so its parameters train with the attention. Softmax only.
        context_parallel: an :class:`effattn.distributed.ContextParallel`: inputs are this rank's shard
            of the sequence and self-attention runs over the whole sequence (see effattn.distributed).

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
            Or an :class:`effattn.nn.PagedKVCache` (softmax, fused path): the batch rows are its bound
            sequences and each step runs the paged attention over their pages (rows of different
            lengths each continue at their own; no ``key_padding_mask``, ``position_bias``,
            ``need_weights`` or training dropout).
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
                 window=None, layout=None, linear=None, backend="auto", position_bias=None, context_parallel=None):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"MultiheadAttention: embed_dim and num_heads must be > 0, got embed_dim={embed_dim} "
                             f"and num_heads={num_heads}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"MultiheadAttention: embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        check_variant("MultiheadAttention", window=window, layout=layout, linear=linear, backend=backend,
                      context_parallel=context_parallel)
        if isinstance(linear, FavorFeatures) and linear.head_dim != embed_dim // num_heads:
            raise ValueError(f"MultiheadAttention: linear=FavorFeatures(head_dim={linear.head_dim}) does not match "
                             f"head_dim = embed_dim // num_heads = {embed_dim // num_heads}")
        if position_bias is not None and not isinstance(position_bias, nn.Module):
            raise TypeError(f"MultiheadAttention: position_bias must be an nn.Module returning score terms (e.g. "
                            f"effattn.nn.ALiBi), got {type(position_bias).__name__}")
        if position_bias is not None and linear is not None:
            raise ValueError("MultiheadAttention: position_bias adds to the softmax scores; linear attention forms "
                             "none")
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
        self.context_parallel = context_parallel
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
        self.position_bias = position_bias
        self.last_path: Optional[str] = None
        self._logged = set()
        self.register_forward_pre_hook(_blocks_torch_fast_path)

    def __setstate__(self, state):
        # modules pickled (torch.save(model)) by an earlier effattn lack the attributes added since
        state.setdefault("last_path", None)
        state["_modules"].setdefault("position_bias", None)
        state.setdefault("_logged", set())
        state.pop("_explaining", None)         # effattn < 0.2 stopped forward with it to explain a call
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
            **variant: ``window``, ``layout``, ``linear``, ``backend``, ``context_parallel``.
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
        for key, default in (("window", None), ("layout", None), ("linear", None), ("backend", "auto"),
                             ("context_parallel", None)):
            val = getattr(self, key, default)
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
                is_causal: bool = False, *, cache: Optional[Union[KVCache, PagedKVCache]] = None,
                memory: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """``(L, E)`` unbatched, ``(L, N, E)`` or with ``batch_first`` ``(N, L, E)`` inputs, as in torch;
        returns ``(output, weights)`` with ``weights`` ``(N, L, S)`` (averaged over heads) or
        ``(N, H, L, S)``, or None when ``need_weights=False``. ``cache=`` and ``memory=``: see the
        class docstring."""
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal, cache, memory)
        step = self._canonicalize(query, key, value, key_padding_mask, attn_mask, is_causal, cache, memory)
        q, k, v = self._project(step)                                  # (B, H, L, D) views
        plan = self._plan(step, need_weights, cache)
        out, weights = self._attend(plan, step, q, k, v, cache)
        self._record(plan.path)
        return self._assemble(step, out, weights, need_weights, average_attn_weights)

    def explain(self, query: Tensor, key: Tensor, value: Tensor, **forward_kwargs) -> ForwardExplanation:
        """Which path ``self(query, key, value, **forward_kwargs)`` would take, every reason it leaves
        the fused kernels, and for a fused or linear path :func:`effattn.explain`'s report on the
        effattn call it would make (which backend ``"auto"`` picks and why the others cannot serve).

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
        sig = inspect.signature(self.forward).bind(query, key, value, **forward_kwargs)
        sig.apply_defaults()
        a = sig.arguments
        if a["query"].is_nested:
            raise ValueError("MultiheadAttention.explain: nested tensor input is not supported; explain the "
                             "padded call")
        # a step writes into the cache's buffers: a copy takes the step and the caller's cache stays as it was
        cache = a["cache"].copy() if isinstance(a["cache"], KVCache) else a["cache"]   # a paged cache: `preview`
        with torch.no_grad():
            step = self._canonicalize(query, key, value, a["key_padding_mask"], a["attn_mask"], a["is_causal"],
                                      cache, a["memory"])
            q, k, v = self._project(step)
            plan = self._plan(step, a["need_weights"], cache)
            report = None
            if plan.op == "paged_attention":
                table, lens = cache.preview(k, v)
                report = explain_call(q, cache.k_pages, cache.v_pages, op="paged_attention", block_table=table,
                                      seqlens=lens, causal=step.causal, window=self.window, backend=self.backend)
            elif plan.op == "attention":
                left = normalize_window(self.window, step.causal)[0] if cache is not None else -1
                k, v, kpm, window = self._cached(step, k, v, cache, left)
                report = explain_call(q, k, v, op="attention", **self._fused_kwargs(plan, step, kpm, window))
            elif plan.op == "linear_attention":
                q, k, v, phi, state = self._linear_inputs(step, q, k, v, cache)
                report = explain_call(q, k, v, op="linear_attention", causal=step.causal, feature_map=phi,
                                      initial_state=state)
        return ForwardExplanation(plan.path, plan.op, report, self.backend, (plan.Lq, plan.Lk), plan.reasons)

    # ---- pieces of forward ------------------------------------------------------------------

    def _canonicalize(self, query, key, value, kpm, attn_mask, is_causal, cache, memory) -> _Step:
        """Checks the inputs and brings them to batch-first ``(B, L, E)``; memory is prepended to key
        and value, and a float key padding mask of 0 / -inf becomes bool."""
        fn = "MultiheadAttention"
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{fn}: query, key, value must all be 2-D (unbatched) or 3-D, got "
                             f"{query.dim()}-D, {key.dim()}-D, {value.dim()}-D")
        batched = query.dim() == 3
        same_input = query is key and key is value      # self-attention: one packed projection
        if memory is not None and memory.dim() != query.dim():
            raise ValueError(f"{fn}: memory must have the same layout as key ({query.dim()}-D), got "
                             f"{memory.dim()}-D")
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            memory = memory.unsqueeze(0) if memory is not None else None
            if kpm is not None:
                if kpm.dim() != 1:
                    raise ValueError(f"{fn}: for unbatched inputs key_padding_mask must be 1-D (S,), got shape "
                                     f"{tuple(kpm.shape)}")
                kpm = kpm.unsqueeze(0)
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
        if cache is not None and not isinstance(cache, (KVCache, PagedKVCache)):
            raise TypeError(f"{fn}: cache must be an effattn.nn.KVCache or PagedKVCache, got {type(cache).__name__}")
        if cache is not None and memory is not None:
            raise ValueError(f"{fn}: pass cache= (decoding) or memory= (segment memory), not both")
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
        return _Step(query, key, value, kpm, attn_mask, bool(is_causal), batched, same_input)

    def _project(self, step: _Step) -> Tuple[Tensor, Tensor, Tensor]:
        """In-projections of the ``(B, L, E)`` inputs, split into heads: q, k, v ``(B, H, L, D)`` views."""
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
        if self._qkv_same_embed_dim and step.same_input:
            q, k, v = F.linear(step.query, self.in_proj_weight, b).chunk(3, dim=-1)
        else:
            if self._qkv_same_embed_dim:
                w = self.in_proj_weight
                wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
            else:
                wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            q, k, v = F.linear(step.query, wq, bq), F.linear(step.key, wk, bk), F.linear(step.value, wv, bv)
        B, Lq, S = step.query.shape[0], step.query.shape[1], step.key.shape[1]
        return (q.view(B, Lq, H, D).transpose(1, 2), k.view(B, S, H, D).transpose(1, 2),
                v.view(B, S, H, D).transpose(1, 2))

    def _plan(self, step: _Step, need_weights: bool, cache: Optional[KVCache]) -> _Plan:
        """Chooses the path: linear, fused, or the dense reference with every reason it is needed.
        Raises for combinations no path can serve (the same errors whether called or explained)."""
        fn = "MultiheadAttention"
        Lq, S = step.query.shape[1], step.key.shape[1]
        if self.linear is not None:
            if step.attn_mask is not None:
                raise ValueError(f"{fn}: linear attention cannot apply an arbitrary attn_mask (it never forms the "
                                 "score matrix); use is_causal=True for causal masking")
            if need_weights:
                raise ValueError(f"{fn}: linear attention has no attention weights; call with need_weights=False")
            if step.kpm is not None and step.kpm.dtype != torch.bool:
                raise TypeError(f"{fn}: linear attention needs a bool key_padding_mask (True = padding), got "
                                f"{step.kpm.dtype}")
            if isinstance(cache, PagedKVCache):
                raise ValueError(f"{fn}: a PagedKVCache holds softmax keys/values; a linear module keeps its state "
                                 "(S, z) in an effattn.nn.KVCache")
            if cache is not None and cache.keys is not None:
                raise ValueError(f"{fn}: this KVCache holds softmax keys/values; use one cache per module")
            return _Plan("linear", "linear_attention", [], Lq, S)
        if cache is not None:
            if step.attn_mask is not None:
                raise ValueError(f"{fn}: attn_mask cannot be combined with cache= (its columns would have to "
                                 "follow the cache); use is_causal / window")
            if self.layout is not None:
                raise ValueError(f"{fn}: a layout indexes the blocks of one call's queries and keys and does "
                                 "not follow positions across cached steps; it cannot be used with cache=")
            if self.bias_k is not None or self.add_zero_attn:
                raise ValueError(f"{fn}: add_bias_kv / add_zero_attn cannot be used with cache=")
            if step.kpm is not None and step.kpm.dtype != torch.bool:
                raise TypeError(f"{fn}: with cache= key_padding_mask must be bool")
        if isinstance(cache, PagedKVCache):
            return self._paged_plan(step, need_weights, cache)
        Lk = S + (len(cache) if cache is not None else 0)
        reasons = []
        if need_weights:
            reasons.append("need_weights=True")
        if self.bias_k is not None or self.add_zero_attn:
            reasons.append("add_bias_kv/add_zero_attn")
        if step.kpm is not None and step.kpm.dtype != torch.bool:
            reasons.append("float key_padding_mask")
        if step.attn_mask is not None and not (step.causal and Lq == Lk):
            reasons.append(("float" if torch.is_floating_point(step.attn_mask) else "bool") + " attn_mask")
        if reasons:
            return _Plan("reference: " + reasons[0], None, reasons, Lq, Lk)
        return _Plan("fused", "attention", [], Lq, Lk)

    def _paged_plan(self, step: _Step, need_weights: bool, cache: PagedKVCache) -> _Plan:
        """The paged cache's one path (the fused paged attention), or an error naming what it cannot take."""
        fn = "MultiheadAttention"
        why = [name for name, on in (("need_weights=True", need_weights),
                                     ("key_padding_mask", step.kpm is not None),
                                     ("position_bias", self.position_bias is not None),
                                     ("dropout in training", self.training and self.dropout > 0)) if on]
        if why:
            raise ValueError(f"{fn}: a PagedKVCache runs the paged attention, which takes no {why[0]} (rows of "
                             "different lengths are sequences of their own: PagedKVCache.bind); use need_weights="
                             "False, eval(), or an effattn.nn.KVCache")
        Lq = step.query.shape[1]
        return _Plan("fused", "paged_attention", [], Lq, step.key.shape[1] + cache.held())

    def _fused_kwargs(self, plan: _Plan, step: _Step, kpm: Optional[Tensor], window) -> dict:
        return dict(causal=step.causal, window=window, layout=self._layout_for(plan.Lq, plan.Lk),
                    key_padding_mask=kpm, dropout_p=self.dropout if self.training else 0.0,
                    bias=self._position_terms())

    def _position_terms(self):
        """The ``position_bias`` module's score terms for this call (a ModuleList's as a list), or None."""
        m = self.position_bias
        if m is None:
            return None
        return [x() for x in m] if isinstance(m, nn.ModuleList) else m()

    def _cached(self, step: _Step, k, v, cache: Optional[KVCache], left: int):
        """``(k, v, kpm, window)`` the attention reads: with a cache, this step's keys written into it
        and the cached ones read back, with the window (its left reach ``left``) left to the cache's
        mask where it applies it per row (`KVCache.write`)."""
        if cache is None:
            return k, v, step.kpm, self.window
        k, v, kpm, window_masked = cache.write(k, v, step.kpm, left)
        return k, v, kpm, (None if window_masked else self.window)

    def _attend(self, plan: _Plan, step: _Step, q, k, v, cache) -> Tuple[Tensor, Optional[Tensor]]:
        """Runs the planned path: ``(out (B, H, Lq, D), weights (B, H, Lq, Lk) or None)``."""
        if getattr(self, "context_parallel", None) is not None:
            return self.context_parallel.module_attention(self, plan, step, q, k, v, cache), None
        if plan.op == "linear_attention":
            q, k, v, phi, state = self._linear_inputs(step, q, k, v, cache)
            res = linear_attention(q, k, v, causal=step.causal, feature_map=phi, initial_state=state,
                                   return_state=cache is not None, backend=self.backend)
            if cache is not None:
                res, cache.state = res
                cache.seen += plan.Lq
            return res.to(step.query.dtype), None
        if plan.op == "paged_attention":
            out = cache.attend(q, k, v, causal=step.causal, window=self.window, backend=self.backend)
            return out, None
        # the window's left reach, normalized once per call (the cache masks and trims by it)
        left = normalize_window(self.window, step.causal)[0] if cache is not None else -1
        k, v, kpm, window = self._cached(step, k, v, cache, left)
        if plan.op == "attention":
            out, weights = attention(q, k, v, **self._fused_kwargs(plan, step, kpm, window), backend=self.backend), None
        else:
            out, weights = self._reference_path(q, k, v, step.attn_mask, kpm, step.causal,
                                                self._layout_for(plan.Lq, plan.Lk),
                                                self.dropout if self.training else 0.0, window)
        if cache is not None:
            cache.seen += plan.Lq
            if left >= 0:
                cache.keep_last(left)
        return out, weights

    def _assemble(self, step: _Step, out: Tensor, weights: Optional[Tensor], need_weights: bool,
                  average_attn_weights: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """Heads back together, out-projection, and torch's output layout."""
        B, H, Lq, _ = out.shape
        E = self.embed_dim
        if step.batched and not self.batch_first:   # (L, N, E) comes out contiguous, as torch's does
            out = self.out_proj(out.permute(2, 0, 1, 3).reshape(Lq, B, E))
        else:
            out = self.out_proj(out.transpose(1, 2).reshape(B, Lq, E))
        if weights is not None:
            weights = weights.to(out.dtype)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not step.batched:
                weights = weights.squeeze(0)
        if not step.batched:
            out = out.squeeze(0)
        return out, (weights if need_weights else None)

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

    def _reference_path(self, q, k, v, attn_mask, kpm, causal, layout, dropout_p, window):
        """Dense softmax with torch's mask semantics (bool True = blocked, float = added), plus the
        module's window / layout, and bias_k / zero-attention keys that every query sees."""
        B, H, Lq, D = q.shape
        Lk = k.shape[2]
        fn = "MultiheadAttention"
        structural_causal = causal and attn_mask is None   # with a mask, the mask itself is used
        visible = Rule.of(Lq, Lk, causal=structural_causal, window=window,
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
        if self.position_bias is not None:             # the terms' values at every (query, key)
            from ..score import dense_values
            add = dense_values(self._position_terms(), B, H, Lq, Lk, q.device)
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

    def _linear_inputs(self, step: _Step, q, k, v, cache):
        """``(q, k, v, feature_map, initial_state)`` of the linear call. With a key padding mask the
        features are computed here and those of padded keys zeroed (they must add nothing to S and z),
        and linear_attention gets the features with the identity map."""
        phi = self._modules["feature_map"] if "feature_map" in self._modules else self._linear_spec
        state = cache.state if cache is not None else None
        if step.kpm is None:
            return q, k, v, phi, state
        fmap = resolve_feature_map(phi)
        fq, fk = fmap(q), fmap(k) * (~step.kpm)[:, None, :, None]
        if fq.shape[-1] > MAX_FEATURES:
            raise ValueError(f"MultiheadAttention: key_padding_mask with linear attention needs at most {MAX_FEATURES} "
                             f"features, this feature map gives {fq.shape[-1]}")
        return fq, fk.to(fq.dtype), v.to(fq.dtype), "identity", state

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
