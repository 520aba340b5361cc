"""What a backend is, and the registry dispatch reads.

Each backend declares what it serves in one place (a `Capabilities` record); `reasons(call)` turns
that declaration, plus any runtime check (a GPU present, an extension built), into the list of
reasons it cannot serve a call. Dispatch, `effattn.explain` and error messages all read from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple, Union

import torch


# The one list of backends: name -> the module that registers it. Every backend name anywhere else
# (dispatch, errors, explain, tests, benchmarks) is derived from it. Adding a backend is one folder
# under effattn/backends/ plus one line here.
BACKENDS: Dict[str, str] = {
    "torch": "effattn.backends.torch",
    "triton": "effattn.backends.triton",
    "cuda": "effattn.backends.cuda",
}

# Why a listed backend could not be imported (its "not available: <reason>" in explain and errors).
UNAVAILABLE: Dict[str, str] = {}

# The feature names a call can declare, per op (AttnCall.features() / LinearCall.features()): a
# backend's declaration is checked against this vocabulary at registration, so a typo fails at import.
FEATURES: Dict[str, FrozenSet[str]] = {
    "attention": frozenset({"causal", "window", "layout", "key_padding_mask", "dropout", "gqa", "lq_ne_lk",
                            "dv_ne_d", "return_lse", "varlen", "positions", "out_fp32"}),
    "linear_attention": frozenset({"causal", "gqa", "state", "no_normalize", "feature_map=elu",
                                   "feature_map=relu", "feature_map=identity", "feature_map=favor",
                                   "feature_map=callable"}),
}


@dataclass(frozen=True)
class Capabilities:
    devices: FrozenSet[str]                 # torch device types, e.g. {"cuda"}
    dtypes: FrozenSet[torch.dtype]
    max_head_dim: int = 256
    features: FrozenSet[str] = frozenset()  # call.features() names this backend serves
    min_compute_capability: Tuple[int, int] = (0, 0)  # on CUDA devices


@dataclass
class Backend:
    """A registered implementation of one op ("attention" or "linear_attention")."""
    name: str
    op: str
    # lower is faster: "auto" takes the lowest-ranked backend that can serve. An int, or a function of the
    # call when the fastest backend depends on its shape (e.g. a split-KV decode kernel for a few query rows
    # against a long cache); `rank(call)` reads it, and explain shows the ranks it compared.
    priority: Union[int, Callable]
    caps: Capabilities
    run: Callable                            # run(call) -> result tuple
    available: Callable[[torch.device], Optional[str]] = lambda device: None  # None or why not
    extra_reasons: Callable = lambda call: []  # call-specific runtime checks beyond caps
    # devices where the backend runs only when asked for by name, never picked by "auto"
    # (Triton's interpreter on CPU: correct, but far slower than the torch reference)
    explicit_only_devices: FrozenSet[str] = frozenset()
    # remarks `effattn.explain` adds for a call this backend serves: what serving it involves besides the
    # kernels (copies of inputs, parts computed in torch), e.g. ["feature map computed in torch"]
    notes: Callable = lambda call: []
    # which of its paths the backend takes for a call it serves (a note in explain), or None
    describe: Callable = lambda call: None

    def rank(self, call=None) -> int:
        """The backend's priority for this call; a priority function gets None when asked without a call."""
        return int(self.priority(call)) if callable(self.priority) else self.priority

    def reasons(self, call) -> List[str]:
        why = []
        device = call.q.device
        if device.type not in self.caps.devices:
            why.append(f"runs on {'/'.join(sorted(self.caps.devices))} tensors, got {device.type}")
        else:
            na = self.available(device)
            if na:
                why.append(na)
            elif device.type == "cuda" and self.caps.min_compute_capability > (0, 0):
                cc = _capability(device)
                if tuple(cc) < self.caps.min_compute_capability:
                    need = ".".join(map(str, self.caps.min_compute_capability))
                    why.append(f"needs a GPU of compute capability >= {need}, got {cc[0]}.{cc[1]}")
        if call.q.dtype not in self.caps.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in sorted(self.caps.dtypes, key=str))
            why.append(f"dtype {str(call.q.dtype).replace('torch.', '')} not served (serves {names})")
        hd = max(call.q.shape[-1], call.v.shape[-1])
        if hd > self.caps.max_head_dim:
            why.append(f"head dim {hd} > {self.caps.max_head_dim}")
        missing = sorted(call.features() - self.caps.features)
        if missing:
            why.append("does not support " + ", ".join(missing))
        why.extend(self.extra_reasons(call))
        return why


