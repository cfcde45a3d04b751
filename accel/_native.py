"""accel's compiled hot paths, :mod:`accel._speedups` (``_speedups.c`` beside this file).

The extension is part of every build, as the allocator's native core is (setup.py
builds both, and an install without a C compiler fails there). A module with a hot
path in C imports ``speedups`` from here and plugs it in at import: the C is the
implementation of that path's common case and hands every other case back to the
Python code, which keeps only those.

The extension reads the slots and calls the methods of accel's Python classes, so one
built from another version of ``_speedups.c`` (an old ``.so`` left in ``build/`` or in
the tree) is refused: it carries the CRC-32 of its source (``SOURCE_CRC32``, set by
setup.py), which must equal that of the source installed with the package. A missing
or stale extension is an :class:`ImportError` that says how to rebuild it.
:func:`describe` names the extension's file and CRC (``accel info``).
"""

from __future__ import annotations

import importlib
import os
import zlib
from typing import TYPE_CHECKING

__all__ = ["describe", "source_crc32", "speedups"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_speedups.c")
_REBUILD = "rebuild it: `python setup.py build_ext --inplace` in a source tree, or reinstall accel"


def source_crc32(path: str = _SOURCE) -> str | None:
    """The CRC-32 of ``_speedups.c`` as setup.py writes it (8 hex digits), None when absent."""
    try:
        with open(path, "rb") as source:
            return f"{zlib.crc32(source.read()):08x}"
    except FileNotFoundError:
        return None


def _load() -> object:
    """The extension, checked against the source installed beside it."""
    try:
        # by name: a static import of the extension reads as one of the package
        # ``accel`` to the layer contracts
        module = importlib.import_module("accel._speedups")
    except ImportError as exc:
        raise ImportError(f"accel._speedups is not built ({exc}): {_REBUILD}") from exc
    built = getattr(module, "SOURCE_CRC32", None)
    source = source_crc32()
    if source is not None and built != source:
        raise ImportError(
            f"{module.__file__} was built from another version of accel/_speedups.c (CRC-32 "
            f"{built or 'not recorded'}, the source's is {source}): {_REBUILD}"
        )
    return module


if TYPE_CHECKING:
    from accel import _speedups as speedups
else:
    speedups = _load()


def describe() -> dict[str, str | None]:
    """The extension's file, the CRC-32 it was built from and that of the source beside it.

    >>> from accel._native import describe
    >>> sorted(describe())
    ['built_crc32', 'file', 'source_crc32']
    """
    return {
        "file": speedups.__file__,
        "built_crc32": speedups.SOURCE_CRC32,
        "source_crc32": source_crc32(),
    }
