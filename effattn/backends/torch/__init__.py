"""The torch backend: softmax attention (`attention/`) and linear attention (`linear/`), the
readable reference math plus the fast CPU paths."""
from . import attention, linear, lsh, paged, relative  # noqa: F401  (registers the ops' rows)
