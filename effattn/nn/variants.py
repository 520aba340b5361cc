"""The variant arguments of `effattn.nn.MultiheadAttention` and `swap_attention` (``window``,
``layout``, ``linear``, ``backend``, ``context_parallel``) and their checks, shared by both."""
from __future__ import annotations

from ..backends import base as backend_registry
from ..distributed import ContextParallel
from ..feature_maps import NAMED_FEATURE_MAPS
from ..layouts import BlockLayout
from ..visibility import normalize_window

VARIANT_KEYS = ("window", "layout", "linear", "backend", "context_parallel")



def check_variant(fn: str, *, window=None, layout=None, linear=None, backend="auto", context_parallel=None) -> None:
    """Raises a ValueError/TypeError naming ``fn`` for an impossible or malformed variant."""
    if context_parallel is not None:
        if not isinstance(context_parallel, ContextParallel):
            raise TypeError(f"{fn}: context_parallel must be an effattn.distributed.ContextParallel, got "
                            f"{type(context_parallel).__name__}")
        if layout is not None:
            raise ValueError(f"{fn}: a layout cannot be combined with context_parallel")
    if window is not None:
        try:
            normalize_window(window, False)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{fn}: {str(e).split(': ', 1)[-1]}") from None
    if layout is not None and not (isinstance(layout, BlockLayout) or callable(layout)):
        raise TypeError(f"{fn}: layout must be an effattn.layouts.BlockLayout or a callable "
                        f"(Lq, Lk) -> BlockLayout, got {type(layout).__name__}")
    if linear is not None:
        if isinstance(linear, str) and linear not in NAMED_FEATURE_MAPS and linear != "favor":
            names = ", ".join(repr(n) for n in (*NAMED_FEATURE_MAPS, "favor"))
            raise ValueError(f"{fn}: unknown linear feature map {linear!r}; expected one of {names}, an "
                             "effattn.FavorFeatures or a callable (..., D) -> (..., F)")
        if not isinstance(linear, str) and not callable(linear):
            raise TypeError(f"{fn}: linear must be a feature-map name, an effattn.FavorFeatures or a callable, "
                            f"got {type(linear).__name__}")
        if window is not None or layout is not None:
            raise ValueError(f"{fn}: linear attention has no window or layout (it never forms the score "
                             "matrix a mask would cut); choose linear= or window=/layout=, not both")
    names = ("auto",) + tuple(backend_registry.BACKENDS)
    if backend not in names:
        raise ValueError(f"{fn}: backend must be one of {', '.join(repr(b) for b in names)}; got {backend!r}")
