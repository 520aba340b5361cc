"""Dispatch plans: a CPU attention call whose arguments match an earlier call's goes straight to the
row that call took.

``effattn.attention`` validates its arguments (`effattn._call.make_attn_call`) and asks the rows in
priority order which can serve (`effattn.backends.base.select`): a few microseconds warm, but tens
after a kernel of a few milliseconds has pushed that code and its objects out of the caches, which
on a short CPU call (L = 256) is 1-2% of the time. A plan keeps, per key, the row and a template of
the validated call; a later call with an equal key builds its call from the template (its own q, k,
v and key padding mask) and runs the row, exactly as the full path would (same row, same call).

What a key holds, and why that is exact:

- everything validation and the rows' admission checks read of the arguments: the shapes and dtypes
  of q, k, v (all plain CPU tensors), ``causal``, ``window``, ``scale``, ``return_lse`` and
  ``backend`` with their exact types (``causal=1`` is refused by validation, so it never meets the
  plan of ``causal=True``), the layout and the key padding mask *themselves* (identity, as the
  backends' own caches key them; the mask with its version, so an in-place change is a new key:
  the masked row reads its padding share);
- the dispatch state (`effattn.backends.base.dispatch_state`): the registry's version (a row
  registered, replaced or patched) and the module switches the rows read (``cpu_blocks.ENABLED``,
  the masked row's rule and fork guard, ...).

A key is stored only after its call validated and a row admitted it, so a bad argument always meets
the full checks and their errors. Calls with dropout (a fresh seed each call), score terms, packed
sequences, positions or an fp32 output, tensor subclasses, other devices and calls under
torch.compile take the full path every time. ``effattn.explain`` asks every row afresh; it names the
row a plan runs (tests/core/test_plans.py checks both agree). ``ENABLED = False`` turns plans off.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._call import AttnCall
from .backends import base
from .layouts import BlockLayout

ENABLED = True
LIMIT = 64                      # plans kept; the table is emptied when full (keys hold layouts and masks)

_NUMBER = (int, float)


class Plan(NamedTuple):
    path: base.Path             # the row the first call took
    fields: dict                # the validated call's fields (the template)
    entry: tuple                # the registry entry it was chosen from (`base._rows_entry`)


_PLANS: dict = {}


def lookup(q, k, v, causal, window, layout, kpm, scale, dropout_p, return_lse, backend):
    """For an ``attention`` call without score terms, packing, positions or an fp32 output:
    ``(row, call)`` from a stored plan, else ``(None, key)`` (key None: the call takes the full path
    every time). One function, not two: on a short call each Python frame costs microseconds."""
    if not ENABLED or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or \
            not (q.is_cpu and k.is_cpu and v.is_cpu) or torch.compiler.is_compiling():
        return None, None
    if (causal is not True and causal is not False) or type(return_lse) is not bool or \
            type(dropout_p) not in _NUMBER or dropout_p != 0 or (scale is not None and type(scale) not in _NUMBER) or \
            (backend != "auto" and backend != "torch") or type(backend) is not str:
        return None, None
    if window is not None and type(window) is not int and not (
            type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int):
        return None, None
    if (layout is not None and type(layout) is not BlockLayout) or (kpm is not None and type(kpm) is not Tensor):
        return None, None
    plan_key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal, window, layout,
                (id(kpm), kpm._version) if kpm is not None else None, scale, return_lse, backend,
                base.dispatch_state())
    plan = _PLANS.get(plan_key)
    # the template holds the key's padding mask itself (so its id in the key cannot be reused)
    if plan is None or plan.fields["key_padding_mask"] is not kpm or plan.entry is not base._rows_entry("attention"):
        return None, plan_key
    call = object.__new__(AttnCall)
    d = call.__dict__
    d.update(plan.fields)
    d["q"], d["k"], d["v"] = q, k, v
    return plan.path, call


def store(plan_key: Optional[tuple], path: base.Path, call) -> None:
    """Keeps the plan of a call the full path validated and `select` gave ``path``."""
    if plan_key is None:
        return
    if len(_PLANS) >= LIMIT:
        _PLANS.clear()
    fields = {n: x for n, x in call.__dict__.items() if n not in _PER_CALL}
    _PLANS[plan_key] = Plan(path, fields, base._rows_entry("attention"))


def clear() -> None:
    """Forgets every plan (they are also forgotten whenever the dispatch state changes)."""
    _PLANS.clear()


# the fields each call brings itself (the template holds the rest)
_PER_CALL = ("q", "k", "v")
