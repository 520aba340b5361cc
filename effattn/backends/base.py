"""What a backend is, and the registry dispatch reads.

Each backend declares what it serves in one place (a `Capabilities` record); `reasons(call)` turns
that declaration, plus any runtime check (a GPU present, an extension built), into the list of
reasons it cannot serve a call. Dispatch, `effattn.explain` and error messages all read from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Capabilities:
    devices: FrozenSet[str]                 # torch device types, e.g. {"cuda"}
    dtypes: FrozenSet[torch.dtype]
    max_head_dim: int = 256
    features: FrozenSet[str] = frozenset()  # AttnCall.features() names this backend serves
    needs_grad_support: bool = True


@dataclass
class Backend:
    """A registered implementation of one op ("attention" or "linear_attention")."""
    name: str
    op: str
    priority: int                            # lower is faster: "auto" takes the lowest that can serve
    caps: Capabilities
    run: Callable                            # run(call) -> result tuple
    available: Callable[[torch.device], Optional[str]] = lambda device: None  # None or why not
    extra_reasons: Callable = lambda call: []  # call-specific runtime checks beyond caps
    # devices where the backend runs only when asked for by name, never picked by "auto"
    # (Triton's interpreter on CPU: correct, but far slower than the torch reference)
    explicit_only_devices: FrozenSet[str] = frozenset()
    # what serving a call involves besides the kernels (e.g. copies of inputs), for explain
    notes: Callable = lambda call: []

    def reasons(self, call) -> List[str]:
        why = []
        device = call.q.device
        if device.type not in self.caps.devices:
            why.append(f"runs on {'/'.join(sorted(self.caps.devices))} tensors, got {device.type}")
        else:
            na = self.available(device)
            if na:
                why.append(na)
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


_REGISTRY: Dict[str, Dict[str, Backend]] = {"attention": {}, "linear_attention": {}}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.op][backend.name] = backend
    return backend


def backends_for(op: str) -> List[Backend]:
    return sorted(_REGISTRY[op].values(), key=lambda b: b.priority)


BACKEND_NAMES = ("torch", "triton", "cuda")


def select(op: str, call, backend: str) -> Backend:
    """Picks the backend for a call: the named one (or an error saying why it can't), or for
    "auto" the fastest that can serve."""
    if backend not in ("auto",) + BACKEND_NAMES:
        raise ValueError(f"{op}: backend must be one of 'auto', 'torch', 'triton', 'cuda'; got {backend!r}")
    table = {b.name: (b, b.reasons(call)) for b in backends_for(op)}
    if backend == "auto":
        for b, why in table.values():
            if not why and call.q.device.type not in b.explicit_only_devices:
                return b
        raise ValueError(f"{op}: no backend can serve this call: " + _describe(table))
    if backend not in table:
        raise RuntimeError(f"{op}: backend {backend!r} is not available in this installation. "
                           + _describe(table))
    b, why = table[backend]
    if why:
        ok = [n for n, (_, w) in table.items() if not w]
        raise RuntimeError(f"{op}: backend {backend!r} cannot serve this call: {'; '.join(why)}. "
                           f"Backends that can: {', '.join(ok) if ok else 'none'}")
    return b


def _describe(table) -> str:
    return "; ".join(f"{n}: {'ok' if not w else ', '.join(w)}" for n, (_, w) in table.items())
