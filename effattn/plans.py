"""Dispatch plans: a CPU attention call whose arguments match an earlier call's goes straight to the
row that call took.

``effattn.attention`` validates its arguments (`effattn._call.make_attn_call`) and asks the rows in
priority order which can serve (`effattn.backends.base.select`): a few microseconds warm, but tens
after a kernel of a few milliseconds has pushed that code and its objects out of the caches, which
on a short CPU call (L = 256) is 1-2% of the time. A plan keeps, per key, the row and a template of
the validated call; a later call with an equal key builds its call from the template (its own q, k
and v) and runs the row, exactly as the full path would (same row, same call). A row may also give
a plan a runner of its own (`effattn.backends.base.Path.planned`): a function of q, k, v only that
serves the plan's later eager calls as the row's ``run`` would, with no call built (on a short call
each Python frame costs microseconds; tests/core/test_plans.py checks it bitwise against ``run``).

What a key holds, and why that is exact:

- everything validation and the rows' admission checks read of the arguments: the shapes, dtypes and
  classes of q, k, v, ``causal``, ``window``, ``scale``, ``dropout_p``, ``return_lse`` and
  ``backend`` with their classes (``causal=1`` equals ``True`` but is refused by validation, so it
  must never meet the plan of ``causal=True``), the layout and the key padding mask *themselves*
  (identity, as the backends' own caches key them; the mask with its version, so an in-place change
  is a new key: the masked row reads its padding share);
- the dispatch state: the registry's version (a row registered, replaced or patched, the registry or
  the backend list replaced, a module switch of `effattn.backends.base.switches` set) and what
  `effattn.backends.base.reads_state` declares.

A key is stored only after its call validated and a row admitted it, and only for plain CPU tensors,
so a bad argument always meets the full checks and their errors. Calls with dropout (a fresh seed
each call), score terms, packed sequences, positions or an fp32 output, tensor subclasses, other
devices and calls under torch.compile take the full path every time. ``effattn.explain`` asks every
row afresh; it names the row a plan runs (tests/core/test_plans.py checks both agree).
``ENABLED = False`` turns plans off.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ._call import AttnCall
from .backends import base
from .layouts import BlockLayout

ENABLED = True
LIMIT = 64                      # plans kept; the table is emptied when full (keys hold layouts and masks)

# the classes a kept plan's arguments may have (immutable, or a layout keyed by identity as everywhere)
_EXACT = (bool, int, float, str, type(None), tuple, BlockLayout)
_tracing = torch._C._get_tracing_state
_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._functorch.peek_interpreter_stack
_profiling = torch._C._autograd._profiler_enabled


class Plan(NamedTuple):
    path: base.Path             # the row the first call took
    fields: dict                # the validated call's fields (the template)
    runner: Optional[Callable]  # the row's runner for this plan (`Path.planned`), or None


_PLANS: dict = {}


def lookup(q, k, v, causal, window, layout, kpm, scale, dropout_p, return_lse, backend, peek=False):
    """For an ``attention`` call without score terms, packing, positions or an fp32 output:
    ``(result, None)`` when a stored plan served it (``result``: the row's ``(out, lse)``), else
    ``(None, key)`` (key None: no plan may be kept for it). ``peek=True`` (tests) runs nothing and
    gives ``(row, call)`` from a plan or ``(None, key)``. One function: on a short call each Python
    frame costs microseconds."""
    if not ENABLED or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or \
            not (q.is_cpu and k.is_cpu and v.is_cpu) or is_compiling():
        return None, None
    wt = type(window)
    if wt is tuple:                 # (True, 0) equals (1, 0): the classes of its entries too
        wt = (wt, *[type(x) for x in window])
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal, type(causal), window, wt, layout,
           type(layout), id(kpm), None if kpm is None else (type(kpm), getattr(kpm, "_version", None)), scale, type(scale),
           dropout_p, type(dropout_p), return_lse, type(return_lse), backend, type(backend),
           base._VERSION[0], base.dispatch_state() if base._STATE else None)
    try:
        plan = _PLANS.get(key)
    except TypeError:               # an unhashable argument (window=[2, 0]): validation says what is wrong
        return None, None
    # the template holds the key's padding mask itself (so its id in the key cannot be reused)
    if plan is None or plan.fields["key_padding_mask"] is not kpm:
        keep = all(type(x) in _EXACT for x in (causal, window, layout, scale, dropout_p, return_lse, backend)) \
            and dropout_p == 0 and (backend == "auto" or backend == "torch") and (kpm is None or type(kpm) is Tensor) \
            and (type(window) is not tuple or all(type(x) is int for x in window))
        return None, key if keep else None
    if peek:
        return plan.path, _call(plan, q, k, v)
    if plan.runner is not None and not (_tracing() or _modes() or _function_mode() or _transforms() is not None
                                        or _profiling()):
        got = plan.runner(q, k, v)  # eager, plain tensors: the row's runner (None: it leaves this one to run)
        if got is not None:
            return got, None
    return plan.path.run(_call(plan, q, k, v)), None


def _call(plan: Plan, q: Tensor, k: Tensor, v: Tensor) -> AttnCall:
    """The plan's call for these q, k, v: the template's fields, as `make_attn_call` gives them."""
    call = object.__new__(AttnCall)
    d = call.__dict__
    d.update(plan.fields)
    d["q"], d["k"], d["v"] = q, k, v
    return call


def store(key: Optional[tuple], path: base.Path, call) -> None:
    """Keeps the plan of a call the full path validated and `select` gave ``path`` under the key
    `lookup` gave it (None: none may be kept)."""
    if key is None:
        return
    if len(_PLANS) >= LIMIT:
        _PLANS.clear()
    fields = {n: x for n, x in call.__dict__.items() if n not in _PER_CALL}
    _PLANS[key] = Plan(path, fields, path.planned(call) if path.planned else None)


def clear() -> None:
    """Forgets every plan (they are also forgotten whenever the dispatch state changes)."""
    _PLANS.clear()


# the fields each call brings itself (the template holds the rest)
_PER_CALL = ("q", "k", "v")
