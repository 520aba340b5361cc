"""What a backend is, and the registry dispatch reads.

Each backend declares what it serves in one place (a `Capabilities` record); `reasons(call)` turns
that declaration, plus any runtime check (a GPU present, an extension built), into the list of
reasons it cannot serve a call. Dispatch, `effattn.explain` and error messages all read from it.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple, Union

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
                            "dv_ne_d", "return_lse", "varlen", "positions", "out_fp32",
                            "softcap", "sinks", "bias=alibi", "bias=relative", "bias=span", "bias=dense"}),
    "linear_attention": frozenset({"causal", "gqa", "state", "no_normalize", "feature_map=elu",
                                   "feature_map=relu", "feature_map=identity", "feature_map=favor",
                                   "feature_map=callable"}),
    # the ops with kernels of their own beside a torch path (effattn.lsh, effattn.paged, effattn.relative)
    "lsh_attention": frozenset({"causal", "key_padding_mask", "dropout"}),
    "paged_attention": frozenset({"causal", "window", "return_lse"}),
    "relative_attention": frozenset({"causal", "window", "key_padding_mask", "dropout", "gqa", "return_lse"}),
}

# op -> the function building its call from `effattn.explain`'s ``(q, k, v, **kwargs)``, for the ops
# whose call lives beside their public function (effattn.lsh, effattn.relative register theirs).
CALL_MAKERS: Dict[str, Callable] = {}

# The attention features of score terms (effattn.score): a backend that lacks one says so in explain.
# The features of packed sequences and context-parallel chunks (effattn.packed).
PACKED_FEATURES: FrozenSet[str] = frozenset({"varlen", "positions", "out_fp32"})
SCORE_FEATURES: FrozenSet[str] = frozenset({"softcap", "sinks", "bias=alibi", "bias=relative", "bias=span",
                                            "bias=dense"})


@dataclass(frozen=True)
class Capabilities:
    devices: FrozenSet[str]                 # torch device types, e.g. {"cuda"}
    dtypes: FrozenSet[torch.dtype]
    max_head_dim: int = 256
    features: FrozenSet[str] = frozenset()  # call.features() names this backend serves
    min_compute_capability: Tuple[int, int] = (0, 0)  # on CUDA devices


_NO_REASONS: Callable = lambda call: []


@dataclass
class Path:
    """One code path of a backend, the unit dispatch picks: one row of the registry.

    ``reasons(call)`` is the list of reasons the path cannot serve a call (empty: it admits it): the
    `Capabilities` declaration, the backend's runtime check (``available``: a GPU, an extension built)
    and the path's own admission check (``admits``, same protocol: e.g. the split-KV decode takes a
    few query rows against a long key range). ``backend="auto"`` takes the first row in priority
    order whose reasons are empty; ``backend="triton"`` the first such row of that backend."""
    backend: str                             # a name in BACKENDS
    op: str                                  # a key of FEATURES: "attention", "linear_attention", ...
    name: str                                # "<backend>/<path>", e.g. "triton/decode"
    # lower is tried first. An int, or a function of the call (None: asked without a call) when the
    # path's speed against the other backends' depends on the shape
    priority: Union[int, Callable]
    caps: Capabilities
    run: Callable                            # run(call) -> result tuple
    admits: Callable = _NO_REASONS           # admits(call) -> reasons this path does not take the call
    available: Callable[[torch.device], Optional[str]] = lambda device: None  # None or why not
    # devices where the path runs only when its backend is asked for by name, never picked by "auto"
    # (Triton's interpreter on CPU: correct, but far slower than the torch paths)
    explicit_only_devices: FrozenSet[str] = frozenset()
    # remarks `effattn.explain` adds for a call this path serves: what serving it involves besides the
    # kernels (copies of inputs, parts computed in torch), e.g. ["feature map computed in torch"]
    notes: Callable = _NO_REASONS
    # detail inside the path for a call it serves (number of splits, which forward kernel), or None
    describe: Callable = lambda call: None
    # planned(call) -> a runner for a dispatch plan (effattn.plans) whose calls are ``call`` but for
    # q, k, v: ``runner(q, k, v)`` serves such a call, eager and on plain tensors, exactly as
    # ``run`` would (bitwise, same autograd), or returns None and leaves it to ``run``. None: ``run``.
    planned: Optional[Callable] = None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        _VERSION[0] += 1                # a row changed (a test patching `reasons`): plans and row order rebuilt

    def rank(self, call=None) -> int:
        """The path's priority for this call; a priority function gets None when asked without a call."""
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
        missing = call.features() - self.caps.features
        if missing:
            why.append("does not support " + ", ".join(sorted(missing)))
        if not why:                        # a path's own check may assume the declaration holds
            why.extend(self.admits(call))
        return why


_CAPABILITY: Dict[torch.device, Tuple[int, int]] = {}


