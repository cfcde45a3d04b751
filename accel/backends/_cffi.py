"""cffi's lazy work done up front, so that no later backend call can block on cffi's locks.

cffi parses a type string the first time it meets it, and resolves a library
symbol the first time it is read, each under a lock: its FFI's own lock, and
for parsing also the process-wide lock around pycparser. Neither is
reentrant, and pycparser allocates heavily while holding them, so a garbage
collection can start there and run the finalizer of an accel Stream, Event or
Graph on the same thread. If that finalizer's backend call then needed one of
the locks, the thread would wait on itself forever. A backend therefore
calls :func:`resolve_everything` when it is created, and after that never
makes cffi parse or resolve anything (tests/backends/test_cffi.py checks this
over the conformance suite).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["resolve_everything"]


def resolve_everything(ffi: Any, types: Iterable[str], lib: Any = None) -> frozenset[str]:
    """Parse every type in ``types`` and read every name ``lib`` (if given) declares.

    Returns the declared names the library does not export (cffi would retry
    them, under its lock, on every later read). A callback's function type is
    parsed where the backend makes the callback, at creation too.

    >>> import cffi
    >>> ffi = cffi.FFI(); ffi.cdef("int abs(int); int no_such_function(void);")
    >>> sorted(resolve_everything(ffi, ["int *"], ffi.dlopen(None)))
    ['no_such_function']
    """
    for ctype in types:
        ffi.typeof(ctype)
    missing = set()
    for name in dir(lib) if lib is not None else ():
        try:
            getattr(lib, name)
        except (AttributeError, NotImplementedError):  # not exported; a non-integer constant
            missing.add(name)
    return frozenset(missing)