_CAPABILITY: Dict[torch.device, Tuple[int, int]] = {}


def _capability(device: torch.device) -> Tuple[int, int]:
    """The GPU's compute capability, read once per device (it is checked on every call)."""
    cc = _CAPABILITY.get(device)
    if cc is None:
        cc = _CAPABILITY[device] = tuple(torch.cuda.get_device_capability(device))
    return cc


_REGISTRY: Dict[str, Dict[str, Backend]] = {"attention": {}, "linear_attention": {}}


def register(backend: Backend) -> Backend:
    if backend.name not in BACKENDS:
        raise ValueError(f"backend {backend.name!r} is not in effattn.backends.base.BACKENDS")
    unknown = sorted(backend.caps.features - FEATURES[backend.op])
    if unknown:
        raise ValueError(f"backend {backend.name!r} ({backend.op}) declares unknown features {unknown}; "
                         f"known: {sorted(FEATURES[backend.op])}")
    _REGISTRY[backend.op][backend.name] = backend
    return backend


def backends_for(op: str, call=None) -> List[Backend]:
    """The registered backends of `op`, fastest first for `call` (by static priority when None).
    Ties keep the order of `BACKENDS`."""
    order = list(BACKENDS)
    return sorted(_REGISTRY[op].values(), key=lambda b: (b.rank(call), order.index(b.name)))



def select(op: str, call, backend: str) -> Backend:
    """Picks the backend for a call: the named one (or an error saying why it can't), or for
    "auto" the fastest that can serve. Only the backends it needs are asked (the named one; for
    "auto" those ranked before the pick), so a call that is served costs one or two capability
    checks; the reasons of all of them are gathered only for the error message."""
    if backend == "auto":
        device_type = call.q.device.type
        for b in backends_for(op, call):
            if device_type not in b.explicit_only_devices and not b.reasons(call):
                return b
    elif backend in BACKENDS:
        b = _REGISTRY[op].get(backend)
        if b is not None and not b.reasons(call):
            return b
    else:
        names = ", ".join(repr(n) for n in ("auto",) + tuple(BACKENDS))
        raise ValueError(f"{op}: backend must be one of {names}; got {backend!r}")
    table = {b.name: (b, b.reasons(call)) for b in backends_for(op, call)}
    if backend == "auto":
        raise ValueError(f"{op}: no backend can serve this call: " + _describe(table))
    if backend not in table:
        raise RuntimeError(f"{op}: backend {backend!r} {missing_reason(op, backend)}. " + _describe(table))
    ok = [n for n, (_, w) in table.items() if not w]
    raise RuntimeError(f"{op}: backend {backend!r} cannot serve this call: {'; '.join(table[backend][1])}. "
                       f"Backends that can: {', '.join(ok) if ok else 'none'}")


def attention_autograd(bwd_op, prepare: Callable = lambda grad_out: grad_out):
    """The autograd formula every backend's attention op shares. The forward op's inputs are
    ``(q, k, v, layout_mask, layout_block, key_padding_mask, seed, *scalars)`` and it returns
    ``(out, lse)``; ``bwd_op(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block,
    key_padding_mask, seed, *scalars)`` returns ``(dq, dk, dv)``. ``prepare`` adapts grad_out (e.g.
    makes it contiguous). Returns ``(setup_context, backward)`` for ``fwd_op.register_autograd`` (or an
    ``autograd.Function`` that calls the launchers directly)."""
    def setup_context(ctx, inputs, output):
        q, k, v, layout_mask, layout_block, kpm, seed, *scalars = inputs
        ctx.save_for_backward(q, k, v, *output, layout_mask, kpm, seed)
        ctx.static = (layout_block, *scalars)     # read at the forward (e.g. TF32), not again

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, layout_mask, kpm, seed = ctx.saved_tensors
        dq, dk, dv = bwd_op(prepare(grad_out), grad_lse, q, k, v, out, lse, layout_mask, ctx.static[0], kpm, seed,
                            *ctx.static[1:])
        return (dq, dk, dv) + (None,) * (len(ctx.static) + 3)

    return setup_context, backward


def missing_reason(op: str, name: str) -> str:
    """Why backend `name` has no `op` registered: its import failed, or it has no kernel for op."""
    if name in UNAVAILABLE:
        return f"is not available: {UNAVAILABLE[name]}"
    return f"has no {op} kernel in this version"


def _describe(table) -> str:
    return "; ".join(f"{n}: {'ok' if not w else ', '.join(w)}" for n, (_, w) in table.items())
