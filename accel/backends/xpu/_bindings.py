"""Level Zero through cffi in ABI mode: loading the loader, probing entry points, mapping errors.

Nothing here runs at import time: :func:`open_loader` parses the
declarations and dlopens the loader when the backend is first loaded.
"""

from __future__ import annotations

import threading

import cffi

from accel._errors import (
    BackendUnavailableError,
    DriverError,
    InvalidHandleError,
    NotSupportedError,
    OutOfMemoryError,
)
from accel.backends._cffi import resolve_everything
from accel.backends.xpu._cdef import CDEF

__all__ = ["DEFAULT_LOADER", "WAIT_FOREVER", "ZeLoader", "describe_result", "open_loader", "result_name"]

#: The soname Debian's ``libze1`` installs (and Intel's packages too).
DEFAULT_LOADER = "libze_loader.so.1"

#: ``timeout`` argument meaning "block until done".
WAIT_FOREVER = (1 << 64) - 1

_OOM = frozenset({0x70000002, 0x70000003})  # OUT_OF_HOST_MEMORY, OUT_OF_DEVICE_MEMORY
_INVALID_HANDLE = 0x78000005  # ZE_RESULT_ERROR_INVALID_NULL_HANDLE
_UNSUPPORTED = 0x78000003  # ZE_RESULT_ERROR_UNSUPPORTED_FEATURE

# Short explanations for the codes people meet; the header's comments are terser.
_DESCRIPTIONS = {
    "ZE_RESULT_NOT_READY": "the work has not completed yet",
    "ZE_RESULT_ERROR_DEVICE_LOST": "the device hung or was reset; the process must restart its GPU work",
    "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY": "the driver ran out of host memory",
    "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY": "the device is out of memory",
    "ZE_RESULT_ERROR_UNINITIALIZED": "no Level Zero driver is installed, or none initialized",
    "ZE_RESULT_ERROR_UNSUPPORTED_VERSION": "the driver does not support the requested API version",
    "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE": "the driver does not implement this call",
    "ZE_RESULT_ERROR_INVALID_ARGUMENT": "an argument is invalid",
    "ZE_RESULT_ERROR_INVALID_NULL_HANDLE": "a handle is null or no longer valid",
    "ZE_RESULT_ERROR_INVALID_NULL_POINTER": "a required pointer is null",
    "ZE_RESULT_ERROR_INVALID_SIZE": "a size is zero or too large",
    "ZE_RESULT_ERROR_UNSUPPORTED_SIZE": "the size is larger than the device supports",
    "ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT": "the alignment is not supported",
    "ZE_RESULT_ERROR_INVALID_ENUMERATION": "an enumeration value is invalid",
    "ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE": "the object is still in use by pending work",
}

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


def result_name(code: int) -> str:
    """Symbolic ``ze_result_t`` name of ``code``.

    >>> result_name(0x78000001)
    'ZE_RESULT_ERROR_UNINITIALIZED'
    """
    text = _get_ffi().string(_get_ffi().cast("ze_result_t", code))
    # cffi answers with the number itself for values the enum does not name.
    return text if isinstance(text, str) and text.startswith("ZE_") else f"ze_result_t {code:#x}"


def describe_result(code: int) -> str:
    """``NAME (0x...): explanation`` for messages.

    >>> describe_result(0x78000001)
    'ZE_RESULT_ERROR_UNINITIALIZED (0x78000001): no Level Zero driver is installed, or none initialized'
    """
    name = result_name(code)
    text = f"{name} ({code:#x})"
    description = _DESCRIPTIONS.get(name)
    return f"{text}: {description}" if description else text


class ZeLoader:
    """The dlopened loader: ``ffi``, ``lib`` and error checking.

    Every declared symbol is resolved here, once: cffi resolves a symbol under
    its lock on first access (and retries a missing one on every access), which a
    finalizer must never wait on (see accel/backends/_cffi.py).
    """

    def __init__(self, ffi: cffi.FFI, lib: object, path: str) -> None:
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
        raise DriverError("xpu", call, code, name, _DESCRIPTIONS.get(name, ""), device=device)


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
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        missing = "cannot open shared object file" in detail or "No such file" in detail
        if missing and from_env:
            reason = f"ACCEL_ZE_LOADER={path} not found: point it at libze_loader.so.1, or unset it"
        elif missing:
            reason = f"{path} not found: install Debian's libze1 (apt-get install libze1) or set ACCEL_ZE_LOADER"
        else:
            reason = f"cannot load {path}: {detail}"
        raise BackendUnavailableError("xpu", reason) from None
    loader = ZeLoader(ffi, lib, path)
    for name in ("zeInit", "zeDriverGet", "zeDeviceGet"):
        if not loader.has(name):
            raise BackendUnavailableError(
                "xpu", f"{path} does not export {name}: it is not a Level Zero loader (libze_loader.so.1)"
            )
    return loader
