"""Importing PyTorch on first use, with an accel error when it is missing.

torch is an optional dependency: accel imports it only inside the functions
that need it, through :func:`import_torch`.

>>> from accel._torch import import_torch
>>> import_torch().__name__
'torch'
"""

from __future__ import annotations

from typing import Any

from accel._errors import NotSupportedError

__all__ = ["import_torch"]


def import_torch() -> Any:
    """The ``torch`` module; :class:`~accel.NotSupportedError` when it is not installed."""
    try:
        import torch
    except ImportError:
        raise NotSupportedError(
            "this needs PyTorch, which is not installed; install it with `pip install accel[torch]`"
        ) from None
    return torch
