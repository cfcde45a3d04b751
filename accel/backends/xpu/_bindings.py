"""Level Zero through cffi in ABI mode: loading the loader, probing entry points, mapping errors.

Nothing here runs at import time: :func:`open_loader` parses the
declarations and dlopens the loader when the backend is first loaded (after
accel/backends/xpu/_library.py found, without cffi, that ``zeInit`` works).
"""

from __future__ import annotations

import threading
from typing import Any, TypeAlias

import cffi

from accel._errors import DriverError, InvalidHandleError, NotSupportedError, OutOfMemoryError
from accel.backends._cffi import resolve_everything
from accel.backends.xpu._cdef import CDEF
from accel.backends.xpu._library import (
    DEFAULT_LOADER,
    DESCRIPTIONS,
    LOADER_ENTRY_POINTS,
    cannot_open,
    describe_result,
    not_a_loader,
    result_name,
)

__all__ = ["DEFAULT_LOADER", "WAIT_FOREVER", "ZeLoader", "describe_result", "open_loader", "result_name"]

#: ``timeout`` argument meaning "block until done".
WAIT_FOREVER = (1 << 64) - 1

_OOM = frozenset({0x70000002, 0x70000003})  # OUT_OF_HOST_MEMORY, OUT_OF_DEVICE_MEMORY
_INVALID_HANDLE = 0x78000005  # ZE_RESULT_ERROR_INVALID_NULL_HANDLE
_UNSUPPORTED = 0x78000003  # ZE_RESULT_ERROR_UNSUPPORTED_FEATURE

#: A library cffi dlopened: its attributes (functions, enum constants) are made from the
#: declarations in _cdef.py at run time, so no static type describes them; the
#: declarations are their types. (cffi ships no type information for ``cffi.FFI``
#: either.)
ZeLib: TypeAlias = Any

_ffi: cffi.FFI | None = None
_ffi_lock = threading.Lock()


def _get_ffi() -> cffi.FFI:
    global _ffi
    with _ffi_lock:
        if _ffi is None:
            ffi = cffi.FFI()
            ffi.cdef(CDEF)
            _ffi = ffi
        return _ffi


class ZeLoader:
    """The dlopened loader: ``ffi``, ``lib`` and error checking.

    Every declared symbol is resolved here, once: cffi resolves a symbol under
    its lock on first access (and retries a missing one on every access), which a
    finalizer must never wait on (see accel/backends/_cffi.py).
    """

    def __init__(self, ffi: cffi.FFI, lib: ZeLib, path: str) -> None:
        self.ffi = ffi
        self.lib = lib
        self.path = path
        self._missing = resolve_everything(ffi, (), lib)

    def has(self, name: str) -> bool:
        """Whether the loader exports ``name``."""
        return name not in self._missing

    def check(self, call: str, code: int, *, device: int | None = None, requested: int = 0) -> None:
        """Raise the accel exception for a failed ``call`` (``code`` != ZE_RESULT_SUCCESS)."""
        if code == 0:
            return
        name = result_name(code)
        where = f"xpu:{device}" if device is not None else "xpu"
        if code in _OOM:
            message = f"{call} failed on {where}: {describe_result(code)}"
            if requested:
                message += f" (requested {requested} bytes)"
            raise OutOfMemoryError(
                message + "; free memory (or accel's cached blocks) and retry",
                requested=requested,
                device=device,
            )
        if code == _INVALID_HANDLE:
            raise InvalidHandleError(f"{call} failed on {where}: {describe_result(code)}")
        if code == _UNSUPPORTED:
            raise NotSupportedError(
                f"{call} is not supported by the Level Zero driver on {where} ({name})"
            )
        raise DriverError("xpu", call, code, name, DESCRIPTIONS.get(name, ""), device=device)


def open_loader(path: str, *, from_env: bool = False) -> ZeLoader:
    """dlopen the Level Zero loader at ``path``; no call into it is made yet.

    ``from_env`` says the path came from ``ACCEL_ZE_LOADER`` (the message
    then names the variable). Raises :class:`~accel.BackendUnavailableError`
    with a one-line reason.
    """
    ffi = _get_ffi()
    try:
        lib = ffi.dlopen(path)
    except OSError as exc:
        raise cannot_open(path, from_env, str(exc)) from None
    loader = ZeLoader(ffi, lib, path)
    for name in LOADER_ENTRY_POINTS:
        if not loader.has(name):
            raise not_a_loader(path, name)
    return loader