def _capability(device: torch.device) -> Tuple[int, int]:
    """The GPU's compute capability, read once per device (it is checked on every call)."""
    cc = _CAPABILITY.get(device)
    if cc is None:
        cc = _CAPABILITY[device] = tuple(torch.cuda.get_device_capability(device))
    return cc


@dataclass
class Backend:
    """The rows of one backend for one op, in the order the backend tries them (a view the
    registry keeps; dispatch reads the rows). Its declaration is the union of its rows'."""
    name: str
    op: str
    paths: List[Path] = field(default_factory=list)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        _VERSION[0] += 1                # dispatch's cached row order (`_rows_entry`) is rebuilt

    @property
    def caps(self) -> Capabilities:
        c = [p.caps for p in self.paths]
        return Capabilities(devices=frozenset().union(*(x.devices for x in c)),
                            dtypes=frozenset().union(*(x.dtypes for x in c)),
                            max_head_dim=max(x.max_head_dim for x in c),
                            features=frozenset().union(*(x.features for x in c)),
                            min_compute_capability=min(x.min_compute_capability for x in c))

    @property
    def explicit_only_devices(self) -> FrozenSet[str]:
        """Devices where every row of the backend runs only when named."""
        return frozenset.intersection(*(p.explicit_only_devices for p in self.paths))

    def available(self, device: torch.device) -> Optional[str]:
        return self.paths[0].available(device)

    def ordered(self, call=None) -> List[Path]:
        """The backend's rows in the order it tries them for `call`: by rank, ties in registration order."""
        return sorted(self.paths, key=lambda p: p.rank(call))

    def take(self, call) -> Tuple[Optional[Path], List[str]]:
        """(the first row that admits `call`, []) or (None, the reasons of the last row that declares
        every feature of the call (the row the call is for: its own admission check says why not), or
        of the backend's last, most general row when none declares them all)."""
        refused: List[List[str]] = []
        for p in self.ordered(call):
            why = p.reasons(call)
            if not why:
                return p, []
            refused.append(why)
        for why in reversed(refused):
            if not any(w.startswith("does not support ") for w in why):
                return None, why
        return None, refused[-1] if refused else []

    def reasons(self, call) -> List[str]:
        return self.take(call)[1]


# op -> backend name -> its rows
_REGISTRY: Dict[str, Dict[str, Backend]] = {op: {} for op in FEATURES}


def register(path: Path) -> Path:
    """Adds one row to the registry (a path module's one line)."""
    if path.backend not in BACKENDS:
        raise ValueError(f"backend {path.backend!r} is not in effattn.backends.base.BACKENDS")
    if not path.name.startswith(path.backend + "/"):
        raise ValueError(f"path {path.name!r} must be named '{path.backend}/<path>'")
    unknown = sorted(path.caps.features - FEATURES[path.op])
    if unknown:
        raise ValueError(f"path {path.name!r} ({path.op}) declares unknown features {unknown}; "
                         f"known: {sorted(FEATURES[path.op])}")
    group = _REGISTRY[path.op].get(path.backend)
    if group is None:
        group = _REGISTRY[path.op][path.backend] = Backend(path.backend, path.op)
    group.paths[:] = [p for p in group.paths if p.name != path.name] + [path]   # a re-import replaces
    _VERSION[0] += 1
    return path


def backends_for(op: str) -> List[Backend]:
    """The backends with rows for `op`, in the order of `BACKENDS`."""
    order = list(BACKENDS)
    return sorted(_REGISTRY[op].values(), key=lambda b: order.index(b.name))


def rows(op: str, call=None) -> List[Path]:
    """Every registered row of `op`, in the order "auto" tries them for `call` (by static priority
    when None): by rank, ties in the order of `BACKENDS`, then of registration."""
    return list(_ordered(_rows_entry(op)[6], call))


# op -> (the registry dict, the op's backends dict and its size, BACKENDS and its size, the registry
# version, the rows in static order with their tie keys, device type -> the rows "auto" may take there).
# Dispatch reads it on every call; it is rebuilt when the registry changes: `register`, a row list
# replaced (`Backend.__setattr__`), or the registry, an op's backends or BACKENDS replaced or resized
# (tests patch those).
_ROWS: Dict[str, tuple] = {}
_VERSION = [0]

# zero-argument functions returning what a row's admission check reads besides the call and the
# module switches (`switches`) and that changes without a hook (a thread count): `dispatch_state` is
# part of a dispatch plan's key (effattn.plans) whenever one is declared
_STATE: List[Callable[[], object]] = []


def reads_state(fn: Callable[[], object]) -> Callable[[], object]:
    """Declares ``fn()`` as state a row's admission check reads besides the call: a dispatch plan is
    kept only while it returns the same. Read on every planned call: module switches are cheaper
    declared with `switches`."""
    _STATE.append(fn)
    _VERSION[0] += 1
    return fn


def dispatch_state() -> tuple:
    """Every declared state (`reads_state`): what, besides the call, the registry's version and the
    module switches, decides which row serves it."""
    return tuple([f() for f in _STATE])


