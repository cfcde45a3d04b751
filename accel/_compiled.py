"""Whether accel's hot modules run compiled (mypyc), and the decorator they use.

accel is pure Python; ``ACCEL_MYPYC=1 pip install .`` (with mypy installed)
compiles the modules of :data:`MODULES` with mypyc instead. Both builds
behave the same, and the test suite runs against either; :func:`compiled`
says which one this process imported.

This module is never compiled and imports nothing from accel, so every
layer may use it.

>>> from accel._compiled import compiled
>>> isinstance(compiled(), tuple)
True
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

__all__ = ["MODULES", "compiled", "mypyc_attr"]

#: The modules ``ACCEL_MYPYC=1`` compiles (setup.py reads this list).
MODULES = (
    "accel.allocator._blocks",
    "accel.allocator._buffer",
    "accel.allocator._caching",
    "accel.allocator._freelist",
    "accel.allocator._stats",
)

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:

    def mypyc_attr(*attrs, **kwattrs):
        """mypyc's class options; in pure Python a decorator that does nothing
        (so that mypy_extensions is needed only to compile)."""
        return lambda cls: cls


def compiled() -> tuple[str, ...]:
    """The modules of :data:`MODULES` this process imported as compiled extensions."""
    out = []
    for name in MODULES:
        module = sys.modules.get(name)
        if module is not None and not (getattr(module, "__file__", None) or "").endswith(".py"):
            out.append(name)
    return tuple(out)
