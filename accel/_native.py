"""The optional compiled fast paths: :mod:`accel._speedups` when it was built and
``ACCEL_PURE_PYTHON`` is not ``1``, else None.

Pure Python is accel's reference: a module with a compiled fast path asks here once,
at import, and plugs the extension in at one place (``if speedups is not None:``).
The extension does the same steps on the same objects, and the tests of what it
replaces run both ways (``ACCEL_PURE_PYTHON=1`` forces the pure-Python path; README's
test command reruns the tests marked ``speedups``, tests/conftest.py).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["speedups"]


def _load() -> ModuleType | None:
    if os.environ.get("ACCEL_PURE_PYTHON") == "1":
        return None
    try:
        # by name: a static import of the extension reads as one of the package
        # ``accel`` to the layer contracts
        return importlib.import_module("accel._speedups")
    except ImportError:  # not built: no compiler where accel was installed
        return None


speedups = _load()
