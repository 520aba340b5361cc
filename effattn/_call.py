"""Input validation for the public functions, and the normalized call every backend receives.

All argument checking lives here, so that every backend (torch reference, Triton, CUDA) sees the
same, already-validated description of a call and the error messages are the same whatever the
backend. The visibility rule (window, causal, layout, padding; bottom-right alignment) is defined in
``effattn.visibility``; a call carries its canonical `Rule`, built once here: lengths, ``left`` /
``right`` (-1 = unbounded, causal folded in as ``right = 0``, a window wider than the sequence
clamped to none) and the layout's block mask; plus the key padding mask.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .feature_maps import NAMED_FEATURE_MAPS, FavorFeatures, feature_map_name, resolve_feature_map
from .layouts import BlockLayout
from .numerics import compute_dtype, draw_seed
from .packed import packing
from .score import make_score_terms
from .visibility import Rule, clamp_window, normalize_window

SOFTMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def needs_grad(*ts) -> bool:
    """Whether autograd will want gradients of any of the tensors ``ts`` (None entries ignored)."""
    if torch.is_grad_enabled():
        for t in ts:                     # a loop, not any(generator): this runs on every eager call
            if t is not None and t.requires_grad:
                return True
    return False


def forward_only_reason(call) -> Optional[str]:
    """Why a forward-only kernel without dropout (the split-KV decode kernels) cannot serve an
    attention call, or None when it can."""
    if call.dropout_p > 0:
        return "dropout"
    if needs_grad(call.q, call.k, call.v):
        return "gradients needed: inputs require grad (the decode kernels are forward only)"
    return None


def _fail(kind, msg):
    raise kind(msg)


# The keyword arguments of the public functions (explain takes those of its op, without backend).
ATTENTION_KEYWORDS = ("causal", "window", "layout", "key_padding_mask", "scale", "dropout_p", "return_lse",
                      "softcap", "sinks", "bias", "cu_seqlens", "max_seqlen", "positions", "out_dtype", "backend",
                      "block_table", "seqlens")
LINEAR_KEYWORDS = ("causal", "feature_map", "normalize", "eps", "initial_state", "return_state", "cu_seqlens",
                   "max_seqlen", "backend")


def check_keywords(fn: str, given, valid) -> None:
    """TypeError naming the first keyword of `given` not in `valid`, a close match, and the valid ones."""
    unknown = [k for k in given if k not in valid]
    if unknown:
        import difflib
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        _fail(TypeError, f"{fn}: unknown keyword argument {unknown[0]!r}{hint}; the valid ones are "
                         f"{', '.join(valid)}")


def check_qkv(q, k, v, fn: str):
    """Checks shapes/dtypes/devices shared by attention and linear_attention. Returns (B, H, Hkv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            _fail(ValueError, f"{fn}: {name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(TypeError, f"{fn}: q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if q.dtype not in SOFTMAX_DTYPES:
        _fail(TypeError, f"{fn}: unsupported dtype {q.dtype} for q/k/v; expected float16, bfloat16 or "
                         "float32 (float64 is served by the torch reference only)")
    if not (q.device == k.device == v.device):
        _fail(ValueError, f"{fn}: q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    Bv, Hv, Lv, Dv = v.shape
    if not (B == Bk == Bv):
        _fail(ValueError, f"{fn}: batch size mismatch: q has {B}, k has {Bk}, v has {Bv}")
    if Hkv != Hv:
        _fail(ValueError, f"{fn}: k and v must have the same number of heads, got k={Hkv}, v={Hv}")
    if Hkv == 0 or H % Hkv != 0:
        _fail(ValueError, f"{fn}: number of query heads H={H} must be a multiple of the key/value heads "
                          f"Hkv={Hkv} (grouped-query attention)")
    if Lk != Lv:
        _fail(ValueError, f"{fn}: k and v must have the same sequence length, got k={Lk}, v={Lv}")
    if D != Dk:
        _fail(ValueError, f"{fn}: q and k must have the same head dim, got q={D}, k={Dk}")
    for name, d in (("D (q/k head dim)", D), ("Dv (v head dim)", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            _fail(ValueError, f"{fn}: head dim {name}={d} out of range 1..{MAX_HEAD_DIM}")
    return B, H, Hkv


class OpArgs(NamedTuple):
    """The leading arguments every attention op takes (the torch reference, Triton's and CUDA's ops),
    named as the C++ params struct names them."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout_mask: Optional[torch.Tensor]
    layout_block: int
    key_padding_mask: Optional[torch.Tensor]
    seed: Optional[torch.Tensor]
    scale: float
    dropout_p: float
    window_left: int
    window_right: int


@dataclass
class AttnCall:
    """A validated softmax-attention call. Tensors keep the caller's strides (no copies)."""
    q: torch.Tensor                       # (B, H, Lq, D)
    k: torch.Tensor                       # (B, Hkv, Lk, D)
    v: torch.Tensor                       # (B, Hkv, Lk, Dv)
    causal: bool
    rule: Rule                            # the canonical visibility rule (window clamped, layout mask)
    layout: Optional[object]              # effattn.layouts.BlockLayout or None
    key_padding_mask: Optional[torch.Tensor]  # bool (B, Lk), True = ignore
    scale: float
    dropout_p: float
    return_lse: bool
    seed: Optional[torch.Tensor] = None   # int64 CPU tensor (2,), drawn from torch's default generator when dropout_p > 0
    # packed sequences / context-parallel chunks (effattn.packed.packing): the (q0, q1, k0, k1, q_offset)
    # work list of a call with cu_seqlens, positions or an fp32 output, the int32 cu_seqlens pair, the
    # positions (their offset is the rule's q_offset), an fp32 output dtype
    segments: Optional[tuple] = None
    cu_seqlens: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    positions: Optional[Tuple[int, int]] = None
    out_dtype: Optional[torch.dtype] = None
    max_seqlen: Optional[Tuple[int, int]] = None   # (max_q, max_k) of a packed call (effattn.packed.Packing)
    score: Optional[object] = None        # effattn.score.ScoreTerms (softcap, sinks, bias) or None
    # (first global head, global heads) of a head shard (context parallelism's Ulysses): dropout draws
    # at the global head index; None: the call's own heads
    heads: Optional[Tuple[int, int]] = None

    def drop_at(self) -> Tuple[int, int, int, int]:
        """(first row, first key, first head, heads) dropout draws at: query i, key j, head h of batch b
        draw at row ``q0 + i``, key ``k0 + j``, head ``b * heads + h0 + h`` (the positions and head
        shard of a context-parallel call; (0, 0, 0, H) for a plain one)."""
        q0, k0 = self.positions or (0, 0)
        h0, hg = self.heads or (0, self.H)
        return q0, k0, h0, hg

    @property
    def window_left(self) -> int:         # -1: unbounded
        return self.rule.left

    @property
    def window_right(self) -> int:        # -1: unbounded (causal folds in as 0)
        return self.rule.right

    def op_args(self) -> "OpArgs":
        """The attention ops' arguments, by name (the one place they are built from a call)."""
        lay = self.layout
        return OpArgs(self.q, self.k, self.v, lay.mask if lay is not None else None,
                      lay.block_size if lay is not None else 0, self.key_padding_mask, self.seed, self.scale,
                      self.dropout_p, self.rule.left, self.rule.right)

    @property
    def B(self): return self.q.shape[0]
    @property
    def H(self): return self.q.shape[1]
    @property
    def Hkv(self): return self.k.shape[1]
    @property
    def Lq(self): return self.q.shape[2]
    @property
    def Lk(self): return self.k.shape[2]
    @property
    def D(self): return self.q.shape[3]
    @property
    def Dv(self): return self.v.shape[3]

    def features(self):
        """Names of the features this call uses (read by backends' capability checks and explain)."""
        f = set()
        if self.causal: f.add("causal")
        if self.rule.left >= 0 or (self.rule.right >= 0 and not self.causal): f.add("window")
        if self.layout is not None: f.add("layout")
        if self.key_padding_mask is not None: f.add("key_padding_mask")
        if self.dropout_p > 0: f.add("dropout")
        if self.H != self.Hkv: f.add("gqa")
        if self.Lq != self.Lk: f.add("lq_ne_lk")
        if self.D != self.Dv: f.add("dv_ne_d")
        if self.return_lse: f.add("return_lse")
        if self.cu_seqlens is not None: f.add("varlen")
        if self.positions is not None: f.add("positions")
        if self.out_dtype is not None: f.add("out_fp32")
        if self.score is not None: f |= self.score.features()
        return f


# (Lq, Lk, causal) -> the Rule of a plain call (frozen: one object serves every call of that shape)
_PLAIN_RULES: dict = {}


def make_attn_call(q, k, v, *, causal=False, window=None, layout=None, key_padding_mask=None,
                   scale=None, dropout_p=0.0, return_lse=False, softcap=None, sinks=None, bias=None, cu_seqlens=None,
                   max_seqlen=None, positions=None, out_dtype=None, seed=None, heads=None) -> AttnCall:
    """The validated call. ``seed``: an explicit dropout seed (int64 CPU ``(2,)``) instead of a draw
    from torch's generator, for drivers whose calls must share one (context parallelism: every rank
    and ring step drops with the same seed). ``heads``: ``(h0, Hg)``, the call's heads are heads
    ``h0 .. h0 + H`` of ``Hg`` (a head shard: dropout draws at the global head index)."""
    B, H, Hkv = check_qkv(q, k, v, "attention")
    Lq, Lk = q.shape[2], k.shape[2]
    if not isinstance(causal, bool):
        _fail(TypeError, f"attention: causal must be a bool, got {causal!r}")
    if (window is None and layout is None and key_padding_mask is None and not dropout_p and softcap is None
            and sinks is None and bias is None and cu_seqlens is None and max_seqlen is None and positions is None
            and out_dtype is None and heads is None and type(dropout_p) in (int, float)):
        # a plain call (the common one): what the general path below would build, without its checks of
        # arguments that are not given (a short CPU call's host time is a measurable part of it)
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            _fail(TypeError, f"attention: scale must be a finite float, got {scale!r}")
        rule = _PLAIN_RULES.get((Lq, Lk, causal))
        if rule is None:
            if len(_PLAIN_RULES) > 256:
                _PLAIN_RULES.clear()
            rule = _PLAIN_RULES[(Lq, Lk, causal)] = Rule(Lq, Lk, *clamp_window(-1, 0 if causal else -1, Lq, Lk))
        return AttnCall(q, k, v, causal, rule, None, None, float(scale), 0.0, bool(return_lse))
    left, right = normalize_window(window, causal)
    if layout is not None:
        if not isinstance(layout, BlockLayout):
            _fail(TypeError, f"attention: layout must be an effattn.layouts.BlockLayout, got {type(layout).__name__}")
        bs = layout.block_size
        want = (math.ceil(Lq / bs), math.ceil(Lk / bs))
        lh, nqb, nkb = layout.mask.shape
        if (nqb, nkb) != want or lh not in (1, H):
            _fail(ValueError, f"attention: layout has shape {tuple(layout.mask.shape)} (block {bs}); expected "
                              f"(1 or H={H}, ceil(Lq/{bs})={want[0]}, ceil(Lk/{bs})={want[1]})")
        if layout.mask.device != q.device:
            layout = layout.to(q.device)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            _fail(TypeError, "attention: key_padding_mask must be a bool tensor of shape (B, Lk)")
        if key_padding_mask.dtype != torch.bool:
            _fail(TypeError, f"attention: key_padding_mask must have dtype torch.bool (True = ignore), got "
                             f"{key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (B, Lk):
            _fail(ValueError, f"attention: key_padding_mask must have shape (B, Lk)=({B}, {Lk}), got "
                              f"{tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            _fail(ValueError, f"attention: key_padding_mask is on {key_padding_mask.device}, q on {q.device}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        _fail(TypeError, f"attention: scale must be a finite float, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        _fail(ValueError, f"attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    score = make_score_terms("attention", q, k, softcap=softcap, sinks=sinks, bias=bias)
    if cu_seqlens is not None and score is not None and any(t.feature == "bias=dense" for t in score.terms):
        _fail(ValueError, "attention: a dense bias tensor (bias) cannot be combined with cu_seqlens: it would index "
                          "the packed (Tq, Tk) pairs, O(T^2) memory; use a term of the segment-local distance "
                          "(effattn.bias.ALiBi, Relative, Span)")
    if dropout_p <= 0:
        seed = None
    elif seed is None:
        seed = draw_seed()
    pk = packing(q, k, causal=causal, left=left, right=right, layout=layout, key_padding_mask=key_padding_mask,
                 cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, positions=positions, out_dtype=out_dtype,
                 dropout=dropout_p > 0,
                 distance=score is not None and any(t.feature != "bias=dense" for t in score.terms))
    rule = Rule(Lq, Lk, *clamp_window(pk.left, pk.right, Lq, Lk, pk.q_offset),
                layout.mask if layout is not None else None, layout.block_size if layout is not None else 0,
                q_offset=pk.q_offset)
    return AttnCall(q, k, v, pk.causal, rule, layout, key_padding_mask, float(scale), float(dropout_p),
                    bool(return_lse), seed, pk.segments, pk.cu_seqlens, pk.positions, pk.out_dtype, pk.max_seqlen,
                    score, None if heads is None or heads == (0, H) else (int(heads[0]), int(heads[1])))


# ----------------------------------------------------------------------------- linear attention

LINEAR = "linear_attention"


@dataclass
class LinearCall:
    """A validated linear-attention call. torch.Tensors keep the caller's strides (no copies)."""
    q: torch.Tensor                                  # (B, H, Lq, D)
    k: torch.Tensor                                  # (B, Hkv, Lk, D)
    v: torch.Tensor                                  # (B, Hkv, Lk, Dv)
    causal: bool
    phi: Callable[[torch.Tensor], torch.Tensor]            # (..., D) -> (..., F)
    normalize: bool
    eps: float
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]]   # (S0 (B, H, F, Dv), z0 (B, H, F)) or None
    return_state: bool
    num_features: int                          # F
    feature_map_name: str = "callable"         # "elu" | "relu" | "identity" | "favor" | "callable"

    def features(self):
        """Names of the features this call uses (read by backends' capability checks): the feature
        map is one of them, so a backend declares which maps it fuses."""
        f = {f"feature_map={self.feature_map_name}"}
        if self.causal: f.add("causal")
        if self.q.shape[1] != self.k.shape[1]: f.add("gqa")
        if self.initial_state is not None or self.return_state: f.add("state")
        if not self.normalize: f.add("no_normalize")
        return f


def _feature_dim(phi, name: str, q: torch.Tensor) -> int:
    D = q.shape[-1]
    if isinstance(phi, FavorFeatures):
        if phi.head_dim != D:
            raise ValueError(f"{LINEAR}: feature_map is FavorFeatures(head_dim={phi.head_dim}) but q/k have "
                             f"head dim D={D}")
        return phi.num_features
    if name in NAMED_FEATURE_MAPS:
        return D
    # a user callable: one probe row tells its output width
    with torch.no_grad():
        out = phi(torch.zeros(1, D, dtype=compute_dtype(q.dtype), device=q.device))
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 1 or out.shape[1] < 1:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{LINEAR}: feature_map must map (..., D) -> (..., F) with F >= 1; on a (1, {D}) "
                         f"input it returned {got}")
    return out.shape[1]


def make_linear_call(q, k, v, *, causal=False, feature_map="elu", normalize=True, eps=1e-6,
                     initial_state=None, return_state=False) -> LinearCall:
    B, H, Hkv = check_qkv(q, k, v, LINEAR)
    for name, flag in (("causal", causal), ("normalize", normalize), ("return_state", return_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{LINEAR}: {name} must be a bool, got {flag!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{LINEAR}: eps must be a float, got {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{LINEAR}: eps must be a finite float >= 0, got {eps!r}")
    phi = resolve_feature_map(feature_map)
    name = feature_map_name(feature_map)
    Fdim = _feature_dim(phi, name, q)
    Dv = v.shape[-1]
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"{LINEAR}: initial_state must be a pair (S0, z0) of tensors, got "
                            f"{type(initial_state).__name__}")
        S0, z0 = initial_state
        for nm, t, want in (("S0", S0, (B, H, Fdim, Dv)), ("z0", z0, (B, H, Fdim))):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{LINEAR}: initial_state {nm} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{LINEAR}: initial_state {nm} must be a floating tensor, got {t.dtype}")
            if tuple(t.shape) != want:
                dims = "(B, H, F, Dv)" if nm == "S0" else "(B, H, F)"
                raise ValueError(f"{LINEAR}: initial_state {nm} must have shape {want} {dims} with F={Fdim} "
                                 f"features, got {tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{LINEAR}: initial_state {nm} is on {t.device}, q on {q.device}")
        initial_state = (S0, z0)
    return LinearCall(q, k, v, causal, phi, normalize, float(eps), initial_state, return_state, Fdim, name)


def linear_features(call: LinearCall, dtype: torch.dtype):
    """``phi(q)``, ``phi(k)`` of a call computed in torch in ``dtype`` (for feature maps a backend does
    not fuse), checked to be ``(B, H, Lq, F)`` / ``(B, Hkv, Lk, F)``."""
    B, H, Lq, _ = call.q.shape
    Hkv, Lk = call.k.shape[1], call.k.shape[2]
    fq, fk = call.phi(call.q.to(dtype)), call.phi(call.k.to(dtype))
    for nm, t, want in (("q", fq, (B, H, Lq, call.num_features)), ("k", fk, (B, Hkv, Lk, call.num_features))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{LINEAR}: feature_map must map (..., D) -> (..., F) consistently; on {nm} it "
                             f"returned {got}, expected {want}")
    return fq.to(dtype), fk.to(dtype)
