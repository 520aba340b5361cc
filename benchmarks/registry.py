"""What the benchmark runs: one table of variants (what is computed) and one of implementations
(who computes it). The runner (run.py) sweeps variant x implementation x length x mode; an
implementation serves the variants of its op ("attention" or "linear_attention").

Adding a variant is one `Variant(...)` line in VARIANTS; adding a baseline is one `Impl(...)` line in
IMPLS with a `build(case)` that returns a `Bench` (or raises `Unsupported(reason)`).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import effattn
from effattn import layouts
from effattn.backends.base import BACKENDS
from effattn.visibility import Rule

SOFTCAP = 30.0         # the softcap variant's cap
T5_BUCKETS, T5_DISTANCE = 32, 128   # the t5 variant's table: T5's defaults (decoder: past only)
SPAN_RAMP, SPAN_MAX = 32, 2048      # the span variants: ramp and the largest span (at most L/4), in tokens
RELKEYS_DIST = 1024    # the relkeys variant: relative keys for past distances 0..1023 (farther ones clamped)
LAYOUT_BLOCK = 128     # block size of the block-sparse variants (the 'fixed' pattern of docs/benchmarks.md)


class Unsupported(Exception):
    """An implementation cannot serve this configuration; the message says why."""


# ------------------------------------------------------------------------------------ variants

@dataclass(frozen=True)
class Variant:
    name: str
    family: str                     # "mask" | "layout" | "linear": --quick runs one variant of each
    description: str
    op: str = "attention"           # "attention" | "linear_attention"
    causal: bool = False
    window: bool = False            # sliding window of --window keys to the left (with causal)
    layout: Optional[Callable[[int], layouts.BlockLayout]] = None   # L -> layout
    feature_map: Optional[str] = None                                 # linear: "identity" | "elu" | "favor"
    num_features: Optional[int] = None                                # FAVOR+ F; None: D ln D
    normalize: bool = True
    quadratic: bool = True          # cost ~ L^2: by default run only up to --dense-max-len
    cpu_default: bool = True
    score: Optional[str] = None     # a score term (effattn.score): "softcap" | "alibi" | "sinks" | "t5" | "span"
    #                                 | "span-max" | "relkeys" (effattn.bias.RelativeKeys)


VARIANTS: Tuple[Variant, ...] = (
    Variant("dense", "mask", "full attention, no mask"),
    Variant("causal", "mask", "causal mask", causal=True),
    Variant("window", "mask", "causal sliding window, --window keys to the left", causal=True, window=True,
            quadratic=False),
    Variant("fixed", "layout", "causal sliding_and_summary(block 128, local_blocks=4, every=16): "
            "the 'fixed'-style pattern of docs/benchmarks.md, 94% sparse at 16k", causal=True,
            layout=lambda L: layouts.sliding_and_summary(L, LAYOUT_BLOCK, local_blocks=4, every=16),
            quadratic=False),
    Variant("bigbird", "layout", "bigbird(block 128, 3 window, 2 global, 3 random blocks), non-causal",
            layout=lambda L: layouts.bigbird(L, LAYOUT_BLOCK, 3, 2, 3, seed=0), quadratic=False,
            cpu_default=False),
    Variant("longformer", "layout", "longformer(block 128, window_blocks=2, global block 0), non-causal",
            layout=lambda L: layouts.longformer(L, LAYOUT_BLOCK, window_blocks=2, global_blocks=(0,)),
            quadratic=False, cpu_default=False),
    Variant("strided", "layout", "Sparse Transformer strided(block 128, stride 8 blocks), causal", causal=True,
            layout=lambda L: layouts.strided(L, LAYOUT_BLOCK, stride=8), cpu_default=False),
    Variant("linear-elu", "linear", "causal linear attention, phi = elu + 1, normalized",
            op="linear_attention", causal=True, feature_map="elu", quadratic=False),
    Variant("linear-favor", "linear", "causal linear attention, FAVOR+ features (F = D ln D), normalized",
            op="linear_attention", causal=True, feature_map="favor", quadratic=False),
    Variant("linear-identity", "linear", "causal linear attention, phi = identity, unnormalized",
            op="linear_attention", causal=True, feature_map="identity", normalize=False, quadratic=False,
            cpu_default=False),
    Variant("linear-favor256", "linear", "causal linear attention, FAVOR+ with F = 256 features, normalized",
            op="linear_attention", causal=True, feature_map="favor", num_features=256, quadratic=False,
            cpu_default=False),
    Variant("linear-elu-full", "linear", "non-causal linear attention, phi = elu + 1, normalized (against the "
            "'dense' variant's softmax rows)", op="linear_attention", feature_map="elu", quadratic=False,
            cpu_default=False),
    # score terms (causal); Flex gets the same score_mod (sinks: Flex's lse and the sink's share of
    # each row's mass, out * sigmoid(lse - sink), since Flex has no sink term); SDPA does not serve them
    Variant("softcap", "score", f"causal, logits soft-capped at {SOFTCAP} (Gemma 2)", causal=True, score="softcap",
            cpu_default=False),
    Variant("alibi", "score", "causal, ALiBi with the paper's slopes (BLOOM, MPT)", causal=True, score="alibi",
            cpu_default=False),
    Variant("sinks", "score", "causal, one attention-sink logit per head (gpt-oss)", causal=True, score="sinks",
            cpu_default=False),
    Variant("t5", "score", f"causal, T5's relative position bias ({T5_BUCKETS} buckets up to distance {T5_DISTANCE}, "
            "past only) as a relative table", causal=True, score="t5", cpu_default=False),
    Variant("span", "score", f"causal, adaptive span (ramp {SPAN_RAMP}), spans drawn per head uniformly in "
            f"[0, min({SPAN_MAX}, L/4)]: time should follow the sum of the spans (against 'span-max')", causal=True,
            score="span", cpu_default=False),
    Variant("span-max", "score", f"causal, adaptive span (ramp {SPAN_RAMP}) with every head at the largest span "
            f"min({SPAN_MAX}, L/4)", causal=True, score="span-max", cpu_default=False),
    Variant("relkeys", "score", f"causal, Transformer-XL / Shaw relative keys: q_i . r[h, min(i - j, "
            f"{RELKEYS_DIST - 1})] added to the scores (a query-dependent term; Flex reads q r^T, materialized "
            f"(B, H, L, {RELKEYS_DIST}), in its score_mod)", causal=True, score="relkeys", cpu_default=False),
)


# The Triton linear-attention acceptance rows (fla, SDPA flash beside): commands in benchmarks/README.md.
# ------------------------------------------------------------------------------------ one config

@dataclass
class Case:
    """One (variant, shape) point of the sweep: inputs and the per-shape objects built once for it."""
    variant: Variant
    B: int
    H: int
    L: int
    D: int
    dtype: torch.dtype
    device: torch.device
    window: int                                   # the window variant's left reach
    q: torch.Tensor = None                        # (B, H, L, D), leaves with requires_grad
    k: torch.Tensor = None
    v: torch.Tensor = None
    dout: torch.Tensor = None                     # (B, H, L, D) output gradient for fwd+bwd
    layout: Optional[layouts.BlockLayout] = None
    favor: Optional[torch.nn.Module] = None
    _cache: Dict[str, object] = field(default_factory=dict)

    @classmethod
    def make(cls, variant: Variant, B: int, H: int, L: int, D: int, dtype, device, window: int, seed: int = 0):
        case = cls(variant, B, H, L, D, dtype, torch.device(device), window)
        gen = torch.Generator(device=case.device).manual_seed(seed)
        case.q, case.k, case.v = (torch.randn(B, H, L, D, generator=gen, device=case.device, dtype=dtype)
                                  .requires_grad_() for _ in range(3))
        case.dout = torch.randn(B, H, L, D, generator=gen, device=case.device, dtype=dtype)
        if variant.layout is not None:
            case.layout = variant.layout(L).to(case.device)
        if variant.feature_map == "favor":
            case.favor = effattn.FavorFeatures(D, variant.num_features, seed=0).to(case.device)
        return case

    # --- what the variant means, in each API's terms ---
    @property
    def window_arg(self):
        return self.window if self.variant.window else None

    def attention_kwargs(self) -> dict:
        return dict(causal=self.variant.causal, window=self.window_arg, layout=self.layout, **self.score_kwargs())

    def score_kwargs(self) -> dict:
        """effattn's arguments for the variant's score term (fp32 parameters, built once)."""
        kind = self.variant.score
        if kind is None:
            return {}
        if "score" not in self._cache:
            if kind == "softcap":
                kw = dict(softcap=SOFTCAP)
            elif kind == "alibi":
                kw = dict(bias=effattn.bias.ALiBi(effattn.bias.alibi_slopes(self.H).to(self.device)))
            elif kind == "t5":
                g = torch.Generator().manual_seed(7)
                weight = torch.randn(T5_BUCKETS, self.H, generator=g)          # T5's (buckets, H) embedding
                idx = effattn.bias.t5_bucket_index(T5_BUCKETS, T5_DISTANCE, bidirectional=False)
                kw = dict(bias=effattn.bias.Relative(weight.T[:, idx].contiguous().to(self.device),
                                                     max_distance=T5_DISTANCE, bidirectional=False))
            elif kind in ("span", "span-max"):
                g = torch.Generator().manual_seed(7)
                top = min(SPAN_MAX, self.L // 4)
                z = torch.rand(self.H, generator=g) * top if kind == "span" else torch.full((self.H,), float(top))
                kw = dict(bias=effattn.bias.Span(z.float().to(self.device), ramp=SPAN_RAMP, max_span=top))
            elif kind == "relkeys":
                g = torch.Generator().manual_seed(7)
                r = torch.randn(self.H, min(RELKEYS_DIST, self.L), self.D, generator=g) * self.D ** -0.5
                kw = dict(bias=effattn.bias.RelativeKeys(r.to(self.device, self.dtype).requires_grad_()))
            else:
                g = torch.Generator().manual_seed(7)
                kw = dict(sinks=torch.randn(self.H, generator=g).to(self.device))
            self._cache["score"] = kw
        return self._cache["score"]

    def linear_kwargs(self) -> dict:
        fm = self.favor if self.variant.feature_map == "favor" else self.variant.feature_map
        return dict(causal=self.variant.causal, feature_map=fm, normalize=self.variant.normalize)

    def phi(self):
        """The feature map as a torch function (float32 out), or None for identity."""
        return {"identity": None, "elu": lambda x: F.elu(x.float()) + 1.0, "favor": self.favor}[self.variant.feature_map]

    @property
    def num_features(self) -> int:
        return self.favor.num_features if self.favor is not None else self.D

    def mask_kwargs(self) -> dict:
        return dict(causal=self.variant.causal, window=self.window_arg, layout=self.layout)

    def mask(self) -> Optional[torch.Tensor]:
        """Token-level visibility ``(Hl, L, L)`` bool (True = visible), built once; None when dense."""
        if "mask" not in self._cache:
            m = Rule.of(self.L, self.L, **self.mask_kwargs()).materialize(device=self.device)
            self._cache["mask"] = None if m is None else m[0]
        return self._cache["mask"]

    @property
    def elem_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8


@dataclass
class Bench:
    """What the runner times: ``fn()`` returns the output ``(B, H, L, Dv)``; ``leaves`` are the tensors
    whose gradients fwd+bwd computes (reset between runs); ``env``: environment variables set while a
    step runs, its backward included (`environment`)."""
    fn: Callable[[], torch.Tensor]
    leaves: Sequence[torch.Tensor]
    env: Optional[Dict[str, str]] = None


@contextlib.contextmanager
def environment(env: Optional[Dict[str, str]]):
    """``env`` set in os.environ inside the block, the earlier values restored after it."""
    if not env:
        yield
        return
    old = {n: os.environ.get(n) for n in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for n, x in old.items():
            if x is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = x


# ------------------------------------------------------------------------------------ implementations

@dataclass(frozen=True)
class Impl:
    name: str
    kind: str                                      # "effattn" | "baseline"
    op: str                                        # "attention" | "linear_attention"
    build: Callable[[Case], Bench]
    installed: Callable[[], Optional[str]] = lambda: None          # None, or why it is missing
    score_bytes: Optional[Callable[[Case, str], int]] = None       # memory of an L x L materializing impl
    compiled: bool = False                         # first call compiles: warm up before measuring
    cpu_default: bool = True


def _effattn(backend: str, op: str, env: Optional[Dict[str, str]] = None) -> Callable[[Case], Bench]:
    def build(case: Case) -> Bench:
        kw = case.attention_kwargs() if op == "attention" else case.linear_kwargs()
        with environment(env):
            ex = effattn.explain(case.q, case.k, case.v, op=op, **kw)
        why = ex.reasons.get(backend, ["unknown backend"])
        if why:
            raise Unsupported("; ".join(why))
        from effattn.backends import base
        if case.device.type in base._REGISTRY[op][backend].explicit_only_devices:   # Triton's interpreter
            raise Unsupported(f"{ex.notes[backend]} (interpreter; not benchmarked)")
        fn = effattn.attention if op == "attention" else effattn.linear_attention
        q, k, v = case.q, case.k, case.v
        return Bench(lambda: fn(q, k, v, backend=backend, **kw), (q, k, v), env)
    return build


# The CUDA backend with the Hopper TMA forward and the Hopper backward switched off: the cp.async wgmma
# forward and the fused mma.sync backward, what those two kernels are measured against in one run
EARLIER_CUDA = {"EFFATTN_CUDA_HOPPER_TMA": "0", "EFFATTN_CUDA_HOPPER_BWD": "0"}


def naive_attention(q, k, v, mask: Optional[torch.Tensor]):
    """Textbook attention: the (B, H, L, L) scores in memory, masked, softmax in float32."""
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def naive_linear_attention(q, k, v, phi, causal: bool, normalize: bool, eps: float = 1e-6):
    """Linear attention in its quadratic form: ``(phi(q) phi(k)^T, masked) v``, (B, H, L, L) in memory."""
    fq, fk = (phi(q), phi(k)) if phi is not None else (q.float(), k.float())
    a = fq @ fk.transpose(-1, -2)
    if causal:
        L = a.shape[-1]
        a = a.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(), 0.0)
    out = a @ v.float()
    if normalize:
        out = out / (a.sum(-1, keepdim=True) + eps)
    return out.to(q.dtype)


def _no_score(case: Case, who: str) -> None:
    if case.variant.score is not None:
        raise Unsupported(f"{who} takes no {case.variant.score} term")


def _naive(case: Case) -> Bench:
    _no_score(case, "naive")
    q, k, v = case.q, case.k, case.v
    if case.variant.op == "attention":
        mask = case.mask()
        return Bench(lambda: naive_attention(q, k, v, mask), (q, k, v))
    phi, causal, normalize = case.phi(), case.variant.causal, case.variant.normalize
    return Bench(lambda: naive_linear_attention(q, k, v, phi, causal, normalize), (q, k, v))


def _naive_bytes(case: Case, mode: str) -> int:
    """Scores, float32 probabilities and their cast (x2 with the tensors autograd keeps and the
    gradients of the same size), plus the mask."""
    n = case.B * case.H * case.L * case.L
    fwd = n * (2 * case.elem_bytes + 4) + case.L * case.L
    return fwd * (2 if mode == "fwdbwd" else 1)


def _sdpa(backend: str) -> Callable[[Case], Bench]:
    def build(case: Case) -> Bench:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if case.device.type != "cuda" and backend not in ("MATH", "FLASH_ATTENTION"):
            raise Unsupported(f"SDPA {backend.lower()} backend needs CUDA")
        _no_score(case, "SDPA")
        which = getattr(SDPBackend, backend)
        v = case.variant
        kw = {}
        if v.causal and not v.window and v.layout is None:
            kw["is_causal"] = True                 # no mask tensor: every SDPA backend can serve it
        elif case.mask() is not None:
            kw["attn_mask"] = case.mask()[None]   # (1, Hl, L, L) bool, True = take part
        q, k, vv = case.q, case.k, case.v

        def fn():
            with sdpa_kernel([which]):
                return F.scaled_dot_product_attention(q, k, vv, **kw)
        return Bench(fn, (q, k, vv))
    return build


_flex_compiled = None


def _flex_installed() -> Optional[str]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch.nn.attention.flex_attention missing ({e})"
    return None


def _flex(case: Case) -> Bench:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex_compiled is None:
        # (imported under its own name: `import torch._dynamo` would make `torch` local to this function,
        # unbound in the score_mod closures below when the compile is already done)
        import torch._dynamo as dynamo
        for name in ("recompile_limit", "cache_size_limit"):   # one compile per shape: allow many
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(getattr(dynamo.config, name), 256))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    mod = Rule.of(case.L, case.L, **case.mask_kwargs()).mask_mod(case.device)
    kind, kw = case.variant.score, case.score_kwargs()
    per_head = case.layout is not None and case.layout.num_heads > 1
    if kind in ("span", "span-max"):         # Flex gets each head's span as a block mask too (tiles skipped)
        z, ramp, rule_mod = kw["bias"].z, float(kw["bias"].ramp), mod

        def mod(b, h, i, j):
            return rule_mod(b, h, i, j) & ((i - j).to(z.dtype) < z[h] + ramp)
        per_head = True
    block_mask = None
    if mod is not None:
        heads = case.H if per_head else None
        # _compile: evaluate the mask tile by tile instead of as one L x L tensor (64k: 4 GiB+)
        opts = {"_compile": True} if case.device.type == "cuda" and "_compile" in \
            inspect.signature(create_block_mask).parameters else {}
        block_mask = create_block_mask(mod, None, heads, case.L, case.L, device=case.device,
                                       BLOCK_SIZE=LAYOUT_BLOCK, **opts)
    q, k, v, flex = case.q, case.k, case.v, _flex_compiled
    if kind == "relkeys":                     # the query-dependent term: q r^T materialized, read per score
        r = kw["bias"].r
        scale, last = q.shape[-1] ** -0.5, r.shape[1] - 1

        def fn():
            qr = q @ r.transpose(-1, -2).unsqueeze(0)                       # (B, H, L, n_dist)

            def score_mod(s, b, h, i, j):
                return s + scale * qr[b, h, i, (i - j).clamp(0, last)]
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        return Bench(fn, (q, k, v, r))
    if kind == "sinks":
        sinks = kw["sinks"][None, :, None, None]

        def fn():
            o, lse = flex(q, k, v, block_mask=block_mask, return_lse=True)
            # a sink logit s takes exp(s) / (exp(lse) + exp(s)) of each row's mass
            return o * torch.sigmoid(lse[..., None] - sinks).to(o.dtype)
        return Bench(fn, (q, k, v))
    score_mod = None
    if kind == "softcap":
        cap = kw["softcap"]

        def score_mod(s, b, h, i, j):
            return cap * torch.tanh(s / cap)
    elif kind == "alibi":
        slopes = kw["bias"].slopes

        def score_mod(s, b, h, i, j):
            return s - slopes[h] * (i - j).abs()
    elif kind == "t5":
        table, M = kw["bias"].table, kw["bias"].max_distance

        def score_mod(s, b, h, i, j):
            return s + table[h, (i - j).clamp(0, M)]
    elif kind in ("span", "span-max"):
        z, ramp = kw["bias"].z, float(kw["bias"].ramp)

        def score_mod(s, b, h, i, j):
            return s + torch.log(((ramp + z[h] - (i - j).to(z.dtype)) / ramp).clamp(1e-30, 1.0))
    return Bench(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask), (q, k, v))


def _fla_installed(fn_name: str) -> Callable[[], Optional[str]]:
    def installed():
        try:
            mod = importlib.import_module("fla.ops.linear_attn")
        except Exception as e:                     # ImportError, or a broken install
            return f"fla not installed ({type(e).__name__})"
        return None if hasattr(mod, fn_name) else f"fla.ops.linear_attn has no {fn_name}"
    return installed


def _fla(fn_name: str) -> Callable[[Case], Bench]:
    """flash-linear-attention's kernels on (B, T, H, D) inputs (their native layout), the feature
    map applied in torch first (fla's kernels take phi(q), phi(k)); ``scale=1``."""
    def build(case: Case) -> Bench:
        if case.device.type != "cuda":
            raise Unsupported("fla kernels run on CUDA only")
        kernel = getattr(importlib.import_module("fla.ops.linear_attn"), fn_name)
        extra = {"head_first": False} if "head_first" in inspect.signature(kernel).parameters else {}
        q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (case.q, case.k, case.v))
        phi, dt, normalize = case.phi(), case.dtype, case.variant.normalize

        def fn():
            fq, fk = (q, k) if phi is None else (phi(q).to(dt), phi(k).to(dt))
            o, _ = kernel(fq, fk, v, scale=1.0, normalize=normalize, **extra)
            return o.transpose(1, 2)               # (B, H, T, Dv) view, like the others
        return Bench(fn, (q, k, v))
    return build


