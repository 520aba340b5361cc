"""The backends. `base.BACKENDS` lists them; each is a folder here whose import registers its ops.

A backend whose import fails (triton not installed, CUDA extension not built) is recorded with the
reason in `base.UNAVAILABLE`, which `effattn.explain` and dispatch errors show: it never silently
disappears. An import error inside effattn's own code is not swallowed: only a missing optional
dependency (a ModuleNotFoundError for a module outside the backend's package) is.
"""
import importlib

from . import base

for _name, _module in base.BACKENDS.items():
    try:
        importlib.import_module(_module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == _module or not exc.name.startswith("effattn")):
            base.UNAVAILABLE[_name] = (f"no module {exc.name!r} (this installation does not have it)"
                                       if exc.name != _module else "not included in this installation")
        else:
            raise
