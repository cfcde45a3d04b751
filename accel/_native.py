"""The optional compiled fast paths: :mod:`accel._speedups` when it was built from the
``_speedups.c`` beside this file and ``ACCEL_PURE_PYTHON`` is not ``1``, else None.

Pure Python is accel's reference: a module with a compiled fast path asks here once,
at import, and plugs the extension in at one place (``if speedups is not None:``).
The extension does the same steps on the same objects, and the whole test suite
runs both ways (``ACCEL_PURE_PYTHON=1`` forces the pure-Python path).

The extension reads the slots and calls the methods of accel's Python classes, so one
built from another version of ``_speedups.c`` (an old ``.so`` left in ``build/`` or in
the tree, reused when a later build found no compiler) is refused with a
RuntimeWarning: it carries the CRC-32 of its source (``SOURCE_CRC32``, set by
setup.py), which must equal that of the source installed with the package.
:func:`describe` says which path is in use and why (``accel info``).
"""

from __future__ import annotations

import importlib
import os
import zlib
from types import ModuleType

from accel._errors import warn_at_caller

__all__ = ["describe", "source_crc32", "speedups"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_speedups.c")


def source_crc32(path: str = _SOURCE) -> str | None:
    """The CRC-32 of ``_speedups.c`` as setup.py writes it (8 hex digits), None when absent."""
    try:
        with open(path, "rb") as source:
            return f"{zlib.crc32(source.read()):08x}"
    except FileNotFoundError:
        return None


def _load() -> tuple[ModuleType | None, str]:
    """The extension, or None and why."""
    if os.environ.get("ACCEL_PURE_PYTHON") == "1":
        return None, "ACCEL_PURE_PYTHON=1"
    try:
        # by name: a static import of the extension reads as one of the package
        # ``accel`` to the layer contracts
        module = importlib.import_module("accel._speedups")
    except ImportError as exc:  # not built: no compiler where accel was installed
        return None, f"accel._speedups is not built ({exc})"
    built = getattr(module, "SOURCE_CRC32", None)
    source = source_crc32()
    if source is not None and built != source:
        reason = (
            f"{module.__file__} was built from another version of accel/_speedups.c (CRC-32 "
            f"{built or 'not recorded'}, the source's is {source}): accel runs pure Python. Rebuild it "
            "(`python setup.py build_ext --inplace`, or reinstall accel with a C compiler) or delete it"
        )
        warn_at_caller(reason, RuntimeWarning)
        return None, reason
    return module, ""


speedups, _reason = _load()


def describe() -> dict[str, str | bool | None]:
    """Whether the compiled paths are in use, the extension's file, and why not.

    >>> from accel._native import describe
    >>> sorted(describe())
    ['compiled', 'file', 'reason', 'source_crc32']
    """
    return {
        "compiled": speedups is not None,
        "file": None if speedups is None else speedups.__file__,
        "source_crc32": source_crc32(),
        "reason": _reason or None,
    }