IMPLS: Tuple[Impl, ...] = tuple(
    Impl(f"effattn-{b}", "effattn", op, _effattn(b, op))
    for b in BACKENDS for op in ("attention", "linear_attention")
) + (
    Impl("naive", "baseline", "attention", _naive, score_bytes=_naive_bytes),
    Impl("naive", "baseline", "linear_attention", _naive, score_bytes=_naive_bytes),
    Impl("effattn-cuda-earlier", "baseline", "attention", _effattn("cuda", "attention", EARLIER_CUDA),
         cpu_default=False),
    Impl("sdpa-math", "baseline", "attention", _sdpa("MATH"), score_bytes=_naive_bytes),
    Impl("sdpa-flash", "baseline", "attention", _sdpa("FLASH_ATTENTION")),
    Impl("sdpa-efficient", "baseline", "attention", _sdpa("EFFICIENT_ATTENTION"), cpu_default=False),
    Impl("sdpa-cudnn", "baseline", "attention", _sdpa("CUDNN_ATTENTION"), cpu_default=False),
    Impl("flex", "baseline", "attention", _flex, installed=_flex_installed, compiled=True, cpu_default=False),
    Impl("fla-chunk", "baseline", "linear_attention", _fla("chunk_linear_attn"),
         installed=_fla_installed("chunk_linear_attn"), cpu_default=False),
    Impl("fla-fused-chunk", "baseline", "linear_attention", _fla("fused_chunk_linear_attn"),
         installed=_fla_installed("fused_chunk_linear_attn"), cpu_default=False),
)

EFFATTN_BACKENDS = tuple(BACKENDS)
BASELINES = tuple(dict.fromkeys(i.name for i in IMPLS if i.kind == "baseline"))


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise KeyError(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")
