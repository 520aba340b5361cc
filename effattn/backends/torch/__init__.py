"""The torch reference backend: softmax attention (`attention`) and linear attention (`linear`)."""
from . import attention, linear  # noqa: F401  (registers both ops)
