"""The backends. `base.BACKENDS` lists them; each is a folder here whose import registers its ops.

A backend whose import fails for want of an optional dependency (triton not installed, CUDA
extension not built) is recorded with the reason in `base.UNAVAILABLE`, which `effattn.explain`
and dispatch errors show: it never silently disappears. An import error inside effattn's own code
is not swallowed.
"""
import importlib

from . import base


def load(name: str) -> None:
    """Imports backend `name` (its module registers its ops), or records why it is unavailable."""
    module = base.BACKENDS[name]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module:
            base.UNAVAILABLE[name] = "not included in this installation"
        elif missing.startswith("effattn"):
            raise                                  # effattn's own code is broken: say so
        else:
            base.UNAVAILABLE[name] = f"needs the module {missing!r}, which is not installed"


for _name in base.BACKENDS:
    load(_name)