class _Switched(types.ModuleType):
    """A path module with switches (`switches`): setting one moves the registry's version."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in self.__dict__.get("_SWITCHES", ()):
            _VERSION[0] += 1            # dispatch plans made before are not used again


def switches(module: str, *names: str) -> None:
    """Declares module ``module``'s attributes ``names`` (``ENABLED``, a rule) as read by a row's
    admission check: setting one (a user, a test's monkeypatch) moves the registry's version, so no
    dispatch plan made before is used again."""
    m = sys.modules[module]
    m._SWITCHES = frozenset(names) | m.__dict__.get("_SWITCHES", frozenset())
    if type(m) is types.ModuleType:
        m.__class__ = _Switched


def _rows_entry(op: str) -> tuple:
    e = _ROWS.get(op)
    if e is not None and e[0] is _REGISTRY and e[1] is _REGISTRY[op] and e[2] == len(e[1]) and \
            e[3] is BACKENDS and e[4] == len(BACKENDS) and e[5] == _VERSION[0]:
        return e
    order = list(BACKENDS)
    group = _REGISTRY[op]
    flat = [(p, order.index(b.name), i) for b in group.values() for i, p in enumerate(b.paths)]
    flat.sort(key=lambda x: (x[0].rank(None), x[1], x[2]))
    e = _ROWS[op] = (_REGISTRY, group, len(group), BACKENDS, len(BACKENDS), _VERSION[0], tuple(flat), {})
    return e


def _ordered(flat: tuple, call) -> Iterable[Path]:
    """The rows of `flat` (static order) in rank order for `call`: sorted again only when a row's
    priority is a function of the call."""
    if call is None or not any(callable(p.priority) for p, _, _ in flat):
        return [p for p, _, _ in flat]
    return [p for p, _, _ in sorted(flat, key=lambda x: (x[0].rank(call), x[1], x[2]))]


def _auto_rows(op: str, device_type: str) -> tuple:
    """(the rows "auto" may take on ``device_type`` in static order with their tie keys, whether any of
    them ranks by the call): the others cannot serve a call there (another device, or named only)."""
    entry = _rows_entry(op)
    got = entry[7].get(device_type)
    if got is None:
        flat = tuple(x for x in entry[6]
                     if device_type in x[0].caps.devices and device_type not in x[0].explicit_only_devices)
        got = entry[7][device_type] = (flat, any(callable(p.priority) for p, _, _ in flat))
    return got


def select(op: str, call, backend: str) -> Path:
    """Picks the row for a call: for "auto" the first row in priority order that admits it, for a
    backend's name the first of its rows that does (or an error saying why none can). Only the rows
    it needs are asked; the reasons of all of them are gathered only for the error message."""
    if backend == "auto":
        flat, dynamic = _auto_rows(op, call.q.device.type)
        for p in (_ordered(flat, call) if dynamic else (x[0] for x in flat)):
            if not p.reasons(call):
                return p
    elif backend in BACKENDS:
        b = _REGISTRY[op].get(backend)
        if b is not None:
            p, _ = b.take(call)
            if p is not None:
                return p
    else:
        names = ", ".join(repr(n) for n in ("auto",) + tuple(BACKENDS))
        raise ValueError(f"{op}: backend must be one of {names}; got {backend!r}")
    table = {b.name: b.reasons(call) for b in backends_for(op)}
    if backend == "auto":
        raise ValueError(f"{op}: no backend can serve this call: " + _describe(table))
    if backend not in table:
        raise RuntimeError(f"{op}: backend {backend!r} {missing_reason(op, backend)}. " + _describe(table))
    ok = [n for n, w in table.items() if not w]
    why = table[backend]
    kind = DtypeNotServed if any(w.startswith("dtype ") for w in why) else CannotServe
    raise kind(f"{op}: backend {backend!r} cannot serve this call: {'; '.join(why)}. "
               f"Backends that can: {', '.join(ok) if ok else 'none'}")


class CannotServe(ValueError, RuntimeError):
    """A named backend cannot serve a call's arguments: a ValueError like every other bad argument
    combination (and a RuntimeError, what earlier versions raised)."""


class DtypeNotServed(TypeError, CannotServe):
    """A named backend does not serve the inputs' dtype: a TypeError like the public functions'
    own dtype errors."""


def missing_reason(op: str, name: str) -> str:
    """Why backend `name` has no `op` registered: its import failed, or it has no kernel for op."""
    if name in UNAVAILABLE:
        return f"is not available: {UNAVAILABLE[name]}"
    return f"has no {op} kernel in this version"


def _describe(table) -> str:
    return "; ".join(f"{n}: {'ok' if not w else ', '.join(w)}" for n, w in table.items())


# the registry and the backend list replaced (tests do) is a new registry for dispatch plans
switches(__name__, "_REGISTRY", "BACKENDS")
