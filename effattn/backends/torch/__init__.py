"""The torch backend: softmax attention (`attention/`) and linear attention (`linear/`), the
readable reference math plus the fast CPU paths."""
from . import attention, linear  # noqa: F401  (registers both ops' rows)
